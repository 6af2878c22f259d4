"""The trainer's side of the canary: its log-probs of the canary prompt for one slot.

`lorafleet.canary` compares them with an engine's; they are computed here, in `train/`, so that
every trainer (`TrainEngine`, `DistTrainEngine`) answers `Trainer.canary_logprobs` the same way
and the callers (in-process publish, `sync/`, the Ray replicas) need not import the trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from lorafleet.model.routing import BASE_SLOT
from lorafleet.train.items import TrainItem

if TYPE_CHECKING:
    from lorafleet.interfaces import Trainer

__all__ = ["trainer_canary_logprobs"]


@torch.no_grad()
def trainer_canary_logprobs(
    trainer: Trainer, slot: int | None, tokens: Sequence[int]
) -> torch.Tensor:
    """log p(tokens[i + 1] | tokens[: i + 1]) for i < len - 1 from trainer slot `slot` (None =
    the base model), fp32 on the CPU.

    One forward over all of `tokens` (the last position gets a zero-weight dummy target), so
    the input shape matches an engine's prefill of the same prompt: in bf16 the trainer's own
    log-probs move with the input length, because matmul blocking follows the shape."""
    seq = torch.tensor(list(tokens), dtype=torch.int64)
    targets = torch.cat([seq[1:], seq[:1]])
    weights = torch.ones(seq.numel())
    weights[-1] = 0.0
    item = TrainItem(
        slot=BASE_SLOT if slot is None else slot,
        tokens=seq,
        loss_fn="cross_entropy",
        loss_inputs={"target_tokens": targets, "weights": weights},
    )
    return trainer.forward([item]).items[0].logprobs.float()[:-1].cpu()
