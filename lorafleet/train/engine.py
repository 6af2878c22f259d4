"""Training over mixed-adapter batches: one forward/backward serves every adapter in the batch.

Flow of one `forward_backward(items)`:
1. `prepare` validates every item completely (slot, tokens, loss inputs) before any compute, so a
   rejected call changes no adapter, gradient or optimizer state. A server validates each
   client's request on its own, then batches the prepared items of many clients together.
2. Items are packed into micro-batches by a padded-token budget (memory stays bounded however
   large the call), right-padded, and routed per row to their adapter slot (padding -> slot 0).
3. Each item's loss is computed on its own target log-probs and the sum is backpropagated once
   per micro-batch; each slot's gradient row receives exactly what its rows alone would give.
   Gradients accumulate per adapter across calls until that adapter's optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lorafleet.adapters.checkpoint import (
    TrainingState,
    apply_training_state,
    read_training_state,
    save_training_state,
)
from lorafleet.adapters.peft_io import export_peft, import_peft
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec, BankSet
from lorafleet.train.losses import (
    LossSpec,
    compute_loss,
    loss_targets,
    merge_metrics,
    validate_loss,
)
from lorafleet.train.optim import AdamHParams, BankAdamW

DEFAULT_TOKEN_BUDGET = 4096


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


@dataclass
class ItemOutput:
    """Per-item result: the current policy's log-probs of its targets and its loss metrics."""

    logprobs: torch.Tensor  # float32, shape of target_tokens
    metrics: dict[str, float]


@dataclass
class BatchOutput:
    items: list[ItemOutput]
    num_microbatches: int
    slots: tuple[int, ...]  # distinct adapter slots in the batch
    metrics: dict[str, float] = field(default_factory=dict)  # all items merged


def plan_microbatches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Groups item indices so that rows x longest row <= token_budget per micro-batch.

    Longest first, so rows of similar length pad together; an item longer than the budget
    gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    current_max = 0
    for index in order:
        length = lengths[index]
        new_max = max(current_max, length)
        if current and new_max * (len(current) + 1) > token_budget:
            batches.append(current)
            current, new_max = [], length
        current.append(index)
        current_max = new_max
    if current:
        batches.append(current)
    return batches


class TrainEngine:
    """Mixed-adapter forward/backward and per-adapter AdamW over one bank set."""

    def __init__(
        self,
        adapted: AdaptedModel,
        *,
        bank: str = "train",
        base_model_id: str,
        token_budget: int = DEFAULT_TOKEN_BUDGET,
        with_optimizer: bool = True,
    ):
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        self.adapted = adapted
        self.bank: BankSet = adapted.bank(bank)
        self.base_model_id = base_model_id
        self.token_budget = token_budget
        model = adapted.model
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.max_length = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        self.device = self.bank.params.device
        self.optimizer: BankAdamW | None = None
        if with_optimizer:
            if not self.bank.trainable:
                raise ValueError(f"bank {bank!r} is inference-only; create it with trainable=True")
            self.optimizer = BankAdamW(self.bank.params, self.bank.grads)
        self.hparams: dict[int, AdamHParams] = {}
        # Sharded (FSDP) training: each rank runs its share of a micro-batch, and every rank must
        # take the same branch (backward, or raise) or the others wait forever in a collective.
        # Given "this rank's losses are finite", it returns whether all ranks' are (lorafleet.dist).
        self.all_ranks_ok: Callable[[bool], bool] | None = None

    # ---------------------------------------------------------------- adapters
    def create_adapter(self, spec: AdapterSpec, slot: int | None = None) -> int:
        slot = self.bank.allocate(spec, slot)
        if self.optimizer is not None:
            self.optimizer.reset_slot(slot)
        return slot

    def free_adapter(self, slot: int) -> None:
        self.bank.free(slot)
        if self.optimizer is not None:
            self.optimizer.reset_slot(slot)
        self.hparams.pop(slot, None)

    # ---------------------------------------------------------------- validation
    def prepare(self, items: Sequence[TrainItem]) -> list[PreparedItem]:
        """Validates every item before anything runs; raises TrainInputError on the first bad one."""
        if not items:
            raise TrainInputError("no items to run")
        return [self._prepare_one(i, item) for i, item in enumerate(items)]

    def _prepare_one(self, index: int, item: TrainItem) -> PreparedItem:
        where = f"datum {index}"
        slot = item.slot
        if not isinstance(slot, int) or isinstance(slot, bool) or not 1 <= slot < self.bank.num_slots or self.bank.slots[slot] is None:
            raise TrainInputError(f"{where}: slot {slot!r} holds no adapter in bank {self.bank.name!r}")
        tokens = torch.as_tensor(item.tokens)
        if tokens.numel() == 0:
            raise TrainInputError(f"{where}: model input is empty")
        if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.dtype.is_complex:
            raise TrainInputError(f"{where}: model input tokens must be integers, got dtype {tokens.dtype}")
        tokens = tokens.to(torch.int64).reshape(-1) if tokens.dim() <= 1 else tokens
        if tokens.dim() != 1:
            raise TrainInputError(f"{where}: model input tokens must be 1-D, got shape {tuple(tokens.shape)}")
        length = int(tokens.numel())
        if self.max_length is not None and length > self.max_length:
            raise TrainInputError(f"{where}: model input has {length} tokens, more than the context length {self.max_length}")
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

    # ---------------------------------------------------------------- compute
    def forward(self, items: Sequence[TrainItem] | Sequence[PreparedItem]) -> BatchOutput:
        """Log-probs and loss metrics without touching gradients."""
        prepared = self._ensure_prepared(items)
        with torch.no_grad():
            return self._run(prepared, backward=False)

    def forward_backward(self, items: Sequence[TrainItem] | Sequence[PreparedItem]) -> BatchOutput:
        """Accumulates each item's loss gradient into its adapter's gradient row."""
        if not self.bank.trainable:
            raise ValueError(f"bank {self.bank.name!r} is inference-only")
        prepared = self._ensure_prepared(items)
        return self._run(prepared, backward=True)

    def _ensure_prepared(self, items) -> list[PreparedItem]:
        if items and all(isinstance(item, PreparedItem) for item in items):
            for item in items:
                self.bank.check_slot(item.slot)  # still allocated since it was prepared
            return list(items)
        return self.prepare(items)

    def _run(self, prepared: list[PreparedItem], *, backward: bool) -> BatchOutput:
        outputs: list[ItemOutput | None] = [None] * len(prepared)
        batches = plan_microbatches([p.length for p in prepared], self.token_budget)
        # Each micro-batch checks its losses before its backward; if a later one fails, the
        # gradients earlier ones already added are rolled back, so the call is all or nothing.
        snapshot = None
        if backward and len(batches) > 1:
            slots = sorted({p.slot for p in prepared})
            snapshot = (slots, self.bank.grads[slots].clone())
        try:
            for indices in batches:
                batch = [prepared[i] for i in indices]
                results = self._run_microbatch(batch, backward=backward)
                for i, result in zip(indices, results, strict=True):
                    outputs[i] = result
        except Exception:
            if snapshot is not None:
                slots, saved = snapshot
                with torch.no_grad():
                    self.bank.grads[slots] = saved
            raise
        slots = tuple(sorted({p.slot for p in prepared}))
        if backward and self.optimizer is not None:
            self.optimizer.note_gradient(slots)
        finished = [o for o in outputs if o is not None]
        return BatchOutput(
            items=finished,
            num_microbatches=len(batches),
            slots=slots,
            metrics=merge_metrics(o.metrics for o in finished),
        )

    def _run_microbatch(self, batch: list[PreparedItem], *, backward: bool) -> list[ItemOutput]:
        # Rows laid out slot by slot, padding routed to its row's slot: tokens arrive already
        # in segment order, so the LoRA layers skip their gather/scatter. Padding sits after
        # each row's last real token, so under causal attention it can influence no real
        # token, and its LoRA gradient is exactly zero.
        layout = sorted(range(len(batch)), key=lambda i: batch[i].slot)
        rows = len(batch)
        max_len = max(p.length for p in batch)
        width = max(_target_width(p.loss) for p in batch)
        input_ids = torch.zeros(rows, max_len, dtype=torch.int64)
        attention_mask = torch.zeros(rows, max_len, dtype=torch.int64)
        slot_ids = torch.empty(rows, max_len, dtype=torch.int64)
        targets = torch.zeros(rows, max_len, width, dtype=torch.int64)
        for row, index in enumerate(layout):
            item = batch[index]
            input_ids[row, : item.length] = item.tokens
            attention_mask[row, : item.length] = 1
            slot_ids[row] = item.slot
            item_targets = loss_targets(item.loss)
            targets[row, : item.length, : _target_width(item.loss)] = item_targets.reshape(item.length, -1)
        with self.adapted.routing(self.bank.name, slot_ids.to(self.device)):
            logits = self.adapted.model(
                input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device)
            ).logits
        # fp32 log-softmax once for the batch, then one gather: per-row slicing of the logits
        # would make autograd zero-fill a full-batch logits gradient for every row.
        target_logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.to(self.device))
        losses: list[torch.Tensor] = []
        outputs: list[ItemOutput | None] = [None] * rows
        failure: TrainInputError | None = None
        for row, index in enumerate(layout):
            item = batch[index]
            logprobs = target_logprobs[row, : item.length, : _target_width(item.loss)]
            logprobs = logprobs.reshape(loss_targets(item.loss).shape)
            loss, metrics = compute_loss(item.loss, logprobs)
            if failure is None and not math.isfinite(metrics["loss:sum"]):
                failure = TrainInputError(
                    f"loss of a {item.loss.name} datum for slot {item.slot} is {metrics['loss:sum']} "
                    "(log-ratio overflow?); nothing was applied"
                )
            losses.append(loss)
            outputs[index] = ItemOutput(logprobs=logprobs.detach().float().cpu(), metrics=metrics)
        if self.all_ranks_ok is not None and not self.all_ranks_ok(failure is None) and failure is None:
            failure = TrainInputError("a datum on another rank of this batch has a non-finite loss; nothing was applied")
        if failure is not None:
            raise failure
        if backward:
            torch.stack(losses).sum().backward()
        return [o for o in outputs if o is not None]

    # ---------------------------------------------------------------- optimizer
    def optim_step(self, hparams: Mapping[int, AdamHParams]) -> dict[int, dict[str, float]]:
        """One BankAdamW call for every slot in `hparams` (each with its own hyper-parameters)."""
        if self.optimizer is None:
            raise ValueError("this engine has no optimizer (inference only)")
        for slot in hparams:
            self.bank.check_slot(slot)
        metrics = self.optimizer.step(hparams)
        self.hparams.update(hparams)
        return metrics

    # ---------------------------------------------------------------- state files
    def save_state(self, slot: int, dest: str | Path, *, metadata: dict | None = None, overwrite: bool = False) -> Path:
        return save_training_state(
            Path(dest),
            bank=self.bank,
            slot=slot,
            optimizer=self.optimizer,
            base_model_id=self.base_model_id,
            hparams=self.hparams.get(slot),
            metadata=metadata,
            overwrite=overwrite,
        )

    def load_state(
        self, src: str | Path | TrainingState, *, slot: int | None = None, with_optimizer: bool = True,
        source: str | Path | None = None,
    ) -> int:
        """Restores a training checkpoint (a directory, or one already read with
        `read_training_state`, then `source` names it in errors) into a slot."""
        if isinstance(src, TrainingState):
            state, where = src, Path(source or "<checkpoint>")
        else:
            state, where = read_training_state(Path(src)), Path(src)
        slot = apply_training_state(
            state,
            where,
            bank=self.bank,
            optimizer=self.optimizer,
            base_model_id=self.base_model_id,
            slot=slot,
            load_optimizer=with_optimizer,
        )
        if state.hparams is not None:
            self.hparams[slot] = state.hparams
        return slot

    def export_peft(self, slot: int, dest: str | Path, *, overwrite: bool = False) -> Path:
        return export_peft(self.bank, slot, Path(dest), base_model_name_or_path=self.base_model_id, overwrite=overwrite)

    def import_peft(self, src: str | Path, *, slot: int | None = None, seed: int = 0) -> int:
        slot = import_peft(self.bank, Path(src), slot=slot, seed=seed)
        if self.optimizer is not None:
            self.optimizer.reset_slot(slot)
        return slot


def _target_width(spec: LossSpec) -> int:
    """Targets per position: 1, or K for top-k distillation targets [T, K]."""
    targets = loss_targets(spec)
    return 1 if targets.dim() == 1 else int(targets.shape[1])
