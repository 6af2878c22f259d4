"""A trainer and a sampler over one frozen base model, wired so that publishing works.

`copy_slot_from` needs both bank sets over the same layers with the same r_max; building them
here in one place keeps that invariant out of every caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.kernels import KernelName
from lorafleet.sample.engine import DEFAULT_MAX_ROWS, SampleEngine
from lorafleet.sample.versions import VersionStore
from lorafleet.train.engine import TrainEngine


@dataclass
class Colocated:
    adapted: AdaptedModel
    trainer: TrainEngine
    versions: VersionStore
    sampler: SampleEngine


def colocate(
    model: nn.Module,
    layer_paths: Sequence[str],
    *,
    base_model_id: str,
    tokenizer: Any | None = None,
    train_slots: int = 8,
    sample_slots: int = 8,
    r_max: int = 16,
    max_rows: int = DEFAULT_MAX_ROWS,
    kernel: KernelName = "auto",
) -> Colocated:
    """Wraps `model` once; `train_slots`/`sample_slots` adapters (slot 0, the base, not counted)."""
    adapted = AdaptedModel(model, layer_paths, kernel=kernel)
    adapted.add_bank("train", num_slots=train_slots + 1, r_max=r_max)
    sample_bank = adapted.add_bank(
        "sample", num_slots=sample_slots + 1, r_max=r_max, trainable=False
    )
    trainer = TrainEngine(adapted, bank="train", base_model_id=base_model_id)
    versions = VersionStore(sample_bank, base_model_id=base_model_id)
    sampler = SampleEngine(adapted, versions, tokenizer=tokenizer, max_rows=max_rows)
    return Colocated(adapted=adapted, trainer=trainer, versions=versions, sampler=sampler)
