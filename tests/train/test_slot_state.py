"""A slot exported and imported (through host memory, or through disk in the checkpoint format)
is the same run bit for bit: weights, optimizer moments and step, hyper-parameters, and a
gradient accumulated but not yet stepped, for both optimizer families."""

from __future__ import annotations

import stat

import pytest
import torch

from lorafleet.adapters.hparams import DimuonHParams
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.train.engine import TrainEngine
from lorafleet.train.optim import AdamHParams
from tests._models import tiny_qwen3
from tests.train.test_engine import make_engine, sft_item

FAMILIES = {
    "adamw": AdamHParams(learning_rate=2e-2, weight_decay=0.1, grad_clip_norm=0.5),
    "dimuon": DimuonHParams(learning_rate=2e-2, beta1=0.9),
}


def _train(engine: TrainEngine, slot: int, family: str, steps: int, seed: int) -> None:
    for step in range(steps):
        engine.forward_backward([sft_item(slot, seed + step), sft_item(slot, seed + 50 + step)])
        engine.optim_step({slot: FAMILIES[family]})


def _snapshot(engine: TrainEngine, slot: int) -> dict[str, torch.Tensor]:
    family = engine.optimizer_family(slot)
    optimizer = engine.optimizer if family == "adamw" else engine.dimuon
    assert optimizer is not None and engine.bank.grads is not None
    out = {f"opt.{k}": v.clone() for k, v in optimizer.slot_state(slot).items()}
    out["params"] = engine.bank.params[slot].clone()
    out["grads"] = engine.bank.grads[slot].clone()
    out["pending"] = torch.tensor(optimizer.has_pending_gradient(slot))
    return out


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        assert x.dtype == y.dtype, key
        if x.dtype == torch.float32:  # the bits, so that -0.0 != 0.0 and NaN == NaN
            x, y = x.view(torch.int32), y.view(torch.int32)
        assert torch.equal(x, y), key


@pytest.mark.parametrize("family", ["adamw", "dimuon"])
@pytest.mark.parametrize("via", ["memory", "disk"])
def test_paged_slot_continues_exactly_like_one_never_paged(family, via, tmp_path):
    reference, paged = make_engine(num_slots=3), make_engine(num_slots=3)
    spec = AdapterSpec(rank=4, alpha=8.0, seed=7)
    ref_slot = reference.create_adapter(spec, optimizer=family)
    slot = paged.create_adapter(spec, optimizer=family)
    other = paged.create_adapter(AdapterSpec(rank=2, alpha=4.0, seed=9), optimizer="adamw")
    for engine, s in ((reference, ref_slot), (paged, slot)):
        _train(engine, s, family, steps=2, seed=100)
        # a gradient accumulated and not yet stepped travels with the run
        engine.forward_backward([sft_item(s, 300)])
    before = _snapshot(paged, slot)
    state = paged.export_slot(slot)
    assert state.pending and state.grads is not None and state.step == 2
    paged.free_adapter(slot)
    # the slot is used by another run meanwhile
    intruder = paged.create_adapter(AdapterSpec(rank=3, alpha=3.0, seed=5))
    assert intruder == slot
    _train(paged, intruder, "adamw", 1, 7)
    _train(paged, other, "adamw", 1, 11)
    if via == "disk":
        dest = tmp_path / "paged" / "run-1"
        written = paged.write_slot(state, dest)
        assert written > 0
        assert stat.S_IMODE(dest.stat().st_mode) == 0o700
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in dest.rglob("*") if f.is_file())
        state = paged.read_slot(dest)
    paged.free_adapter(intruder)
    back = paged.import_slot(state)
    _assert_bitwise(_snapshot(paged, back), before)
    assert paged.hparams[back] == reference.hparams[ref_slot]
    # the next step (on the carried gradient plus a new one) and its loss match exactly
    ref_out = reference.forward_backward([sft_item(ref_slot, 400)])
    out = paged.forward_backward([sft_item(back, 400)])
    assert out.metrics == ref_out.metrics
    ref_metrics = reference.optim_step({ref_slot: FAMILIES[family]})[ref_slot]
    metrics = paged.optim_step({back: FAMILIES[family]})[back]
    assert metrics == ref_metrics
    expected, got = _snapshot(reference, ref_slot), _snapshot(paged, back)
    _assert_bitwise(got, expected)


def test_import_refuses_a_state_that_does_not_fit_and_claims_no_slot():
    engine = make_engine(num_slots=3)
    slot = engine.create_adapter(AdapterSpec(rank=2, alpha=4.0, seed=1))
    state = engine.export_slot(slot)
    engine.free_adapter(slot)
    state.params = state.params[:-1]
    with pytest.raises(ValueError, match="slot state 'params' must be float32"):
        engine.import_slot(state)
    assert engine.bank.used_slots() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_the_warm_copy_is_pinned_host_memory_and_exact():
    model = tiny_qwen3().cuda()
    adapted = AdaptedModel(model, resolve_tinker_targets(model))
    adapted.add_bank("train", num_slots=3, r_max=8)
    engine = TrainEngine(adapted, base_model_id="tiny-test")
    slot = engine.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=7))
    _train(engine, slot, "adamw", steps=1, seed=5)
    engine.forward_backward([sft_item(slot, 9)])
    before = {k: v.cpu() for k, v in _snapshot(engine, slot).items()}
    state = engine.export_slot(slot)
    assert state.params.device.type == "cpu" and state.params.is_pinned()
    assert state.grads is not None and state.grads.is_pinned()
    engine.free_adapter(slot)
    back = engine.import_slot(state)
    _assert_bitwise({k: v.cpu() for k, v in _snapshot(engine, back).items()}, before)
