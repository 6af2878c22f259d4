"""SampleEngine: mixed-adapter batches equal solo runs, seeds reproduce, log-probs equal the
trainer's, continuous batching refills rows, bad requests fail alone."""

from __future__ import annotations

import pytest
import torch

from lorafleet.engines import Colocated, colocate
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample import SampleEngine, SampleRequest, SamplingParams
from lorafleet.train.engine import TrainItem
from tests._models import tiny_llama, tiny_qwen3

VOCAB = 96
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, stop=[])


def randomize(stack: Colocated, slot: int, seed: int, scale: float = 0.3) -> None:
    """Non-zero B so that every adapter visibly changes the model."""
    gen = torch.Generator().manual_seed(seed)
    weights = {
        path: (A, torch.randn(B.shape, generator=gen) * scale)
        for path, (A, B) in stack.trainer.bank.slot_weights(slot).items()
    }
    stack.trainer.bank.load_slot_weights(slot, weights)


def make_stack(
    num_adapters: int = 4, *, max_rows: int = 32, sample_slots: int = 6
) -> tuple[Colocated, list]:
    model = tiny_qwen3()
    stack = colocate(
        model,
        resolve_tinker_targets(model),
        base_model_id="tiny",
        r_max=8,
        sample_slots=sample_slots,
        max_rows=max_rows,
    )
    keys = []
    for i in range(num_adapters):
        slot = stack.trainer.create_adapter(AdapterSpec(rank=2 + 2 * (i % 3), alpha=8.0, seed=i))
        randomize(stack, slot, seed=100 + i)
        keys.append(stack.versions.publish(f"adapter-{i}", stack.trainer.bank, slot))
    return stack, keys


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def stack4():
    return make_stack(4)


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(
        0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def test_mixed_batch_of_four_adapters_and_base_equals_each_alone(stack4):
    stack, keys = stack4
    adapters = [*keys, None]
    requests = [
        SampleRequest(prompt(i, 3 + 2 * i), GREEDY, adapter=a) for i, a in enumerate(adapters)
    ]
    mixed = stack.sampler.generate(requests)
    outputs = []
    for request, result in zip(requests, mixed, strict=True):
        (alone,) = stack.sampler.generate([request])
        assert result.ok and alone.ok
        assert result.adapter == request.adapter
        seq, ref = result.sequences[0], alone.sequences[0]
        assert seq.tokens == ref.tokens
        assert seq.adapter == request.adapter
        assert len(seq.tokens) == 10 and seq.stop_reason == "length"
        torch.testing.assert_close(
            torch.tensor(seq.logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0
        )
        outputs.append(seq.tokens)
    # Routing matters: the same prompt under each adapter and the base gives different text.
    same_prompt = stack.sampler.generate(
        [SampleRequest(prompt(0, 6), GREEDY, adapter=a) for a in adapters]
    )
    assert len({tuple(r.sequences[0].tokens) for r in same_prompt}) == len(adapters)


def test_same_seed_same_tokens_alone_or_batched(stack4):
    stack, keys = stack4
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, stop=[])
    target = SampleRequest(prompt(7, 5), params, adapter=keys[1], num_samples=3)
    (alone,) = stack.sampler.generate([target])
    others = [
        SampleRequest(
            prompt(8 + i, 4 + i), SamplingParams(max_tokens=6, temperature=0.9, seed=i), adapter=k
        )
        for i, k in enumerate([keys[0], None, keys[2]])
    ]
    batched = stack.sampler.generate([others[0], others[1], target, others[2]])[2]
    assert [s.tokens for s in batched.sequences] == [s.tokens for s in alone.sequences]
    samples = {tuple(s.tokens) for s in alone.sequences}
    assert len(samples) == 3, "each sample index draws its own stream"
    (other_seed,) = stack.sampler.generate(
        [
            SampleRequest(
                target.prompt,
                SamplingParams(max_tokens=12, temperature=1.0, seed=99, stop=[]),
                adapter=keys[1],
            )
        ]
    )
    assert tuple(other_seed.sequences[0].tokens) not in samples


def test_sampled_logprobs_equal_the_training_engines(stack4):
    stack, keys = stack4
    slot = 2  # adapter-1 lives in trainer slot 2 (slots are handed out from 1)
    assert stack.versions.info(keys[1]).adapter_id == "adapter-1"
    text = prompt(11, 6)
    params = SamplingParams(max_tokens=8, temperature=0.7, top_k=20, top_p=0.9, seed=5, stop=[])
    (result,) = stack.sampler.generate(
        [SampleRequest(text, params, adapter=keys[1], num_samples=2, prompt_logprobs=True)]
    )
    for seq in result.sequences:
        full = torch.tensor(text + seq.tokens)
        item = TrainItem(
            slot,
            full[:-1],
            "cross_entropy",
            {"target_tokens": full[1:], "weights": torch.ones(len(full) - 1)},
        )
        trained = stack.trainer.forward([item]).items[0].logprobs
        # Raw (temperature 1, unfiltered) model log-probs, exactly what training computes.
        torch.testing.assert_close(
            torch.tensor(seq.logprobs), trained[len(text) - 1 :], atol=1e-4, rtol=0
        )
        torch.testing.assert_close(
            torch.tensor(result.prompt_logprobs[1:]), trained[: len(text) - 1], atol=1e-4, rtol=0
        )
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(text)


def test_top_k_logprobs_for_samples_and_prompt(stack4):
    stack, keys = stack4
    text = prompt(3, 5)
    request = SampleRequest(
        text,
        SamplingParams(max_tokens=4, temperature=0.0, stop=[]),
        adapter=keys[0],
        prompt_logprobs=True,
        topk_prompt_logprobs=3,
        topk_sample_logprobs=2,
    )
    (result,) = stack.sampler.generate([request])
    seq = result.sequences[0]
    assert len(seq.topk_logprobs) == 4 and all(len(k) == 2 for k in seq.topk_logprobs)
    for token, lp, top in zip(seq.tokens, seq.logprobs, seq.topk_logprobs, strict=True):
        assert top[0][0] == token and top[0][1] == pytest.approx(lp)  # greedy = the best token
        assert top[0][1] >= top[1][1]
    assert result.topk_prompt_logprobs[0] is None and len(result.topk_prompt_logprobs) == len(text)
    for pos in range(1, len(text)):
        top = result.topk_prompt_logprobs[pos]
        assert len(top) == 3 and top[0][1] >= result.prompt_logprobs[pos] - 1e-6


def test_max_tokens_eos_and_stop_lists():
    stack, keys = make_stack(1)
    text = prompt(21, 4)
    (free,) = stack.sampler.generate([SampleRequest(text, GREEDY, adapter=keys[0])])
    tokens = free.sequences[0].tokens
    cut = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    eos = tokens[cut]
    (short,) = stack.sampler.generate(
        [SampleRequest(text, SamplingParams(max_tokens=3, temperature=0.0), adapter=keys[0])]
    )
    assert short.sequences[0].tokens == tokens[:3] and short.sequences[0].stop_reason == "length"
    (by_id,) = stack.sampler.generate(
        [
            SampleRequest(
                text, SamplingParams(max_tokens=10, temperature=0.0, stop=[eos]), adapter=keys[0]
            )
        ]
    )
    assert (
        by_id.sequences[0].tokens == tokens[: cut + 1] and by_id.sequences[0].stop_reason == "stop"
    )

    stack.adapted.model.config.eos_token_id = eos
    with_eos = SampleEngine(stack.adapted, stack.versions)
    none_params = SamplingParams(max_tokens=10, temperature=0.0, stop=None)
    never_params = SamplingParams(max_tokens=10, temperature=0.0, stop=[])
    at_eos, never = with_eos.generate(
        [
            SampleRequest(text, none_params, adapter=keys[0]),
            SampleRequest(text, never_params, adapter=keys[0]),
        ]
    )
    assert at_eos.sequences[0].tokens == tokens[: cut + 1]  # EOS is kept, as vLLM does
    assert at_eos.sequences[0].stop_reason == "stop"
    assert never.sequences[0].tokens == tokens and never.sequences[0].stop_reason == "length"


def test_continuous_batching_refills_rows_and_matches_the_unconstrained_run():
    stack, keys = make_stack(3)
    lengths = [3, 14, 5, 7, 2, 9, 4]
    requests = [
        SampleRequest(
            prompt(40 + i, 2 + i),
            SamplingParams(max_tokens=n, temperature=0.0 if i % 2 else 0.8, seed=i, stop=[]),
            adapter=[*keys, None][i % 4],
            num_samples=3 if i == 3 else 1,
        )
        for i, n in enumerate(lengths)
    ]
    wide = stack.sampler.generate(requests)
    narrow_engine = SampleEngine(stack.adapted, stack.versions, max_rows=2)
    narrow = narrow_engine.generate(requests)
    one_prompt_per_prefill = SampleEngine(
        stack.adapted, stack.versions, max_rows=4, prefill_tokens=1
    ).generate(requests)
    for a, b, c in zip(wide, narrow, one_prompt_per_prefill, strict=True):
        assert (
            [s.tokens for s in a.sequences]
            == [s.tokens for s in b.sequences]
            == [s.tokens for s in c.sequences]
        )
        for sa, sb in zip(a.sequences, b.sequences, strict=True):
            torch.testing.assert_close(
                torch.tensor(sa.logprobs), torch.tensor(sb.logprobs), atol=1e-5, rtol=0
            )
    traces = narrow_engine.last_traces
    assert len(traces) == len(lengths) + 2
    steps = max(t.finished_step for t in traces)
    assert (
        max(
            sum(t.admitted_step <= s <= t.finished_step for t in traces)
            for s in range(1, steps + 1)
        )
        <= 2
    )
    longest = next(t for t in traces if t.request == 1)
    joined = [
        t
        for t in traces
        if t.admitted_step > longest.admitted_step and t.admitted_step < longest.finished_step
    ]
    assert joined, "a waiting sequence must join while the longest one is still running"


def test_bad_requests_fail_alone_and_leave_the_others_identical(stack4):
    stack, keys = stack4
    good = [
        SampleRequest(
            prompt(60, 5),
            SamplingParams(max_tokens=6, temperature=0.8, seed=3, stop=[]),
            adapter=keys[0],
        ),
        SampleRequest(prompt(61, 4), GREEDY, adapter=None),
    ]
    params = SamplingParams(max_tokens=4)
    bad = [
        SampleRequest([], params),
        SampleRequest([1] * 256, params),  # context is 256: no room to sample
        SampleRequest(prompt(62, 250), SamplingParams(max_tokens=10)),
        SampleRequest([1, 2], params, adapter=("nobody", 0)),
        SampleRequest([1, 2], params, adapter=(keys[0][0], 99)),
        SampleRequest([1, 2], SamplingParams(temperature=-0.5)),
        SampleRequest([1, 2], SamplingParams(top_p=0.0)),
        SampleRequest([1, 2], SamplingParams(top_p=1.5)),
        SampleRequest([1, VOCAB], params),
        SampleRequest([1, 2], SamplingParams(max_tokens=0)),
        SampleRequest([1, 2], params, num_samples=0),
        SampleRequest([1, 2], SamplingParams(stop=["x"])),  # stop strings need a tokenizer
    ]
    alone = stack.sampler.generate(good)
    mixed = stack.sampler.generate([bad[0], good[0], *bad[1:6], good[1], *bad[6:]])
    got_good = [mixed[1], mixed[7]]
    got_bad = [mixed[0], *mixed[2:7], *mixed[8:]]
    for a, b in zip(alone, got_good, strict=True):
        assert b.ok and [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    codes = [r.error.code if r.error else None for r in got_bad]
    assert codes == ["invalid_request"] * 3 + ["unknown_version"] * 2 + ["invalid_request"] * 7
    messages = [r.error.message for r in got_bad]
    assert "empty" in messages[0]
    assert "context" in messages[1] and "context" in messages[2]
    assert "nobody" in messages[3]
    assert "temperature" in messages[5] and "top_p" in messages[6] and "top_p" in messages[7]
    assert (
        "vocabulary" in messages[8]
        and "max_tokens" in messages[9]
        and "num_samples" in messages[10]
    )
    assert "tokenizer" in messages[11]
    assert all(r.sequences == [] for r in got_bad)


@pytest.mark.parametrize("arch", ["llama-tied-odd-sizes", "qwen3-eager"])
def test_other_architectures_and_eager_attention_match_solo_runs(arch):
    model = tiny_llama() if arch.startswith("llama") else tiny_qwen3()
    if arch.endswith("eager"):
        model.set_attn_implementation("eager")
    stack = colocate(
        model, resolve_tinker_targets(model), base_model_id="tiny", r_max=8, sample_slots=3
    )
    keys = []
    for i in range(2):
        slot = stack.trainer.create_adapter(AdapterSpec(rank=3, alpha=6.0, seed=i))
        randomize(stack, slot, seed=i)
        keys.append(stack.versions.publish(f"a{i}", stack.trainer.bank, slot))
    requests = [
        SampleRequest(prompt(70 + i, 3 + i), GREEDY, adapter=a, prompt_logprobs=True)
        for i, a in enumerate([*keys, None])
    ]
    mixed = stack.sampler.generate(requests)
    for request, result in zip(requests, mixed, strict=True):
        (alone,) = stack.sampler.generate([request])
        assert result.sequences[0].tokens == alone.sequences[0].tokens
    # And the sampled log-probs are the trainer's (prompt + sampled tokens, adapter 0).
    seq = mixed[0].sequences[0]
    full = torch.tensor(requests[0].prompt + seq.tokens)
    item = TrainItem(
        1,
        full[:-1],
        "cross_entropy",
        {"target_tokens": full[1:], "weights": torch.ones(len(full) - 1)},
    )
    trained = stack.trainer.forward([item]).items[0].logprobs
    expected = torch.cat([torch.tensor(mixed[0].prompt_logprobs[1:]), torch.tensor(seq.logprobs)])
    torch.testing.assert_close(expected, trained, atol=1e-4, rtol=0)


def test_requests_submitted_mid_run_join_the_running_batch(stack4):
    """Continuous batching across callers: a request submitted while others decode joins their
    batch at the next step (it does not wait for them), and its outputs equal a solo run."""
    stack, keys = stack4
    engine = SampleEngine(stack.adapted, stack.versions, max_rows=8)
    long_params = SamplingParams(max_tokens=12, temperature=0.0, stop=[])
    early = engine.submit(
        [SampleRequest(prompt(80, 6), long_params, adapter=keys[0], num_samples=2)]
    )
    for _ in range(3):
        assert engine.step()
    assert not early[0].done()
    late_request = SampleRequest(
        prompt(81, 4),
        SamplingParams(max_tokens=4, temperature=0.7, seed=5, stop=[]),
        adapter=keys[1],
    )
    late = engine.submit([late_request])
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    assert not engine.step()  # idle
    assert early[0].done() and late[0].done()
    # The early rows need 11 steps for 12 tokens (their first step prefills and decodes): 3
    # before the late request arrived, 8 after; the late one ran inside those 8.
    assert steps == 8
    alone_late = stack.sampler.generate([late_request])[0]
    alone_early = stack.sampler.generate(
        [SampleRequest(prompt(80, 6), long_params, adapter=keys[0], num_samples=2)]
    )[0]
    assert [s.tokens for s in late[0].result().sequences] == [
        s.tokens for s in alone_late.sequences
    ]
    assert [s.tokens for s in early[0].result().sequences] == [
        s.tokens for s in alone_early.sequences
    ]
    assert late[0].result().sequences[0].adapter == keys[1]


def test_generate_from_two_threads_shares_the_engine(stack4):
    import threading

    stack, keys = stack4
    requests = [SampleRequest(prompt(90 + i, 5), GREEDY, adapter=keys[i % 4]) for i in range(6)]
    expected = [r.sequences[0].tokens for r in stack.sampler.generate(requests)]
    got: dict[int, list[int]] = {}

    def run(i: int) -> None:
        got[i] = stack.sampler.generate([requests[i]])[0].sequences[0].tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got[i] for i in range(6)] == expected
