"""Training over mixed-adapter batches: one forward/backward serves every adapter in the batch.

Flow of one `forward_backward(items)`:
1. `prepare` validates every item completely (slot, tokens, loss inputs) before any compute, so a
   rejected call changes no adapter, gradient or optimizer state. A server validates each
   client's request on its own, then batches the prepared items of many clients together.
2. Items of one slot that start with the same tokens (the prompt of an RL sampling group) are
   grouped to run that prefix once, an item nested in another of its slot (an earlier turn of
   the same conversation) runs nothing and reads the longer item's rows, an item that shares
   most of a longer one continues that one's cache (prefix_trie.py), and everything is packed
   into micro-batches by a budget of padded tokens really run (memory stays bounded however
   large the call); see layout.py.
3. Each item's loss is computed on its own target log-probs and the sum is backpropagated once
   per micro-batch; each slot's gradient row receives exactly what its rows alone would give.
   The head and its fp32 log-softmax carry autograd only at positions whose loss term can have a
   gradient (`losses.gradient_mask`: not the prompt of an RL datum); every position's log-prob
   is still returned. Gradients accumulate per adapter across calls until its optimizer step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lorafleet.adapters.checkpoint import OPTIMIZER_MOMENTS, TrainingState, read_training_state
from lorafleet.adapters.hparams import OPTIMIZERS, DimuonHParams, OptimHParams
from lorafleet.adapters.peft_io import export_peft, import_peft
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec, BankSet
from lorafleet.model.memory import (
    DeviceOutOfMemory,
    is_out_of_memory,
    out_of_memory_message,
    release_cached,
)
from lorafleet.model.routing import Routing
from lorafleet.train.canary_probe import trainer_canary_logprobs
from lorafleet.train.checkpointing import (
    BankOptimizer,
    apply_training_state,
    read_slot_state,
    save_training_state,
    write_slot_state,
)
from lorafleet.train.dimuon import BankDimuon
from lorafleet.train.items import ItemLimits, PreparedItem, TrainInputError, TrainItem
from lorafleet.train.layout import Layout, Unit, build_layout, plan_units, singles
from lorafleet.train.loss_inputs import loss_targets
from lorafleet.train.losses import compute_loss, gradient_mask, merge_metrics
from lorafleet.train.optim import AdamHParams, BankAdamW
from lorafleet.train.prefix_trie import plan_sharing
from lorafleet.train.recompute import set_recompute
from lorafleet.train.slot_state import SlotState, host_copy

DEFAULT_TOKEN_BUDGET = 4096

SPLIT_HEAD_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "qwen3_moe"})
"""Families whose logits are exactly `lm_head(model.model(...).last_hidden_state)` (the ones we
ship presets for). Only these run shared prefixes and a partial head; see `_decoder_and_head`."""


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
    tokens_run: int = 0  # padded tokens through the model (a shared prefix counts once)


class TrainEngine:
    """Mixed-adapter forward/backward and a per-adapter optimizer over one bank set.

    Each adapter's optimizer family (AdamW or Dimuon) is fixed when it is created, as in
    Tinker; the Dimuon state (one momentum row per slot) is only allocated once an adapter
    asks for it."""

    def __init__(
        self,
        adapted: AdaptedModel,
        *,
        bank: str = "train",
        base_model_id: str,
        token_budget: int = DEFAULT_TOKEN_BUDGET,
        with_optimizer: bool = True,
        share_prefixes: bool = True,
        head_grad_where_needed: bool = True,
        recompute: bool = False,
    ):
        """`share_prefixes` and `head_grad_where_needed` (both exact, on by default) exist to
        measure the plain path against them (bench/train_prefix.py). `recompute`: activation
        recompute per decoder layer (recompute.py; exact, less memory, one more forward; it
        turns prefix sharing off)."""
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        self.adapted = adapted
        self.bank: BankSet = adapted.bank(bank)
        self.base_model_id = base_model_id
        self.token_budget = token_budget
        model: Any = adapted.model  # an HF causal LM; nn.Module types its accessors as Tensor
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.max_length = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        self.device = self.bank.params.device
        # Decided once for the model: (decoder, head), or None for the plain path.
        self.split = _decoder_and_head(model)
        self.recompute = recompute
        if recompute:
            set_recompute(model, adapted.scope, True)
        self.share_prefixes = share_prefixes and self.split is not None and not recompute
        self.head_grad_where_needed = head_grad_where_needed
        self.optimizer: BankAdamW | None = None
        if with_optimizer:
            if self.bank.grads is None:  # not `trainable`
                raise ValueError(f"bank {bank!r} is inference-only; create it with trainable=True")
            self.optimizer = BankAdamW(self.bank.params, self.bank.grads)
        self.dimuon: BankDimuon | None = None
        self.families: dict[int, str] = {}  # slot -> its optimizer family (absent: adamw)
        self.hparams: dict[int, OptimHParams] = {}
        # Sharded (FSDP) training: each rank runs its share of a micro-batch, and every rank must
        # take the same branch (backward, or raise) or the others wait forever in a collective
        # (a sharded base also keeps the plain path, one forward per micro-batch on every rank).
        # Given "this rank's losses are finite", it returns whether all ranks' are (lorafleet.distributed).
        self.all_ranks_ok: Callable[[bool], bool] | None = None

    @property
    def pager(self) -> TrainEngine:
        """Its slots are a cache: `export_slot`/`import_slot` move a run out and back bit for
        bit (`interfaces.Trainer.pager`)."""
        return self

    # ---------------------------------------------------------------- adapters
    def create_adapter(
        self, spec: AdapterSpec, slot: int | None = None, *, optimizer: str = "adamw"
    ) -> int:
        bank_optimizer = self._family_optimizer(optimizer)  # refuses before claiming a slot
        slot = self.bank.allocate(spec, slot)
        if bank_optimizer is not None:
            bank_optimizer.reset_slot(slot)
        self.families[slot] = optimizer
        return slot

    def free_adapter(self, slot: int) -> None:
        self.bank.free(slot)
        for bank_optimizer in (self.optimizer, self.dimuon):
            if bank_optimizer is not None:
                bank_optimizer.reset_slot(slot)
        self.hparams.pop(slot, None)
        self.families.pop(slot, None)

    def export_slot(self, slot: int) -> SlotState:
        """The adapter in `slot` with everything it carries (weights, optimizer moments and
        step, hyper-parameters, a pending gradient) as host copies; the slot is untouched (the
        caller frees it). `import_slot` puts it back bit for bit."""
        info = self.bank.check_slot(slot)
        family = self.families.get(slot, "adamw")
        bank_optimizer = self._family_optimizer(family)
        if bank_optimizer is None:
            raise ValueError("this engine has no optimizer (inference only); nothing to page")
        state = bank_optimizer.slot_state(slot)
        grads = self.bank.grads
        assert grads is not None  # an engine with an optimizer has a trainable bank
        pending = bank_optimizer.has_pending_gradient(slot)
        grad_row = host_copy(grads[slot]) if pending or bool(grads[slot].any()) else None
        return SlotState(
            spec=info.spec,
            optimizer=family,
            params=host_copy(self.bank.params[slot]),
            moments={name: host_copy(state[name]) for name in OPTIMIZER_MOMENTS[family]},
            step=int(state["step"]),
            pending=pending,
            grads=grad_row,
            hparams=self.hparams.get(slot),
        )

    def import_slot(self, state: SlotState, slot: int | None = None) -> int:
        """Puts an exported adapter into a free slot (any, or `slot`) exactly as it was; returns
        the slot. The rows' shapes are checked before a slot is claimed; a state refused after
        that (non-finite moments, say) frees it again."""
        bank_optimizer = self._family_optimizer(state.optimizer)
        if bank_optimizer is None:
            raise ValueError("this engine has no optimizer (inference only); nothing to page")
        rows = {"params": state.params, **state.moments}
        if state.grads is not None:
            rows["grads"] = state.grads
        for name, row in rows.items():
            if row.dtype != torch.float32 or tuple(row.shape) != (self.bank.row_size,):
                raise ValueError(
                    f"slot state {name!r} must be float32 ({self.bank.row_size},), got "
                    f"{row.dtype} {tuple(row.shape)}"
                )
        if sorted(state.moments) != sorted(OPTIMIZER_MOMENTS[state.optimizer]):
            raise ValueError(
                f"{state.optimizer} slot state needs moments {list(OPTIMIZER_MOMENTS[state.optimizer])}, "
                f"got {sorted(state.moments)}"
            )
        slot = self.bank.allocate(state.spec, slot, initialize=False)
        grads = self.bank.grads
        assert grads is not None
        try:
            with torch.no_grad():
                self.bank.params[slot].copy_(state.params)
                bank_optimizer.reset_slot(slot)
                bank_optimizer.load_slot_state(
                    slot,
                    {
                        **state.moments,
                        "step": torch.tensor(state.step, dtype=torch.int64),
                    },
                )
                if state.grads is not None:
                    grads[slot].copy_(state.grads)
            if state.pending:
                bank_optimizer.note_gradient([slot])
        except BaseException:
            bank_optimizer.reset_slot(slot)
            self.bank.free(slot)
            raise
        self.families[slot] = state.optimizer
        if state.hparams is not None:
            self.hparams[slot] = state.hparams
        return slot

    def write_slot(self, state: SlotState, dest: str | Path) -> int:
        """Writes an exported slot to the directory `dest` (atomically, in the checkpoint
        format plus its pending gradient); returns the bytes written."""
        return write_slot_state(dest, state, bank=self.bank, base_model_id=self.base_model_id)

    def read_slot(self, src: str | Path) -> SlotState:
        """Reads what `write_slot` wrote, for `import_slot`."""
        return read_slot_state(src, bank=self.bank, base_model_id=self.base_model_id)

    def optimizer_family(self, slot: int) -> str:
        """The optimizer family (`adapters.hparams.OPTIMIZERS`) the adapter in `slot` uses."""
        self.bank.check_slot(slot)
        return self.families.get(slot, "adamw")

    def _family_optimizer(self, family: str) -> BankOptimizer | None:
        """The bank optimizer of `family` (created on first use), None for an inference-only
        engine; ValueError for an unknown family."""
        if family not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {family!r}; known: {', '.join(OPTIMIZERS)}")
        if self.optimizer is None or family == "adamw":
            return self.optimizer
        if self.dimuon is None:
            self.dimuon = BankDimuon(self.optimizer.params, self.optimizer.grads, self._matrices)
        return self.dimuon

    def _matrices(self, slot: int, row: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
        info = self.bank.check_slot(slot)
        views = self.bank.split_row(row, info.spec.rank, info.targets)
        return info.spec.rank, [m for pair in views.values() for m in pair]

    # ---------------------------------------------------------------- validation
    def prepare(
        self, items: Sequence[TrainItem], *, allow_base: bool = False
    ) -> list[PreparedItem]:
        """Validates every item before anything runs (see `ItemLimits.prepare`)."""
        return self._item_limits().prepare(items, allow_base=allow_base)

    def _item_limits(self) -> ItemLimits:
        return ItemLimits(self.bank, self.vocab_size, self.max_length)

    # ---------------------------------------------------------------- compute
    def forward(self, items: Sequence[TrainItem] | Sequence[PreparedItem]) -> BatchOutput:
        """Log-probs and loss metrics without touching gradients; slot 0 scores the base model."""
        prepared = self._ensure_prepared(items, allow_base=True)
        with torch.no_grad():
            return self._run(prepared, backward=False)

    def canary_logprobs(self, slot: int | None, tokens: Sequence[int]) -> torch.Tensor:
        """The trainer's side of the canary (see `trainer_canary_logprobs`); None = base."""
        return trainer_canary_logprobs(self, slot, tokens)

    def forward_backward(self, items: Sequence[TrainItem] | Sequence[PreparedItem]) -> BatchOutput:
        """Accumulates each item's loss gradient into its adapter's gradient row."""
        if not self.bank.trainable:
            raise ValueError(f"bank {self.bank.name!r} is inference-only")
        prepared = self._ensure_prepared(items)
        return self._run(prepared, backward=True)

    def _ensure_prepared(
        self, items: Sequence[TrainItem] | Sequence[PreparedItem], *, allow_base: bool = False
    ) -> list[PreparedItem]:
        return self._item_limits().ensure_prepared(items, allow_base=allow_base)

    def _run(self, prepared: list[PreparedItem], *, backward: bool) -> BatchOutput:
        outputs: dict[int, ItemOutput] = {}
        slots, tokens = [p.slot for p in prepared], [p.tokens for p in prepared]
        lengths = [p.length for p in prepared]
        units = plan_sharing(slots, tokens) if self.share_prefixes else singles(len(prepared))
        batches = plan_units(units, lengths, self.token_budget)
        # Each micro-batch checks its losses before its backward; if a later one fails, the
        # gradients earlier ones already added are rolled back, so the call is all or nothing.
        # On an accelerator the one micro-batch of a call is guarded too: running out of
        # memory in the middle of its backward leaves part of the gradient added (on the CPU
        # the only failure there, a non-finite loss, is caught before the backward).
        snapshot = None
        grads = self.bank.grads  # None only for an inference-only bank, which never runs backward
        if backward and grads is not None and (len(batches) > 1 or self.device.type != "cpu"):
            # (the index made now: putting the rows back must not need device memory then)
            used = torch.tensor(sorted(set(slots)), dtype=torch.int64, device=grads.device)
            snapshot = (grads, used, grads.index_select(0, used))
        tokens_run = 0
        oom: str | None = None
        try:
            for batch in batches:
                layout = build_layout(slots, tokens, batch)
                outputs.update(self._run_microbatch(prepared, batch, layout, backward=backward))
                tokens_run += layout.tokens_run
        except Exception as exc:
            if snapshot is not None:
                bank_grads, used, saved = snapshot
                with torch.no_grad():
                    bank_grads.index_copy_(0, used, saved)
            if not is_out_of_memory(exc):
                raise
            total = sum(lengths)
            oom = out_of_memory_message(
                self.device,
                f"running {'forward_backward' if backward else 'forward'} over {len(prepared)} "
                f"datums ({total} tokens, micro-batches of at most {self.token_budget} tokens)",
                exc,
                "Send fewer tokens per call, or lower the trainer's token budget.",
            )
        if oom is not None:
            # Out of the except block: the failed micro-batch's tensors (held by the
            # exception's frames) are gone, so the allocator's cached blocks can be returned.
            outputs.clear()
            snapshot = None
            release_cached(self.device)
            raise DeviceOutOfMemory(oom)
        distinct = tuple(sorted(set(slots)))
        if backward and self.optimizer is not None:
            self.optimizer.note_gradient(s for s in distinct if self.families.get(s) != "dimuon")
            if self.dimuon is not None:
                self.dimuon.note_gradient(s for s in distinct if self.families.get(s) == "dimuon")
        finished = [outputs[i] for i in range(len(prepared))]
        return BatchOutput(
            items=finished,
            num_microbatches=len(batches),
            slots=distinct,
            metrics=merge_metrics(o.metrics for o in finished),
            tokens_run=tokens_run,
        )

    def _run_microbatch(
        self, prepared: list[PreparedItem], units: list[Unit], layout: Layout, *, backward: bool
    ) -> dict[int, ItemOutput]:
        indices = [i for unit in units for i in unit.members]  # riders too
        # Prepared (validated) on the CPU, where a sharded trainer's driver also prepares;
        # the loss terms are computed where the log-probs are.
        specs = {i: prepared[i].loss.to(self.device) for i in indices}
        targets = [loss_targets(specs[i]) for i in indices]
        # One entry per (item, position, target): the hidden row it reads and its target id.
        rows = torch.cat(
            [
                layout.positions[i].repeat_interleave(t.numel() // t.shape[0])
                for i, t in zip(indices, targets, strict=True)
            ]
        )
        flat_targets = torch.cat([t.reshape(-1) for t in targets])
        if backward and self.head_grad_where_needed:
            wanted = torch.cat([gradient_mask(specs[i]).reshape(-1) for i in indices])
            # Backward runs even when no term has a gradient (it adds exact zeros): a sharded
            # rank must join the other ranks' backward collectives.
            wanted[0] = True
        else:
            wanted = torch.full_like(flat_targets, backward, dtype=torch.bool)
        features = self._features(layout)
        logprobs = self._target_logprobs(
            features,
            layout.hidden_slots.to(self.device),
            rows.to(self.device),
            flat_targets.to(self.device),
            wanted.to(self.device),
        )
        losses: list[torch.Tensor] = []
        outputs: dict[int, ItemOutput] = {}
        failure: TrainInputError | None = None
        for index, item_targets, item_logprobs in zip(
            indices, targets, logprobs.split([t.numel() for t in targets]), strict=True
        ):
            item = prepared[index]
            item_logprobs = item_logprobs.reshape(item_targets.shape)
            loss, metrics = compute_loss(specs[index], item_logprobs)
            if failure is None and not math.isfinite(metrics["loss:sum"]):
                failure = TrainInputError(
                    f"loss of a {item.loss.name} datum for slot {item.slot} is {metrics['loss:sum']} "
                    "(log-ratio overflow?); nothing was applied"
                )
            losses.append(loss)
            outputs[index] = ItemOutput(
                logprobs=item_logprobs.detach().float().cpu(), metrics=metrics
            )
        if (
            self.all_ranks_ok is not None
            and not self.all_ranks_ok(failure is None)
            and failure is None
        ):
            failure = TrainInputError(
                "a datum on another rank of this batch has a non-finite loss; nothing was applied"
            )
        if failure is not None:
            raise failure
        if backward:
            torch.stack(losses).sum().backward()
        return outputs

    def _routing(self, slot_ids: torch.Tensor) -> contextlib.AbstractContextManager[Routing]:
        return self.adapted.routing(self.bank.name, slot_ids.to(self.device))

    def _features(self, layout: Layout) -> torch.Tensor:
        """[hidden rows, hidden]: final hidden states at every real position of the layout (on
        the plain path, the logits there). Padding sits after each row's real tokens, so under
        causal attention (and the explicit masks of the second forward) it influences no real
        token and its LoRA gradient is exactly zero."""
        first, second = layout.first, layout.second
        if self.split is None:
            with self._routing(first.slot_ids):
                logits = self.adapted.model(
                    input_ids=first.input_ids.to(self.device),
                    attention_mask=first.attention_mask.to(self.device),
                ).logits
            return logits[first.real.to(self.device)]
        decoder, _ = self.split
        with self._routing(first.slot_ids):
            out = decoder(
                input_ids=first.input_ids.to(self.device),
                attention_mask=first.attention_mask.to(self.device),
                use_cache=second is not None,
            )
        hidden = [out.last_hidden_state[first.real.to(self.device)]]
        if second is not None:
            # Each member row extends its group's prefix cache: row selection is an indexing op,
            # so the members' gradients flow back into the one prefix forward.
            cache = out.cache
            cache.batch_select_indices(second.cache_rows.to(self.device))
            with self._routing(second.slot_ids):
                out = decoder(
                    input_ids=second.input_ids.to(self.device),
                    attention_mask=second.attention_mask.to(self.device),
                    position_ids=second.position_ids.to(self.device),
                    cache=cache,
                    use_cache=True,
                )
            hidden.append(out.last_hidden_state[second.real.to(self.device)])
        return torch.cat(hidden)

    def _target_logprobs(
        self,
        features: torch.Tensor,
        slots: torch.Tensor,
        rows: torch.Tensor,
        targets: torch.Tensor,
        wanted: torch.Tensor,
    ) -> torch.Tensor:
        """float32 [entries]: log-prob of `targets[e]` at hidden row `rows[e]`.

        The head and the fp32 log-softmax run with autograd only on rows that a `wanted` entry
        reads; the other rows (prompt positions of RL data) get theirs under no_grad, since no
        loss term there has a gradient. One log-softmax and one gather per part: per-row
        slicing would make autograd zero-fill a full-size logits gradient for every row.
        """
        hot = torch.zeros(features.shape[0], dtype=torch.bool, device=features.device)
        hot[rows[wanted]] = True
        values = torch.empty(rows.shape, dtype=torch.float32, device=features.device)
        for part, grad in ((hot, True), (~hot, False)):
            if not bool(part.any()):
                continue
            with contextlib.nullcontext() if grad else torch.no_grad():
                logprobs = self._head_logprobs(features[part], slots[part])
            local = torch.cumsum(part, 0) - 1  # hidden row -> its row within the part
            entries = part[rows]
            values[entries] = logprobs[local[rows[entries]], targets[entries]]
        return values

    def _head_logprobs(self, features: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if self.split is None:
            logits = features
        else:
            with self._routing(slots):  # the head may carry LoRA (train_unembed)
                logits = self.split[1](features)
        return torch.log_softmax(logits.float(), dim=-1)

    # ---------------------------------------------------------------- optimizer
    def optim_step(self, hparams: Mapping[int, OptimHParams]) -> dict[int, dict[str, float]]:
        """One call per optimizer family for every slot in `hparams` (each with its own
        hyper-parameters, of the family the slot was created with). Everything is checked
        before either family steps, so a refused call moves nothing."""
        if self.optimizer is None:
            raise ValueError("this engine has no optimizer (inference only)")
        adam: dict[int, AdamHParams] = {}
        dimuon: dict[int, DimuonHParams] = {}
        for slot, hp in hparams.items():
            self.bank.check_slot(slot)
            family = self.families.get(slot, "adamw")
            if family == "dimuon" and isinstance(hp, DimuonHParams):
                dimuon[slot] = hp
            elif family == "adamw" and isinstance(hp, AdamHParams):
                adam[slot] = hp
            else:
                raise ValueError(
                    f"the adapter in slot {slot} uses the {family} optimizer, fixed when it was "
                    f"created; its optim_step got {type(hp).__name__} (send "
                    f"{'DimuonParams' if family == 'dimuon' else 'AdamParams'})"
                )
            try:
                hp.validate()
            except ValueError as exc:
                raise ValueError(f"slot {slot}: {exc}") from None
        metrics = self.optimizer.step(adam) if adam else {}
        if dimuon:
            metrics.update(self._dimuon().step(dimuon))
        self.hparams.update(hparams)
        return metrics

    def _dimuon(self) -> BankDimuon:
        dimuon = self._family_optimizer("dimuon")
        assert isinstance(dimuon, BankDimuon)
        return dimuon

    # ---------------------------------------------------------------- state files
    def save_state(
        self, slot: int, dest: str | Path, *, metadata: dict | None = None, overwrite: bool = False
    ) -> Path:
        return save_training_state(
            Path(dest),
            bank=self.bank,
            slot=slot,
            optimizer=self._family_optimizer(self.families.get(slot, "adamw")),
            base_model_id=self.base_model_id,
            hparams=self.hparams.get(slot),
            metadata=metadata,
            overwrite=overwrite,
        )

    def load_state(
        self,
        src: str | Path | TrainingState,
        *,
        slot: int | None = None,
        with_optimizer: bool = True,
        source: str | Path | None = None,
        optimizer: str | None = None,
    ) -> int:
        """Restores a training checkpoint (a directory, or one already read with
        `read_training_state`, then `source` names it in errors) into a slot.

        `optimizer` is the restored adapter's optimizer family; None takes the checkpoint's
        (the family it was trained with). Restoring optimizer state of another family than
        `optimizer` is refused (CheckpointError)."""
        if isinstance(src, TrainingState):
            state, where = src, Path(source or "<checkpoint>")
        else:
            state, where = read_training_state(Path(src)), Path(src)
        family = state.optimizer if optimizer is None else optimizer
        slot = apply_training_state(
            state,
            where,
            bank=self.bank,
            optimizer=self._family_optimizer(family),
            base_model_id=self.base_model_id,
            slot=slot,
            load_optimizer=with_optimizer,
        )
        self.families[slot] = family
        if state.hparams is not None and state.optimizer == family:
            self.hparams[slot] = state.hparams
        return slot

    def export_peft(self, slot: int, dest: str | Path, *, overwrite: bool = False) -> Path:
        return export_peft(
            self.bank,
            slot,
            Path(dest),
            base_model_name_or_path=self.base_model_id,
            overwrite=overwrite,
        )

    def import_peft(self, src: str | Path, *, slot: int | None = None, seed: int = 0) -> int:
        slot = import_peft(self.bank, Path(src), slot=slot, seed=seed)
        if self.optimizer is not None:
            self.optimizer.reset_slot(slot)
        self.families[slot] = "adamw"
        return slot


def _decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """The decoder (final hidden states and KV cache) and the head, if logits are exactly
    head(decoder(...)) and a group's prefix cache can serve its members; else None, and the
    engine keeps the plain path (one forward of the whole model, logits at every position):

    - a family outside SPLIT_HEAD_MODEL_TYPES may scale, cap or mix its logits after the head;
    - a layer that is not full attention (sliding window) would drop cached prefix positions;
    - an FSDP-sharded base gathers the head's weights only inside the root module's forward, and
      every rank must run the same forwards (a rank's rows may share a prefix, another's not).
    """
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in SPLIT_HEAD_MODEL_TYPES:
        return None
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return None
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            return None
    causal_lm: Any = model  # an HF causal LM; nn.Module types its accessors as Tensor
    decoder, head = causal_lm.get_decoder(), causal_lm.get_output_embeddings()
    if not isinstance(decoder, nn.Module) or not isinstance(head, nn.Module):
        return None
    return decoder, head
