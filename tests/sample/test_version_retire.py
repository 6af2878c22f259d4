"""Retiring a version in use: new pins are refused with a clear error, running sequences finish
on the old weights, and the version is dropped (its slot freed) with its last sequence."""

from __future__ import annotations

import pytest
import torch

from lorafleet.engines import Colocated, colocate
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample import (
    SampleRequest,
    SamplingParams,
    UnknownVersionError,
    VersionRetiredError,
)
from tests._models import tiny_qwen3

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [5, 17, 33, 2, 71]
LONG = SamplingParams(max_tokens=12, temperature=0.0, stop=[])


def make() -> tuple[Colocated, int]:
    model = tiny_qwen3()
    stack = colocate(
        model, resolve_tinker_targets(model), base_model_id="tiny", r_max=8, sample_slots=2
    )
    slot = stack.trainer.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=0))
    return stack, slot


def nudge(stack: Colocated, slot: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    stack.trainer.bank.load_slot_weights(
        slot,
        {
            p: (A, B + 0.3 * torch.randn(B.shape, generator=gen))
            for p, (A, B) in stack.trainer.bank.slot_weights(slot).items()
        },
    )


def test_retire_in_use_finishes_running_sequences_then_drops():
    stack, slot = make()
    nudge(stack, slot, 1)
    old = stack.versions.publish("ckpt", stack.trainer.bank, slot, version=0)
    (reference,) = stack.sampler.generate([SampleRequest(PROMPT, LONG, adapter=old)])
    running = stack.sampler.submit([SampleRequest(PROMPT, LONG, adapter=old)])
    stack.sampler.step()  # admitted: the version is pinned
    assert stack.versions.info(old).pins == 1
    assert stack.versions.retire(old) is False  # before: VersionError "in use" from drop
    assert stack.versions.retiring() == [old]
    with pytest.raises(UnknownVersionError):
        stack.versions.latest("ckpt")  # no version of it is handed out any more
    with pytest.raises(VersionRetiredError, match="being deleted"):
        stack.versions.acquire(old)
    (late,) = stack.sampler.generate([SampleRequest(PROMPT, LONG, adapter=old)])
    assert late.error is not None and "being deleted" in late.error.message
    # The replacement gets a new number while the old one still runs.
    nudge(stack, slot, 2)
    new = stack.versions.publish("ckpt", stack.trainer.bank, slot)
    assert new == ("ckpt", 1) and stack.versions.latest("ckpt") == new
    while not running[0].done():
        stack.sampler.step()
    result = running[0].result()
    assert result.ok and result.sequences[0].tokens == reference.sequences[0].tokens
    with pytest.raises(UnknownVersionError):
        stack.versions.info(old)  # dropped with its last sequence
    assert stack.versions.resident() == [new]
    (fresh,) = stack.sampler.generate([SampleRequest(PROMPT, LONG, adapter=new)])
    assert fresh.ok and fresh.sequences[0].tokens != reference.sequences[0].tokens


def test_retire_unpinned_drops_at_once_and_a_queued_request_is_told_why():
    stack, slot = make()
    key = stack.versions.publish("ckpt", stack.trainer.bank, slot)
    queued = stack.sampler.submit([SampleRequest(PROMPT, LONG, adapter=key)])  # not admitted yet
    assert stack.versions.retire(key) is True
    assert stack.versions.resident() == [] and stack.versions.retiring() == []
    with pytest.raises(UnknownVersionError):
        stack.versions.info(key)
    stack.sampler.step()
    error = queued[0].result().error
    assert error is not None and "was deleted" in error.message  # not "never published"
    again = stack.versions.publish("ckpt", stack.trainer.bank, slot, version=key[1])
    (result,) = stack.sampler.generate([SampleRequest(PROMPT, LONG, adapter=again)])
    assert result.ok  # a key published again is served again
