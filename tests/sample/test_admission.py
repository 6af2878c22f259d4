"""Fair admission: waiting rows take turns by share key, a newcomer gets a reserved row at the
next step, and the canary probe runs beside a full batch instead of queueing behind it."""

from __future__ import annotations

import pytest
import torch

from lorafleet.engines import Colocated, colocate
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample import SampleEngine, SampleRequest, SamplingParams
from lorafleet.sample.admission import FairQueue
from tests._models import tiny_qwen3

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LONG = SamplingParams(max_tokens=60, temperature=1.0, seed=1, stop=[])
SHORT = SamplingParams(max_tokens=4, temperature=0.0, stop=[])
PROMPT = [5, 17, 33, 2, 71, 9]


@pytest.fixture(scope="module")
def stack() -> tuple[Colocated, tuple[str, int]]:
    model = tiny_qwen3()
    stack = colocate(
        model, resolve_tinker_targets(model), base_model_id="tiny", r_max=8, sample_slots=2
    )
    slot = stack.trainer.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=0))
    gen = torch.Generator().manual_seed(3)
    stack.trainer.bank.load_slot_weights(
        slot,
        {
            p: (A, 0.3 * torch.randn(B.shape, generator=gen))
            for p, (A, B) in stack.trainer.bank.slot_weights(slot).items()
        },
    )
    key = stack.versions.publish("ad", stack.trainer.bank, slot)
    return stack, key


def test_fair_queue_gives_the_next_row_to_the_key_holding_fewest():
    queue: FairQueue[str, int] = FairQueue()
    for i in range(5):
        queue.push("a", i)
    queue.push("b", 100)
    queue.push("b", 101)
    # "a" holds 3 rows, "b" none: b first, then b again (still fewer), then a.
    held = {"a": 3}
    order = []
    while (picked := queue.pop(held, free=10, reserved=0)) is not None:
        key, item = picked
        held[key] = held.get(key, 0) + 1
        order.append(item)
    assert order == [100, 101, 0, 1, 2, 3, 4]


def test_fair_queue_keeps_reserved_rows_for_keys_holding_none():
    queue: FairQueue[str, int] = FairQueue()
    queue.push("a", 0)
    assert queue.pop({"a": 5}, free=1, reserved=1) is None  # the last row is reserved
    queue.push("b", 7)
    assert queue.pop({"a": 5}, free=1, reserved=1) == ("b", 7)
    assert queue.pop({"a": 5}, free=2, reserved=1) == ("a", 0)
    assert not queue


def test_fair_queue_put_back_keeps_order_within_a_key():
    queue: FairQueue[str, int] = FairQueue()
    for i in range(3):
        queue.push("a", i)
    key, item = queue.pop({}, free=4, reserved=0) or ("", -1)
    queue.push_front(key, item)
    assert list(queue) == [0, 1, 2]


def test_fair_queue_shares_rows_by_weight():
    """Rows held / weight picks the key: weight 2 takes two rows for each of weight 1's."""
    queue: FairQueue[str, int] = FairQueue()
    for i in range(6):
        queue.push("heavy", i, 2.0)
        queue.push("light", 100 + i, 1.0)
    held: dict[str, int] = {}
    order = []
    for _ in range(6):
        picked = queue.pop(held, free=10, reserved=0)
        assert picked is not None
        held[picked[0]] = held.get(picked[0], 0) + 1
        order.append(picked[0])
    assert order == ["heavy", "light", "heavy", "light", "heavy", "heavy"]  # ties: turn order
    assert held == {"heavy": 4, "light": 2}


def test_the_engine_admits_rows_by_share_weight(stack):
    colocated, key = stack
    engine = SampleEngine(colocated.adapted, colocated.versions, max_rows=4, reserved_rows=0)
    params = SamplingParams(max_tokens=2, temperature=1.0, seed=4, stop=[])

    def first_step_rows(weight_a: float) -> list[int]:
        engine.generate(
            [
                SampleRequest(PROMPT, params, key, 8, share_key="a", share_weight=weight_a),
                SampleRequest(PROMPT, params, None, 8, share_key="b"),
            ]
        )
        first = min(t.admitted_step for t in engine.last_traces)
        return [
            sum(t.request == r and t.admitted_step == first for t in engine.last_traces)
            for r in (0, 1)
        ]

    assert first_step_rows(1.0) == [2, 2]
    assert first_step_rows(3.0) == [3, 1]
    bad = engine.generate([SampleRequest(PROMPT, params, None, 1, share_weight=0.0)])
    assert bad[0].error is not None and "share_weight must be > 0, got 0.0" in bad[0].error.message


def test_a_newcomers_short_request_does_not_wait_for_a_full_batch(stack):
    """FIFO admission made B's one short row wait until every one of A's rows had run."""
    colocated, key = stack
    engine = SampleEngine(colocated.adapted, colocated.versions, max_rows=8, reserved_rows=1)
    a = engine.submit(
        [SampleRequest(PROMPT, LONG, adapter=key, num_samples=24, share_key="tenant-a")]
    )
    for _ in range(3):
        engine.step()  # A's rows fill the batch and decode
    b = engine.submit([SampleRequest(PROMPT, SHORT, adapter=None, share_key="tenant-b")])
    steps = 0
    while not b[0].done():
        engine.step()
        steps += 1
    # B joins at the next step (a reserved row) and runs its 4 tokens: 1 prefill + 3 decodes.
    assert steps <= SHORT.max_tokens + 1, steps
    assert not a[0].done()
    while not a[0].done():
        engine.step()
    assert a[0].result().ok and len(a[0].result().sequences) == 24
    assert b[0].result().ok and len(b[0].result().sequences[0].tokens) == SHORT.max_tokens


def test_rows_alternate_between_keys_as_rows_free_up(stack):
    """With no reserve, B's second row takes the first row that frees, not A's next waiting one."""
    colocated, key = stack
    engine = SampleEngine(colocated.adapted, colocated.versions, max_rows=4, reserved_rows=0)
    short = SamplingParams(max_tokens=3, temperature=1.0, seed=2, stop=[])
    a = engine.submit(
        [SampleRequest(PROMPT, short, adapter=key, num_samples=12, share_key="tenant-a")]
    )
    engine.step()
    b = engine.submit([SampleRequest(PROMPT, short, num_samples=2, share_key="tenant-b")])
    while not b[0].done():
        engine.step()
    assert not a[0].done(), "B must not wait for all of A's 12 rows"
    while not a[0].done():
        engine.step()
    assert a[0].result().ok and b[0].result().ok


def test_probe_equals_the_prompt_logprobs_of_a_sample_and_runs_beside_a_full_batch(stack):
    colocated, key = stack
    engine = SampleEngine(colocated.adapted, colocated.versions, max_rows=4, reserved_rows=0)
    tokens = [3, 41, 7, 88, 12, 5, 60]
    quiet = {}
    for version in (key, None):
        (result,) = engine.generate(
            [
                SampleRequest(
                    tokens,
                    SamplingParams(max_tokens=1, temperature=0.0, stop=[]),
                    adapter=version,
                    prompt_logprobs=True,
                )
            ]
        )
        assert result.prompt_logprobs is not None
        quiet[version] = torch.tensor(result.prompt_logprobs[1:], dtype=torch.float32)
    running = engine.submit([SampleRequest(PROMPT, LONG, adapter=key, num_samples=8)])
    engine.step()  # every row is taken by a long sequence
    for version in (key, None):
        probe = engine.probe_logprobs(version, tokens)
        torch.testing.assert_close(probe, quiet[version], atol=1e-5, rtol=0)
    assert not running[0].done()  # the probe did not run the batch to get its answer
    assert not torch.allclose(quiet[key], quiet[None])
    with pytest.raises(ValueError, match="tokens"):
        engine.probe_logprobs(None, [1])
    while not running[0].done():
        engine.step()
    assert colocated.versions.info(key).pins == 0
