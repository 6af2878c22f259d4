"""A training run's whole state off the bank, so that its slot can hold another run meanwhile.

A server with more runs than trainer slots pages them (`lorafleet.server.engine.live_models`): a run
that leaves its slot must come back to exactly where it was, bit for bit, so this is the
slot's full picture, not a checkpoint's: the weights row, the optimizer family with its moment
rows and step count, the last hyper-parameters, and the gradient accumulated by
forward_backward calls since the last optim_step (Tinker accumulates until the step, and a run
may be paged out between the two). Rows are the bank's flat layout, copied as they are, so
going warm (host memory) and back changes no bit; going cold writes the checkpoint format
(`train.checkpointing.write_slot_state`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorafleet.adapters.hparams import OptimHParams
from lorafleet.model.banks import AdapterSpec

__all__ = ["SlotState", "host_copy"]


@dataclass
class SlotState:
    spec: AdapterSpec  # targets resolved (the module paths it trains)
    optimizer: str  # the run's optimizer family (adapters.hparams.OPTIMIZERS)
    params: torch.Tensor  # fp32 [P], the bank row
    moments: dict[str, torch.Tensor]  # OPTIMIZER_MOMENTS[optimizer] -> fp32 [P] rows
    step: int  # optimizer steps taken
    pending: bool  # a gradient was accumulated since the last optim_step
    grads: torch.Tensor | None  # fp32 [P] when pending or non-zero; None means all zero
    hparams: OptimHParams | None  # the last optim_step's, reported in checkpoints

    @property
    def nbytes(self) -> int:
        rows = [self.params, *self.moments.values()]
        if self.grads is not None:
            rows.append(self.grads)
        return sum(row.numel() * row.element_size() for row in rows)


def host_copy(row: torch.Tensor) -> torch.Tensor:
    """A copy of `row` in host memory: pinned when it comes from an accelerator, so that paging
    back in is one DMA; a plain clone on the CPU."""
    row = row.detach()
    if row.device.type == "cpu":
        return row.clone()
    out = torch.empty(row.shape, dtype=row.dtype, pin_memory=True)
    out.copy_(row)
    return out
