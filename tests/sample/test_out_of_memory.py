"""A device out-of-memory in sampling fails the requests it belongs to, with a clear error,
and the sampler goes on: a prefill that does not fit fails only the new requests; a decode
step that does not fit fails the requests whose rows needed the KV cache to grow, and the
others decode on. Injected where the device would raise it (CPUs do not run out this way)."""

from __future__ import annotations

import torch

from lorafleet.engines import Colocated, colocate
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample import SampleRequest, SamplingParams
from lorafleet.sample.engine import SampleEngine
from tests._models import tiny_qwen3

OOM = "CUDA out of memory. Tried to allocate 12.00 GiB"


def _stack() -> Colocated:
    model = tiny_qwen3(layers=1)
    stack = colocate(
        model, resolve_tinker_targets(model), base_model_id="tiny", r_max=8, sample_slots=2
    )
    slot = stack.trainer.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=1))
    gen = torch.Generator().manual_seed(3)
    stack.trainer.bank.load_slot_weights(
        slot,
        {
            path: (A, 0.3 * torch.randn(B.shape, generator=gen))
            for path, (A, B) in stack.trainer.bank.slot_weights(slot).items()
        },
    )
    stack.versions.publish("a", stack.trainer.bank, slot)
    return stack


def _request(stack: Colocated, prompt_len: int, max_tokens: int, seed: int) -> SampleRequest:
    prompt = torch.randint(0, 96, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop=[])
    return SampleRequest(prompt.tolist(), params, adapter=stack.versions.latest("a"))


def _run(engine: SampleEngine, futures) -> None:
    while not all(f.done() for f in futures):
        engine.step()


def test_a_prefill_that_runs_out_fails_only_the_new_request(monkeypatch):
    stack = _stack()
    engine = stack.sampler
    running, newcomer = _request(stack, 6, 12, 1), _request(stack, 9, 5, 2)
    (alone,) = engine.generate([running])
    (first,) = engine.submit([running])
    engine.step()
    engine.step()  # running decodes
    real = engine._prefill

    def prefill(admitted, active):
        if any(seq.group.request.prompt_len == 9 for seq in admitted):
            raise torch.OutOfMemoryError(OOM)
        return real(admitted, active)

    monkeypatch.setattr(engine, "_prefill", prefill)
    (second,) = engine.submit([newcomer])
    _run(engine, [first, second])
    failed = second.result()
    assert failed.error is not None and failed.error.code == "out_of_memory"
    assert "out of memory on cpu while prefilling 1 request(s)" in failed.error.message
    assert "Tried to allocate 12.00 GiB" in failed.error.message
    assert first.result().ok
    assert first.result().sequences[0].tokens == alone.sequences[0].tokens
    assert engine.out_of_memory_failures == 1
    monkeypatch.undo()
    (again,) = engine.generate([newcomer])  # the sampler serves on
    assert again.ok and len(again.sequences[0].tokens) == 5
    # the failed request let go of its version: nothing pins it now
    assert stack.versions.retire(stack.versions.latest("a")) is True


def test_a_decode_that_needs_more_kv_than_fits_fails_that_request_and_the_others_go_on(
    monkeypatch,
):
    stack = _stack()
    engine = stack.sampler
    capacity = engine.cache.capacity  # the row cache's first size (64 columns)
    long_one = _request(stack, capacity - 3, 10, 1)  # grows the cache after 3 tokens
    short_one = _request(stack, 5, 12, 2)
    (short_alone,) = engine.generate([short_one])
    engine.cache.release()  # back to the first size
    assert engine.cache.capacity == capacity
    real = engine.cache.reserve

    def reserve(columns: int) -> None:
        if columns > engine.cache.capacity:
            raise torch.OutOfMemoryError(OOM)
        real(columns)

    monkeypatch.setattr(engine.cache, "reserve", reserve)
    futures = engine.submit([long_one, short_one])
    _run(engine, futures)
    failed, served = (f.result() for f in futures)
    assert failed.error is not None and failed.error.code == "out_of_memory"
    assert "while decoding 2 row(s)" in failed.error.message
    assert served.ok and served.sequences[0].tokens == short_alone.sequences[0].tokens
    monkeypatch.undo()
    (later,) = engine.generate([long_one])  # with the memory back, it runs
    assert later.ok and len(later.sequences[0].tokens) == 10


def test_a_decode_that_runs_out_without_growing_fails_the_running_requests_only(monkeypatch):
    stack = _stack()
    engine = stack.sampler
    a, b = _request(stack, 5, 8, 1), _request(stack, 6, 8, 2)
    futures = engine.submit([a, b])
    engine.step()  # both prefilled and decoding
    real = engine._decode_logits
    monkeypatch.setattr(
        engine, "_decode_logits", lambda active: (_ for _ in ()).throw(torch.OutOfMemoryError(OOM))
    )
    engine.step()
    assert all(f.done() for f in futures)
    assert all(f.result().error.code == "out_of_memory" for f in futures)
    assert not engine.has_work()
    monkeypatch.setattr(engine, "_decode_logits", real)
    (c,) = engine.generate([_request(stack, 7, 4, 3)])
    assert c.ok
