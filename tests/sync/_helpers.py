"""Shared set-up for the sync tests: a colocated trainer + sampler and adapters that differ."""

from __future__ import annotations

import torch

from lorafleet.engines import Colocated, colocate
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.train.engine import TrainEngine, TrainItem
from lorafleet.train.optim import AdamHParams
from tests._models import tiny_qwen3


def tiny_stack(dtype: torch.dtype = torch.float32, *, sample_slots: int = 4) -> Colocated:
    model = tiny_qwen3().to(dtype)
    return colocate(
        model,
        resolve_tinker_targets(model),
        base_model_id="tiny",
        r_max=8,
        sample_slots=sample_slots,
    )


def randomize(trainer: TrainEngine, slot: int, seed: int, scale: float = 0.3) -> None:
    """Non-zero B, as if trained: the adapter's effect is far above any tolerance."""
    gen = torch.Generator().manual_seed(seed)
    weights = {
        p: (A, scale * torch.randn(B.shape, generator=gen))
        for p, (A, B) in trainer.bank.slot_weights(slot).items()
    }
    trainer.bank.load_slot_weights(slot, weights)


def new_adapter(trainer: TrainEngine, seed: int, *, rank: int = 4, randomized: bool = True) -> int:
    slot = trainer.create_adapter(AdapterSpec(rank=rank, alpha=2.0 * rank, seed=seed))
    if randomized:
        randomize(trainer, slot, seed)
    return slot


def train_step(trainer: TrainEngine, slot: int, tokens: list[int], lr: float = 1e-2) -> float:
    """One cross-entropy step on `tokens` (next-token targets), returns the loss."""
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
    out = trainer.forward_backward([item])
    trainer.optim_step({slot: AdamHParams(learning_rate=lr)})
    return out.metrics["loss:sum"]
