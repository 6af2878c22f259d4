"""The canary after publish: passes for a faithful sync, raises for every broken one."""

from __future__ import annotations

import pytest
import torch

from lorafleet.canary import SyncVerificationError
from lorafleet.engines import Colocated, colocate
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.numerics import parse_numerics
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample import UnknownVersionError
from lorafleet.verification import canary_check, publish_verified
from tests._models import tiny_qwen3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(dtype: torch.dtype = torch.float32, numerics: str = "batch-invariant") -> Colocated:
    model = tiny_qwen3().to(dtype)
    return colocate(
        model,
        resolve_tinker_targets(model),
        base_model_id="tiny",
        r_max=8,
        sample_slots=4,
        numerics=parse_numerics(numerics),
    )


def trained_slot(stack: Colocated, seed: int, scale: float = 0.3) -> int:
    slot = stack.trainer.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=seed))
    gen = torch.Generator().manual_seed(seed)
    weights = {
        p: (A, scale * torch.randn(B.shape, generator=gen))
        for p, (A, B) in stack.trainer.bank.slot_weights(slot).items()
    }
    stack.trainer.bank.load_slot_weights(slot, weights)
    return slot


def test_faithful_sync_passes_and_differs_from_the_base():
    stack = make()
    slot = trained_slot(stack, 1)
    _key, result = publish_verified(stack.sampler, stack.trainer, slot, "a")
    assert result.differs_check == "passed"
    assert result.max_abs_diff <= 1e-5 == result.tolerance
    assert result.base_diff > 0.01


@pytest.mark.parametrize("numerics,tolerance", [("batch-invariant", 1e-3), ("fast", 0.02)])
def test_bf16_canary_tolerance_follows_the_numerics(numerics: str, tolerance: float):
    """Batch-invariant: the sampler computes the canary exactly as the trainer does, so the bf16
    tolerance is the tight one (canary.INVARIANT_TOLERANCES); fast keeps the stock one."""
    stack = make(torch.bfloat16, numerics)
    slot = trained_slot(stack, 1)
    _key, result = publish_verified(stack.sampler, stack.trainer, slot, "a")
    assert result.differs_check == "passed" and result.tolerance == tolerance
    assert result.max_abs_diff <= tolerance
    if numerics == "batch-invariant":
        assert result.max_abs_diff == 0.0  # the same computation on both sides


def test_fresh_adapter_equals_the_base_and_the_result_says_so():
    stack = make()
    slot = stack.trainer.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=3))  # B = 0
    _, result = publish_verified(stack.sampler, stack.trainer, slot, "fresh")
    assert result.differs_check.startswith("skipped") and result.base_diff == 0.0


@pytest.mark.parametrize("breakage", ["zeroed", "wrong_source", "scale_lost"])
def test_broken_sync_raises(breakage):
    stack = make()
    slot, other = trained_slot(stack, 1), trained_slot(stack, 2)
    key = stack.versions.publish("a", stack.trainer.bank, slot)
    sampler_slot = stack.versions.info(key).slot
    with torch.no_grad():
        if breakage == "zeroed":
            stack.versions.bank.params[sampler_slot].zero_()
        elif breakage == "wrong_source":
            stack.versions.bank.params[sampler_slot].copy_(stack.trainer.bank.params[other])
        else:
            stack.versions.bank.scales[sampler_slot] = 0.0
    with pytest.raises(SyncVerificationError, match="canary mismatch"):
        canary_check(stack.sampler, key, stack.trainer, slot)


def test_publish_verified_withdraws_a_bad_copy(monkeypatch):
    stack = make()
    slot, other = trained_slot(stack, 1), trained_slot(stack, 2)
    bank = stack.versions.bank
    real_copy = bank.copy_slot_from
    monkeypatch.setattr(
        bank, "copy_slot_from", lambda src, s, dst: real_copy(src, other, dst)
    )  # wrong slot
    with pytest.raises(SyncVerificationError):
        publish_verified(stack.sampler, stack.trainer, slot, "a")
    with pytest.raises(UnknownVersionError):
        stack.versions.info(("a", 0))
    assert stack.versions.resident() == [] and bank.used_slots() == []


def test_an_adapter_below_tolerance_must_still_reach_the_sampler():
    stack = make()
    slot = trained_slot(stack, 4, scale=1e-7)  # non-zero, effect far below 1e-4
    key = stack.versions.publish("tiny", stack.trainer.bank, slot)
    assert canary_check(stack.sampler, key, stack.trainer, slot).differs_check == "passed"
    with torch.no_grad():
        stack.versions.bank.params[stack.versions.info(key).slot].zero_()
    with pytest.raises(SyncVerificationError, match="equal its base"):
        canary_check(stack.sampler, key, stack.trainer, slot)


def test_bf16_sync_passes_with_the_bf16_tolerance():
    stack = make(torch.bfloat16, "fast")
    slot = trained_slot(stack, 5)
    _, result = publish_verified(stack.sampler, stack.trainer, slot, "b")
    assert result.tolerance == 0.02 and result.differs_check == "passed"
    assert result.max_abs_diff <= 1e-3  # same shapes on both sides: rounding noise only
