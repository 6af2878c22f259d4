"""One request's bad row never fails its neighbours (issue 34, item 1): a temperature that
underflows float32, a fault injected into one row's token choice, a progress hook that raises,
non-finite logits from one adapter. The other requests of the same shared step succeed and
equal their solo runs; the failed one says why and reports the work it had done (item 2).
A request whose `cancel` event is set leaves at the next step with its work counted (item 10)."""

from __future__ import annotations

import threading

import pytest
import torch

from lorafleet.sample import SampleEngine, SampleRequest, SamplingParams
from lorafleet.sample import engine as engine_module
from lorafleet.sample.validate import MIN_TEMPERATURE
from tests.sample.test_engine import make_stack, prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

POISON_TEMPERATURE = 0.777  # the fault below fires for rows sampled at this temperature


@pytest.fixture(scope="module")
def stack2():
    return make_stack(2)


def _others(keys: list) -> list[SampleRequest]:
    return [
        SampleRequest(
            prompt(10 + i, 6 + i),
            SamplingParams(max_tokens=8, temperature=0.9, seed=40 + i, stop=[]),
            adapter=keys[i % 2],
            num_samples=2,
            share_key=f"tenant-{i}",
        )
        for i in range(3)
    ]


def _solo(engine: SampleEngine, requests: list[SampleRequest]) -> list:
    return [engine.generate([r])[0] for r in requests]


def _same(a, b) -> None:
    assert a.ok and b.ok, (a.error, b.error)
    for x, y in zip(a.sequences, b.sequences, strict=True):
        assert x.tokens == y.tokens
        torch.testing.assert_close(
            torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=1e-5, atol=1e-5
        )


def test_underflowing_temperature_is_clamped_and_fails_nobody(stack2):
    stack, keys = stack2
    engine = stack.sampler
    others = _others(keys)
    solo = _solo(engine, others)
    tiny = [
        SampleRequest(
            prompt(3, 7),
            SamplingParams(max_tokens=8, temperature=t, seed=5, stop=[]),
            adapter=keys[0],
            share_key="attacker",
        )
        for t in (1e-300, 1e-45, 5e-324)
    ]
    results = engine.generate([*others, *tiny])
    for got, want in zip(results[:3], solo, strict=True):
        _same(got, want)
    clamped = engine.generate(
        [
            SampleRequest(
                prompt(3, 7),
                SamplingParams(max_tokens=8, temperature=MIN_TEMPERATURE, seed=5, stop=[]),
                adapter=keys[0],
            )
        ]
    )[0]
    for got in results[3:]:
        _same(got, clamped)


def test_fault_in_one_row_fails_only_its_request(stack2, monkeypatch):
    stack, keys = stack2
    engine = stack.sampler
    others = _others(keys)
    solo = _solo(engine, others)
    real = engine_module.choose_tokens_drawn

    def faulty(logits, temperature, top_k, top_p, draws):
        if POISON_TEMPERATURE in list(temperature):
            raise RuntimeError("index -1 is out of bounds for dimension 1 with size 512")
        return real(logits, temperature, top_k, top_p, draws)

    monkeypatch.setattr(engine_module, "choose_tokens_drawn", faulty)
    poison = SampleRequest(
        prompt(7, 9),
        SamplingParams(max_tokens=8, temperature=POISON_TEMPERATURE, seed=1, stop=[]),
        adapter=keys[1],
        num_samples=3,
        share_key="attacker",
    )
    results = engine.generate([others[0], poison, *others[1:]])
    bad = results[1]
    assert bad.error is not None and bad.error.code == "internal_error"
    assert "other requests" in bad.error.message
    assert bad.prefill_tokens == 9 and bad.sampled_tokens == 0
    for got, want in zip([results[0], *results[2:]], solo, strict=True):
        _same(got, want)
        assert got.sampled_tokens == 16  # 2 samples x 8 tokens (no stop)


def test_hook_that_raises_fails_only_its_request_and_counts_its_tokens(stack2):
    stack, keys = stack2
    engine = stack.sampler
    others = _others(keys)
    solo = _solo(engine, others)
    seen: list[int] = []

    def hook(sample: int, token: int) -> None:
        seen.append(token)
        if len(seen) == 4:
            raise ValueError("the client's queue is closed")

    victim = SampleRequest(
        prompt(8, 5),
        SamplingParams(max_tokens=20, temperature=0.8, seed=2, stop=[]),
        adapter=keys[0],
        share_key="hooked",
        on_token=hook,
    )
    results = engine.generate([*others, victim])
    assert results[3].error is not None and results[3].error.code == "internal_error"
    assert results[3].sampled_tokens == 4 and results[3].prefill_tokens == 5
    for got, want in zip(results[:3], solo, strict=True):
        _same(got, want)
        assert got.sampled_tokens == 16


def test_non_finite_logits_of_one_adapter_fail_only_it(stack2, monkeypatch):
    stack, keys = stack2
    engine = stack.sampler
    others = [r for r in _others(keys) if r.adapter == keys[0]]
    solo = _solo(engine, others)
    real = engine._forward
    poisoned_slot = stack.versions.acquire(keys[1])
    stack.versions.release(keys[1])

    def forward(rows, input_ids, starts, row_slots, pick_rows, pick_pos, *args, **kwargs):
        logits = real(rows, input_ids, starts, row_slots, pick_rows, pick_pos, *args, **kwargs)
        hit = row_slots[pick_rows] == poisoned_slot
        return logits.masked_fill(hit.unsqueeze(1), float("nan"))

    monkeypatch.setattr(engine, "_forward", forward)
    diverged = SampleRequest(
        prompt(9, 6),
        SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[]),
        adapter=keys[1],
        share_key="diverged",
    )
    results = engine.generate([diverged, *others])
    assert results[0].error is not None and results[0].error.code == "non_finite_logits"
    for got, want in zip(results[1:], solo, strict=True):
        _same(got, want)


def test_cancelled_request_leaves_at_the_next_step_with_its_work(stack2):
    stack, keys = stack2
    engine = stack.sampler
    cancel = threading.Event()
    drawn: list[int] = []

    def hook(sample: int, token: int) -> None:
        drawn.append(token)
        if len(drawn) == 3:
            cancel.set()  # the client hangs up after its third token

    long = SampleRequest(
        prompt(4, 6),
        SamplingParams(max_tokens=200, temperature=1.0, seed=9, stop=[]),
        adapter=keys[0],
        num_samples=2,
        on_token=hook,
        cancel=cancel,
    )
    other = _others(keys)[1]
    solo = engine.generate([other])[0]
    futures = engine.submit([long, other])
    steps = 0
    while not futures[0].done():
        engine.step()
        steps += 1
    cancelled = futures[0].result()
    assert cancelled.error is not None and cancelled.error.code == "cancelled"
    # step 1 prefills (a token per row) and decodes (another): the 3rd token sets the event,
    # and step 2 drops both rows before it computes anything for them
    assert steps == 2 and cancelled.sampled_tokens == 4 and cancelled.prefill_tokens == 6
    assert all(s.group.cancel is None for s in engine._active)
    while not futures[1].done():
        engine.step()
    _same(futures[1].result(), solo)
    assert not engine.has_work()
