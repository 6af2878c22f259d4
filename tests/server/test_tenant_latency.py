"""One tenant's long sample does not freeze the other tenants.

A samples many rows x many tokens on the base; meanwhile B runs an 8-token sample, a
save_weights_for_sampler (publish + canary) and a forward_backward. B's latency is bounded by
the configuration, not by A's work: its sample takes a reserved row at the next engine step
(then one step per token), and its training and publish ops wait at most one sampling slice
(`sample_slice_s`) plus one engine step, the canary running beside the batch. The assertion is
generous (one slice plus a quarter of A's total time); the figures are printed with `-s`."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from tinker import types

from tests.server.conftest import sl_datum

DATA = [sl_datum([8, 16, 24, 32, 40, 48, 56, 64, 72, 80])]
PROMPT = types.ModelInput.from_ints([10, 20, 30, 40])
A_ROWS, A_TOKENS = 64, 200
B_SAMPLE = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])


def _b_ops(saver, trainer, sampler, name: str) -> dict[str, float]:
    """B's three ops issued at once (each on its own client, so none is ordered behind another)
    and timed from the same start until each result is back."""
    calls = {
        "sample_8_tokens": lambda: sampler.sample(PROMPT, 1, B_SAMPLE).result(),
        "save_weights_for_sampler": lambda: saver.save_weights_for_sampler(name).result(),
        "forward_backward": lambda: trainer.forward_backward(DATA, "cross_entropy").result(),
    }
    start = time.monotonic()

    def timed(call) -> float:
        call()
        return time.monotonic() - start

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {op: pool.submit(timed, call) for op, call in calls.items()}
        return {op: future.result() for op, future in futures.items()}


def test_a_long_sample_does_not_freeze_another_tenant(client_a, client_b, base_model, server):
    tc = client_b.create_lora_training_client(base_model=base_model, rank=4, seed=41).result()
    trainer = client_b.create_lora_training_client(base_model=base_model, rank=4, seed=42).result()
    b_sampler = client_b.create_sampling_client(base_model=base_model).result()
    a_sampler = client_a.create_sampling_client(base_model=base_model).result()
    _b_ops(tc, trainer, b_sampler, "warm")
    quiet = _b_ops(tc, trainer, b_sampler, "quiet")

    long = types.SamplingParams(max_tokens=A_TOKENS, temperature=1.0, seed=5, stop=[])
    a_start = time.monotonic()
    a_future = a_sampler.sample(PROMPT, A_ROWS, long)
    time.sleep(0.3)  # A's rows fill the batch
    loaded = _b_ops(tc, trainer, b_sampler, "loaded")
    b_end = time.monotonic()
    result = a_future.result()
    a_total = time.monotonic() - a_start
    assert len(result.sequences) == A_ROWS
    assert all(len(s.tokens) == A_TOKENS for s in result.sequences)

    print(f"\nA: {A_ROWS} rows x {A_TOKENS} tokens took {a_total:.2f} s")
    for op in quiet:
        print(f"B {op}: quiet {quiet[op]:.3f} s, beside A {loaded[op]:.3f} s")
    assert b_end < a_start + a_total  # B was done while A was still sampling
    slice_s = server.service.scheduler.sample_slice_s
    for op, seconds in loaded.items():
        # The bound is one slice plus a step; the quarter of A's time is generous slack for a
        # busy machine. FIFO admission and the canary queued behind A's rows made each of these
        # wait for nearly all of A (about 0.9 of it).
        assert seconds < slice_s + a_total / 4, (op, seconds, a_total)
