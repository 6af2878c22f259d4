"""A device out-of-memory in training fails that call alone, applies nothing and leaves the
engine serving (model/memory.py). CPUs do not run out of memory the way GPUs do, so the
error is injected where the device would raise it: inside a micro-batch's forward/backward."""

from __future__ import annotations

import pytest
import torch

from lorafleet.engines import colocate
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.memory import DeviceOutOfMemory, is_out_of_memory
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.train.engine import TrainEngine, TrainItem
from lorafleet.train.optim import AdamHParams
from tests._models import tiny_qwen3


def _item(slot: int, seed: int, length: int) -> TrainItem:
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, 96, (length + 1,), generator=gen)
    return TrainItem(
        slot, seq[:-1], "cross_entropy", {"target_tokens": seq[1:], "weights": torch.ones(length)}
    )


def test_oom_is_recognised():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert is_out_of_memory(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))  # not the device's


def test_an_oom_in_a_later_micro_batch_applies_nothing_and_the_engine_goes_on(monkeypatch):
    model = tiny_qwen3(layers=1)
    stack = colocate(
        model, resolve_tinker_targets(model), base_model_id="tiny", r_max=8, token_budget=12
    )
    trainer = stack.trainer
    a = trainer.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=1))
    b = trainer.create_adapter(AdapterSpec(rank=8, alpha=8.0, seed=2))
    trainer.forward_backward([_item(a, 1, 9)])  # a pending gradient the failed call must keep
    grads = trainer.bank.grads
    assert grads is not None
    before = grads.clone()
    items = [_item(a, 2, 10), _item(b, 3, 11), _item(a, 4, 9)]  # 3 micro-batches of <= 12 tokens

    real = TrainEngine._run_microbatch
    calls: list[int] = []

    def second_one_runs_out(self, *args, **kwargs):
        calls.append(1)
        out = real(self, *args, **kwargs)  # the first adds its gradient before the second fails
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return out

    monkeypatch.setattr(TrainEngine, "_run_microbatch", second_one_runs_out)
    with pytest.raises(DeviceOutOfMemory) as err:
        trainer.forward_backward(items)
    message = str(err.value)
    assert "out of memory on cpu while running forward_backward over 3 datums (30 tokens" in message
    assert "nothing was applied" in message and "Tried to allocate 20.00 GiB" in message
    assert isinstance(err.value, ValueError)  # the request's failure, as the server reports it
    assert len(calls) == 2
    assert torch.equal(grads, before)  # the first micro-batch's gradient was taken back
    monkeypatch.undo()

    # the engine serves on: the same call runs, and equals it on a fresh engine
    out = trainer.forward_backward(items)
    trainer.optim_step({a: AdamHParams(learning_rate=1e-2), b: AdamHParams(learning_rate=1e-2)})
    model2 = tiny_qwen3(layers=1)
    fresh = colocate(
        model2, resolve_tinker_targets(model2), base_model_id="tiny", r_max=8, token_budget=12
    ).trainer
    fresh.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=1))
    fresh.create_adapter(AdapterSpec(rank=8, alpha=8.0, seed=2))
    fresh.forward_backward([_item(a, 1, 9)])
    ref = fresh.forward_backward(items)
    fresh.optim_step({a: AdamHParams(learning_rate=1e-2), b: AdamHParams(learning_rate=1e-2)})
    for got, want in zip(out.items, ref.items, strict=True):
        torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=0)
    torch.testing.assert_close(trainer.bank.params, fresh.bank.params, rtol=0, atol=0)


def test_other_errors_are_not_turned_into_out_of_memory(monkeypatch):
    model = tiny_qwen3(layers=1)
    trainer = colocate(model, resolve_tinker_targets(model), base_model_id="tiny", r_max=8).trainer
    slot = trainer.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=1))

    def broken(self, *args, **kwargs):
        raise RuntimeError("an engine bug")

    monkeypatch.setattr(TrainEngine, "_run_microbatch", broken)
    with pytest.raises(RuntimeError, match="an engine bug"):
        trainer.forward_backward([_item(slot, 1, 5)])
