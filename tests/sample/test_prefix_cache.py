"""The sampler's prefix cache: a hit computes only the new tokens and returns what the uncached
run returns; blocks never cross versions, the base, or a version published again; the byte
budget evicts least recently used leaves; hits work mid-block, mid-batch and on the history of
a finished turn; a group's prompt is prefilled once."""

from __future__ import annotations

import pytest
import torch

from lorafleet.model.banks import AdapterSpec
from lorafleet.sample import SampleEngine, SampleRequest, SamplingParams
from lorafleet.sample.prefix_cache import PrefixCache
from lorafleet.sample.types import SampleResult
from tests.sample.test_engine import make_stack, prompt, randomize

BLOCK = 16
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, seed=7, stop=[])

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def stack2():
    return make_stack(2)


def engine(stack, cache_bytes: int | None = None, **kwargs) -> SampleEngine:
    return SampleEngine(stack.adapted, stack.versions, prefix_cache_bytes=cache_bytes, **kwargs)


def uncached(stack, request: SampleRequest) -> SampleResult:
    (result,) = engine(stack, 0).generate([request])
    return result


def assert_same(a: SampleResult, b: SampleResult) -> None:
    """Tokens equal (seeded), log-probs to the batch-independence tolerance of test_engine.py."""
    assert a.ok and b.ok
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    for sa, sb in zip(a.sequences, b.sequences, strict=True):
        torch.testing.assert_close(
            torch.tensor(sa.logprobs), torch.tensor(sb.logprobs), atol=1e-5, rtol=0
        )


def hits(e: SampleEngine) -> int:
    return e.prefix_cache.counters.hit_tokens


def test_a_hit_computes_only_new_tokens_and_equals_the_uncached_run(stack2):
    stack, keys = stack2
    e = engine(stack)
    for adapter in (keys[0], None):
        request = SampleRequest(prompt(1, 50), SEEDED, adapter=adapter, num_samples=2)
        before = e.prefix_cache.stats()
        (first,) = e.generate([request])
        (second,) = e.generate([request])
        after = e.prefix_cache.stats()
        assert (
            after["hit_tokens"] == before["hit_tokens"] + 48
        )  # 3 full blocks of 49 (not the last)
        assert after["missed_tokens"] == before["missed_tokens"] + 50 + 2
        assert_same(second, uncached(stack, request))
        assert_same(first, second)
    stats = e.prefix_cache.stats()
    assert stats["lookups"] == 4 and stats["hit_rate"] == pytest.approx(96 / 200)


def test_no_hit_across_versions_or_between_an_adapter_and_the_base(stack2):
    stack, keys = stack2
    e = engine(stack)
    tokens = prompt(2, 40)
    e.generate([SampleRequest(tokens, SEEDED, adapter=keys[0])])
    for other in (keys[1], None):
        request = SampleRequest(tokens, SEEDED, adapter=other)
        (result,) = e.generate([request])
        assert hits(e) == 0
        assert_same(result, uncached(stack, request))
    e.generate([SampleRequest(tokens, SEEDED, adapter=keys[0])])
    assert hits(e) == 32


def test_a_version_published_again_never_hits_the_dropped_versions_blocks():
    stack, _ = make_stack(0)
    slot = stack.trainer.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=3))
    randomize(stack, slot, seed=11)
    key = stack.versions.publish("again", stack.trainer.bank, slot, version=0)
    e = engine(stack)
    request = SampleRequest(prompt(3, 40), SEEDED, adapter=key)
    (old,) = e.generate([request])
    stack.versions.drop(key)
    randomize(stack, slot, seed=12)
    assert stack.versions.publish("again", stack.trainer.bank, slot, version=0) == key
    (new,) = e.generate([request])
    stats = e.prefix_cache.stats()
    assert stats["hit_tokens"] == 0 and stats["invalidated"] == 2
    assert_same(new, uncached(stack, request))
    assert [s.tokens for s in new.sequences] != [s.tokens for s in old.sequences]


def fake_reader(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    kv = torch.arange(start, stop, dtype=torch.float32).view(1, 1, -1, 1)
    return kv, kv.clone()


def test_eviction_is_least_recently_used_and_leaves_first():
    block_bytes = 2 * 4 * 4  # keys + values of a 4-token block, one layer, one head, fp32
    cache = PrefixCache(5 * block_bytes, block_tokens=4)
    root = cache.root(None, None)
    a, b, c = list(range(12)), list(range(100, 108)), list(range(200, 208))
    assert cache.insert(root, a, fake_reader) == 3
    assert cache.insert(root, b, fake_reader) == 2
    assert len(cache.lookup(root, a, 12)) == 3  # a is now more recent than b
    assert cache.insert(root, c, fake_reader) == 2
    stats = cache.stats()
    assert stats["evictions"] == 2 and stats["bytes"] == 5 * block_bytes
    assert cache.lookup(root, b, 8) == []
    assert len(cache.lookup(root, a, 12)) == 3 and len(cache.lookup(root, c, 8)) == 2
    # The KV of a hit is what was inserted, position by position (block 1 of c: 4..7).
    assert cache.lookup(root, c, 8)[1].keys.flatten().tolist() == [4.0, 5.0, 6.0, 7.0]
    # A longer chain than the budget keeps its head: leaves go first, so no chain has a hole.
    d = list(range(300, 324))
    cache.insert(root, d, fake_reader)
    ids = {blk.id for blk in cache.blocks()}
    assert all(blk.parent == root or blk.parent in ids for blk in cache.blocks())
    assert len(cache.lookup(root, d, 24)) == 5 and cache.stats()["blocks"] == 5


def test_a_small_byte_budget_evicts_and_answers_stay_equal(stack2):
    stack, keys = stack2
    per_token = (
        SampleEngine.default_prefix_cache_bytes(stack.adapted.model.config, torch.float32, 1) // 512
    )
    e = engine(stack, 3 * BLOCK * per_token)
    requests = [SampleRequest(prompt(10 + i, 40), SEEDED, adapter=keys[0]) for i in range(3)]
    for request in requests:
        e.generate([request])
    stats = e.prefix_cache.stats()
    assert stats["evictions"] > 0 and stats["bytes"] <= stats["max_bytes"]
    assert stats["blocks"] == 3
    (last,) = e.generate([requests[-1]])  # the most recent survives
    assert hits(e) == 32
    assert_same(last, uncached(stack, requests[-1]))


def test_a_prompt_that_diverges_mid_block_reuses_the_blocks_before_it(stack2):
    stack, keys = stack2
    e = engine(stack)
    shared = prompt(4, 40)
    e.generate([SampleRequest(shared + prompt(5, 8), SEEDED, adapter=keys[1])])
    diverged = SampleRequest(shared + prompt(6, 10), SEEDED, adapter=keys[1])
    fresh = SampleRequest(prompt(14, 30), SEEDED, adapter=None)
    # one prefill of rows resuming at different lengths: 32 cached positions and none
    result, other = e.generate([diverged, fresh])
    assert hits(e) == 32  # blocks 0-1; block 2 (positions 32-47) diverges at 40
    assert_same(result, uncached(stack, diverged))
    assert_same(other, uncached(stack, fresh))


def test_a_request_arriving_mid_batch_hits_the_history_of_a_finished_turn(stack2):
    """Turn 2 of a conversation (turn 1's prompt + its sampled tokens + new observation tokens)
    arrives while another sequence decodes, and hits turn 1's generated tokens too."""
    stack, keys = stack2
    e = engine(stack, max_rows=4)
    turn1 = prompt(7, 40)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, stop=[])
    (first,) = e.generate([SampleRequest(turn1, greedy, adapter=keys[0])])
    long_running = e.submit(
        [SampleRequest(prompt(8, 5), SamplingParams(max_tokens=20, stop=[]), adapter=keys[1])]
    )
    for _ in range(3):
        assert e.step()
    turn2 = SampleRequest(
        turn1 + first.sequences[0].tokens + prompt(9, 10), SEEDED, adapter=keys[0]
    )
    (late,) = e.submit([turn2])
    while not late.done():
        e.step()
    assert not long_running[0].done()  # it ran beside the long one
    # turn 1 left 40 + 11 positions (its last token was never fed back): 3 full blocks, beyond
    # the 2 of its prompt alone
    assert hits(e) == 48
    assert_same(late.result(), uncached(stack, turn2))
    while e.has_work():
        e.step()


def test_a_groups_prompt_is_prefilled_once_with_and_without_the_cache(stack2):
    stack, keys = stack2
    request = SampleRequest(prompt(12, 40), SEEDED, adapter=keys[0], num_samples=4)
    off = engine(stack, 0)
    (result,) = off.generate([request])
    stats = off.prefix_cache.stats()
    assert (stats["lookups"], stats["missed_tokens"], stats["blocks"]) == (1, 40, 0)
    on = engine(stack)
    on.generate([request])
    (again,) = on.generate([request])
    stats = on.prefix_cache.stats()
    assert (stats["lookups"], stats["hit_tokens"], stats["missed_tokens"]) == (2, 32, 48)
    assert len(again.sequences) == 4
    assert_same(again, result)


def test_requests_for_prompt_logprobs_compute_every_scored_position(stack2):
    stack, keys = stack2
    e = engine(stack)
    tokens = prompt(13, 40)
    e.generate([SampleRequest(tokens, SEEDED, adapter=keys[0])])
    scored = SampleRequest(tokens, SEEDED, adapter=keys[0], prompt_logprobs=True)
    (result,) = e.generate([scored])
    assert hits(e) == 0
    reference = uncached(stack, scored)
    assert_same(result, reference)
    assert result.prompt_logprobs is not None and reference.prompt_logprobs is not None
    torch.testing.assert_close(
        torch.tensor(result.prompt_logprobs[1:]),
        torch.tensor(reference.prompt_logprobs[1:]),
        atol=1e-5,
        rtol=0,
    )
    # Targets from row 20 on: positions before it may come from the cache (one block).
    targets = torch.full((39, 1), -1, dtype=torch.int64)
    targets[20:, 0] = torch.tensor(tokens[21:])
    target_request = SampleRequest(tokens, SEEDED, adapter=keys[0], target_prompt_logprobs=targets)
    (with_targets,) = e.generate([target_request])
    assert hits(e) == 16
    expected = uncached(stack, target_request).target_prompt_logprobs
    assert with_targets.target_prompt_logprobs is not None and expected is not None
    torch.testing.assert_close(with_targets.target_prompt_logprobs, expected, atol=1e-5, rtol=0)


def test_bad_budgets_are_refused_with_the_value():
    with pytest.raises(ValueError, match="prefix_cache_bytes.*-1"):
        PrefixCache(-1)
