"""Canary check after each publish: the sampler must compute what the trainer computes.

A sync can fail silently in many ways (wrong slot, stale copy, zeroed row, a routing bug that
runs the base model): the sampler would still produce fluent text, and RL would quietly train
on samples from the wrong policy. So after every publish, the sampler's log-probs of a fixed
prompt (through the real sampling path: prefill over the row cache, split head) are compared
with the training engine's for the trainer slot that was published:

1. they must agree within a dtype-dependent tolerance;
2. when the adapter is non-zero they must differ from the base model's log-probs (computed
   by the sampler in the same batch). A freshly initialised adapter (B = 0) equals the base
   exactly, so that check is skipped and the result says so. The comparison is strict
   inequality: an adapter whose effect is below the tolerance can be confirmed present, not
   measured.

Any failure raises `SyncVerificationError`; `publish_verified` also withdraws the version, so
a bad sync is never served (and never silently replaced by the base model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from lorafleet.fsio import PathLike
from lorafleet.sample.engine import SampleEngine
from lorafleet.sample.types import SampleRequest, SamplingParams, VersionKey
from lorafleet.train.engine import TrainEngine, TrainItem

CANARY_LENGTH = 16

TOLERANCES: dict[torch.dtype, float] = {torch.float32: 1e-4, torch.bfloat16: 0.02}
"""Max |sampler - trainer| log-prob per position. Both sides run the same shapes (one row of
the whole canary), so they agree to rounding noise (bit-exact on the CPUs we measured). Shapes
matter in bf16: on SmolLM2-135M the *trainer's own* log-probs of the same 15 targets move by up
to 0.31 when a 16th input token is appended, because matmul blocking follows the shape."""


class SyncVerificationError(RuntimeError):
    """The sampler's copy of a version does not compute what the trainer computes."""


@dataclass(frozen=True)
class CanaryResult:
    key: VersionKey
    max_abs_diff: float  # sampler vs trainer
    tolerance: float
    base_diff: float  # sampler adapted vs sampler base
    differs_check: Literal["passed", "skipped: adapter is zero (B = 0), equals the base model"]


def canary_tokens(vocab_size: int, length: int = CANARY_LENGTH) -> list[int]:
    """A fixed, vocabulary-spread prompt (no tokenizer needed, identical in every process)."""
    return [(7919 * i + 104729) % vocab_size for i in range(length)]


def adapter_is_zero(trainer: TrainEngine, slot: int) -> bool:
    """True when the slot's LoRA delta is exactly zero in every layer (A = 0 or B = 0)."""
    for A, B in trainer.bank.slot_weights(slot).values():
        if bool(A.any()) and bool(B.any()):
            return False
    return True


def trainer_canary_logprobs(trainer: TrainEngine, slot: int, tokens: Sequence[int]) -> torch.Tensor:
    """log p(tokens[i + 1] | tokens[: i + 1]) from a forward over all of `tokens`: the same input
    shape as the sampler's prefill (the last position gets a dummy, zero-weight target)."""
    seq = torch.tensor(tokens, dtype=torch.int64)
    targets = torch.cat([seq[1:], seq[:1]])
    weights = torch.ones(seq.numel())
    weights[-1] = 0.0
    item = TrainItem(
        slot=slot,
        tokens=seq,
        loss_fn="cross_entropy",
        loss_inputs={"target_tokens": targets, "weights": weights},
    )
    return trainer.forward([item]).items[0].logprobs.float()[:-1].cpu()


def _sampler_logprobs(
    sampler: SampleEngine, key: VersionKey | None, tokens: list[int]
) -> torch.Tensor:
    """Prompt log-probs through the real sampling path, one request per call (one row, the
    trainer's shape)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, stop=[])
    (result,) = sampler.generate([SampleRequest(tokens, params, adapter=key, prompt_logprobs=True)])
    if result.error is not None or result.prompt_logprobs is None:
        what = "the base model" if key is None else repr(key)
        raise SyncVerificationError(f"canary: the sampler could not run {what}: {result.error}")
    return torch.tensor(result.prompt_logprobs[1:], dtype=torch.float32)


def canary_check(
    sampler: SampleEngine,
    key: VersionKey,
    trainer: TrainEngine,
    trainer_slot: int,
    *,
    tokens: Sequence[int] | None = None,
    tolerance: float | None = None,
) -> CanaryResult:
    """Raises SyncVerificationError unless sampler version `key` matches trainer slot `trainer_slot`."""
    canary = list(tokens) if tokens is not None else canary_tokens(sampler.limits.vocab_size)
    if len(canary) < 2:
        raise ValueError("the canary prompt needs at least 2 tokens")
    if tolerance is None:
        try:
            tolerance = TOLERANCES[sampler.dtype]
        except KeyError:
            raise ValueError(
                f"no canary tolerance for dtype {sampler.dtype}; pass tolerance="
            ) from None
    ours = _sampler_logprobs(sampler, key, canary)
    base = _sampler_logprobs(sampler, None, canary)
    theirs = trainer_canary_logprobs(trainer, trainer_slot, canary)
    diff = float((ours - theirs).abs().max())
    if not diff <= tolerance:  # also catches NaN
        raise SyncVerificationError(
            f"canary mismatch for {key!r}: sampler and trainer slot {trainer_slot} log-probs differ by "
            f"{diff:.3g} (tolerance {tolerance:.3g}); the sampler does not hold this version's weights"
        )
    base_diff = float((ours - base).abs().max())
    if adapter_is_zero(trainer, trainer_slot):
        return CanaryResult(
            key,
            diff,
            tolerance,
            base_diff,
            "skipped: adapter is zero (B = 0), equals the base model",
        )
    if not base_diff > 0.0:
        raise SyncVerificationError(
            f"canary for {key!r}: the adapter is non-zero but the sampler's log-probs equal the base "
            "model's; the sampler is not applying it"
        )
    return CanaryResult(key, diff, tolerance, base_diff, "passed")


def publish_verified(
    sampler: SampleEngine,
    trainer: TrainEngine,
    trainer_slot: int,
    adapter_id: str,
    *,
    version: int | None = None,
    path: PathLike | None = None,
    tolerance: float | None = None,
) -> tuple[VersionKey, CanaryResult]:
    """Publishes trainer slot -> sampler, then runs the canary; a failed check withdraws the
    version before raising, so it is never served."""
    key = sampler.versions.publish(
        adapter_id, trainer.bank, trainer_slot, version=version, path=path
    )
    try:
        result = canary_check(sampler, key, trainer, trainer_slot, tolerance=tolerance)
    except BaseException:
        sampler.versions.drop(key)
        raise
    return key, result
