"""The canary after each in-process publish: the sampler must compute what the trainer computes.

This is the glue that needs both engines, so it sits above `lorafleet.train` and
`lorafleet.sample` (neither imports it): it asks the trainer for its log-probs of the canary
prompt for the published slot (`Trainer.canary_logprobs`) and the sampler for its own under the
new version and under the base model (`sampler_canary_logprobs`: the sampling path's forward,
run beside the running batch, so a publish never waits behind other callers' samples), and
hands them to the pure rules of `lorafleet.canary`. The base model's log-probs come from the
sampler in the same check, so the "differs from base" rule compares like with like.

`publish_verified` withdraws a version that fails, so a bad sync is never served (and never
silently replaced by the base model).
"""

from __future__ import annotations

from collections.abc import Sequence

from lorafleet.canary import (
    CanaryReport,
    canary_tokens,
    check_tokens,
    compare,
    layers_are_zero,
    tolerance_for,
)
from lorafleet.fsio import PathLike
from lorafleet.interfaces import Sampler, Trainer
from lorafleet.model.numerics import model_numerics
from lorafleet.sample.canary_probe import sampler_canary_logprobs, version_name
from lorafleet.sample.types import VersionKey

__all__ = ["adapter_is_zero", "canary_check", "publish_verified"]


def adapter_is_zero(trainer: Trainer, slot: int) -> bool:
    """True when the slot's LoRA delta is exactly zero in every layer (A = 0 or B = 0)."""
    return layers_are_zero(trainer.bank.slot_weights(slot).values())


def canary_check(
    sampler: Sampler,
    key: VersionKey,
    trainer: Trainer,
    trainer_slot: int,
    *,
    tokens: Sequence[int] | None = None,
    tolerance: float | None = None,
) -> CanaryReport[VersionKey]:
    """Raises SyncVerificationError unless sampler version `key` matches trainer slot
    `trainer_slot`; the tolerance defaults to the sampler dtype's (ValueError when it has none)."""
    canary = check_tokens(
        tokens if tokens is not None else canary_tokens(sampler.limits.vocab_size)
    )
    if tolerance is None:
        # both sides batch-invariant (one model under both in a colocated stack): the tight one
        invariant = (
            all(_numerics(side) in ("batch-invariant", None) for side in (sampler, trainer))
            and _numerics(sampler) == "batch-invariant"
        )

        tolerance = tolerance_for(sampler.dtype, same_implementation=True, invariant=invariant)
    served = sampler_canary_logprobs(sampler, key, canary)
    base = sampler_canary_logprobs(sampler, None, canary)
    expected = trainer.canary_logprobs(trainer_slot, canary)
    return compare(
        key,
        served,
        name=version_name(key),
        expected=expected,
        engine_base=base,
        adapter_zero=adapter_is_zero(trainer, trainer_slot),
        tolerance=tolerance,
    )


def publish_verified(
    sampler: Sampler,
    trainer: Trainer,
    trainer_slot: int,
    adapter_id: str,
    *,
    version: int | None = None,
    path: PathLike | None = None,
    tolerance: float | None = None,
) -> tuple[VersionKey, CanaryReport[VersionKey]]:
    """Publishes trainer slot -> sampler, then runs the canary; a failed check withdraws the
    version before raising, so it is never served. A version store that checked every replica
    itself while publishing (`VersionStore.verified`: Ray and rollout replicas) is not checked a
    second time."""
    versions = sampler.versions
    key = versions.publish(adapter_id, trainer.bank, trainer_slot, version=version, path=path)
    try:
        checked = versions.verified(key)
        if checked is not None and tolerance is None:
            return key, checked
        result = canary_check(sampler, key, trainer, trainer_slot, tolerance=tolerance)
    except BaseException:
        sampler.versions.drop(key)
        raise
    return key, result


def _numerics(engine: object) -> str | None:
    """The numerics of an engine's model in this process; None when it has none here (trainer
    ranks elsewhere, built from the same engine config as the sampler)."""
    adapted = getattr(engine, "adapted", None)
    model = getattr(adapted, "model", None)
    return None if model is None else model_numerics(model)
