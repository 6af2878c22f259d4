"""Training items and their validation, shared by every trainer.

The single-process `TrainEngine` and the sharded trainer's server side (`DistTrainEngine`, which
only mirrors the slot table) validate items with the same code, so a request is accepted or
rejected, with the same message, whatever the placement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from lorafleet.model.banks import SlotTable
from lorafleet.model.routing import BASE_SLOT
from lorafleet.train.loss_inputs import LossSpec, validate_loss


class TrainInputError(ValueError):
    """An item that cannot be trained on; the message names the item, field and value."""


@dataclass
class TrainItem:
    """One datum: model input tokens, the adapter slot, and what its loss needs."""

    slot: int
    tokens: torch.Tensor | Sequence[int]
    loss_fn: str
    loss_inputs: Mapping[str, torch.Tensor]
    loss_config: Mapping[str, float] | None = None


@dataclass(frozen=True)
class PreparedItem:
    slot: int
    tokens: torch.Tensor  # int64 [T], on CPU
    loss: LossSpec

    @property
    def length(self) -> int:
        return int(self.tokens.numel())


@dataclass(frozen=True)
class ItemLimits:
    """What an item is checked against: the trainer's slot table and its model's sizes."""

    slots: SlotTable
    vocab_size: int
    max_length: int | None

    def prepare(
        self, items: Sequence[TrainItem], *, allow_base: bool = False
    ) -> list[PreparedItem]:
        """Validates every item before anything runs; raises TrainInputError on the first bad one.

        `allow_base` also accepts slot 0 (BASE_SLOT), the frozen base model: forward-only
        scoring, e.g. a weight sync checking that an engine runs the trainer's base."""
        if not items:
            raise TrainInputError("no items to run")
        return [self._prepare_one(i, item, allow_base) for i, item in enumerate(items)]

    def ensure_prepared(
        self, items: Sequence[TrainItem] | Sequence[PreparedItem], *, allow_base: bool = False
    ) -> list[PreparedItem]:
        """Items prepared earlier (a server validates each request on its own, then batches)
        only need their slot to still be allocated; raw items are prepared now."""
        if items and all(isinstance(item, PreparedItem) for item in items):
            prepared = [item for item in items if isinstance(item, PreparedItem)]
            for item in prepared:
                if not (allow_base and item.slot == BASE_SLOT):
                    self.slots.check_slot(item.slot)  # still allocated since it was prepared
            return prepared
        return self.prepare(cast(Sequence[TrainItem], items), allow_base=allow_base)

    def _prepare_one(self, index: int, item: TrainItem, allow_base: bool = False) -> PreparedItem:
        where = f"datum {index}"
        slot = item.slot
        if (
            not isinstance(slot, int)
            or isinstance(slot, bool)
            or (
                not (allow_base and slot == BASE_SLOT)
                and (not 1 <= slot < self.slots.num_slots or self.slots.slots[slot] is None)
            )
        ):
            raise TrainInputError(
                f"{where}: slot {slot!r} holds no adapter in bank {self.slots.name!r}"
            )
        tokens = torch.as_tensor(item.tokens)
        if tokens.numel() == 0:
            raise TrainInputError(f"{where}: model input is empty")
        if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.dtype.is_complex:
            raise TrainInputError(
                f"{where}: model input tokens must be integers, got dtype {tokens.dtype}"
            )
        tokens = tokens.to(torch.int64).reshape(-1) if tokens.dim() <= 1 else tokens
        if tokens.dim() != 1:
            raise TrainInputError(
                f"{where}: model input tokens must be 1-D, got shape {tuple(tokens.shape)}"
            )
        length = int(tokens.numel())
        if self.max_length is not None and length > self.max_length:
            raise TrainInputError(
                f"{where}: model input has {length} tokens, more than the context length {self.max_length}"
            )
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            position = int(((tokens == bad).nonzero())[0])
            raise TrainInputError(
                f"{where}: model input token id {bad} at position {position} is outside the vocabulary [0, {self.vocab_size})"
            )
        spec = validate_loss(
            item.loss_fn, item.loss_inputs, item.loss_config, length, self.vocab_size, where=where
        )
        return PreparedItem(slot=slot, tokens=tokens.cpu(), loss=spec)
