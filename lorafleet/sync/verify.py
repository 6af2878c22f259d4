"""The rollout engine's side of the canary after every sync.

The engine's prompt log-probs of the canary prompt (token ids, so tokenization cannot differ)
are asked for under the new version *by name*, and compared by `lorafleet.canary.compare`
with the trainer's (`Trainer.canary_logprobs`) for the slot that was
synced. Asking by name is what catches an adapter that was "loaded" but never applied: vLLM
accepts a PEFT dir whose module names it does not know and serves the base model under the
adapter's name, and the canary's "differs from base" rule fails it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lorafleet.canary import SyncVerificationError
from lorafleet.sync.base import (
    AdapterVersion,
    RolloutEngine,
    RolloutEngineError,
    RolloutParams,
    RolloutRequest,
    Target,
)

__all__ = ["engine_logprobs"]


def engine_logprobs(
    engine: RolloutEngine, target: Target, tokens: Sequence[int]
) -> tuple[torch.Tensor, str | None]:
    """The engine's prompt log-probs of `tokens` under `target`, and who it says served them.

    Any engine failure is a failed verification: a version the engine cannot even run is
    not synced."""
    request = RolloutRequest(
        list(tokens), target, RolloutParams(max_tokens=1, temperature=0.0), prompt_logprobs=True
    )
    what = repr(target.name) if isinstance(target, AdapterVersion) else "the base model"
    try:
        (result,) = engine.generate([request])
    except RolloutEngineError as exc:
        raise SyncVerificationError(
            f"canary: the {engine.kind} engine could not run {what}: {exc}"
        ) from exc
    values = result.prompt_logprobs
    usable = [] if values is None else [float(v) for v in values[1:] if v is not None]
    if values is None or len(values) != len(tokens) or len(usable) != len(tokens) - 1:
        raise SyncVerificationError(
            f"canary: the {engine.kind} engine returned no usable prompt log-probs for {what}"
        )
    return torch.tensor(usable, dtype=torch.float32), result.served_by
