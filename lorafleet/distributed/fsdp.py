"""FSDP2 over the frozen base, adapter banks inside, and one rank's part of the trainer.

Layout on every rank (see docs/deploy.md for why):
- the base model is sharded with `torch.distributed.fsdp.fully_shard`, one FSDP unit per
  decoder layer plus the root (embeddings, final norm, head), under a `MixedPrecisionPolicy`
  (compute dtype of the base, fp32 reduce). Nothing of the base is trainable, so FSDP only ever
  all-gathers it, one layer at a time, and never reduces anything for it;
- adapter *parameters and gradients* are replicated: the banks are not module parameters, so
  FSDP does not see them, every LoRA layer finds its full A/B on every rank, and the forward
  needs no bank communication. Gradients are summed across ranks (fp32) only when a slot steps;
- adapter *optimizer state* is sharded by slot (ZeRO-1): rank r owns a contiguous range of
  slots and runs `BankAdamW` over exactly those rows, so AdamW moments cost 2/world of the
  bank per rank, and a slot's grad-norm clipping sees its whole row on one rank, as in a single
  process. After a step the owner broadcasts the updated rows.

Data parallelism: a batch is cut into the single-process engine's micro-batches (same token
budget), and the rows of each micro-batch are dealt to the ranks by tokens. Every rank runs one
forward/backward per micro-batch, a zero-weight filler row when it got none, because FSDP's
all-gathers are collectives that all ranks must enter in the same order. Each slot's gradient
is therefore the sum of its items' gradients, exactly what one process computes (up to the
order of fp32 additions).

Every public method of `ShardedTrainer` is collective unless its docstring says rank-0 only:
all ranks call it with the same arguments, in the same order.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lorafleet.adapters.checkpoint import (
    MOMENTS,
    CheckpointError,
    LayerTensors,
    TrainingState,
    apply_weights,
)
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec, SlotInfo
from lorafleet.model.routing import BASE_SLOT
from lorafleet.train.engine import BatchOutput, ItemOutput, TrainEngine
from lorafleet.train.items import PreparedItem, TrainInputError, TrainItem
from lorafleet.train.layout import plan_microbatches
from lorafleet.train.losses import merge_metrics
from lorafleet.train.optim import AdamHParams, BankAdamW

# The LoRA wrapper returns `out.view_as(...)`, so the root module's logits are a view; FSDP warns
# about in-place ops on it, which the engine never does (it reads logits out of place).
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


class DistError(RuntimeError):
    """The ranks of a sharded trainer disagree, or one of them failed outside a user error."""


@dataclass(frozen=True)
class ShardingConfig:
    """How the base is sharded. `param_dtype` is what the base computes in (FSDP casts its
    shards to it on all-gather); the base is loaded in it too, so a bf16 base is stored as bf16
    shards. Bank gradients are always fp32 and reduced in fp32."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    reshard_after_forward: bool = True


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF causal LM, one FSDP unit each."""
    causal_lm: Any = model  # an HF causal LM; nn.Module types its accessors as Tensor
    decoder = causal_lm.get_decoder() if hasattr(causal_lm, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"{type(model).__name__}: no decoder layers found (expected model.get_decoder().layers)"
        )
    return list(layers)


def shard_base(model: nn.Module, mesh: Any, config: ShardingConfig) -> int:
    """Shards the (already adapter-wrapped) base in place; returns the number of FSDP units.

    Must run after `AdaptedModel` wraps the linears (so FSDP shards the wrapped base layers)
    and before banks are added (they live on the mesh's device, outside FSDP).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(
            layer, mesh=mesh, mp_policy=policy, reshard_after_forward=config.reshard_after_forward
        )
    fully_shard(
        model, mesh=mesh, mp_policy=policy, reshard_after_forward=config.reshard_after_forward
    )
    return len(layers) + 1


def owned_slots(num_slots: int, world: int, rank: int) -> range:
    """The contiguous adapter slots (1..num_slots-1) whose optimizer state `rank` holds."""
    adapters = num_slots - 1
    per_rank = -(-adapters // world)
    start = 1 + rank * per_rank
    return range(min(start, num_slots), min(start + per_rank, num_slots))


def slot_owner(slot: int, num_slots: int, world: int) -> int:
    per_rank = -(-(num_slots - 1) // world)
    return (slot - 1) // per_rank


def deal_rows(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Positions of one micro-batch's rows per rank, balanced by tokens (longest first, to the
    least loaded rank, ties to the lower rank): deterministic, so every rank computes the same."""
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for position in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min(range(world), key=lambda r: (load[r], r))
        shares[target].append(position)
        load[target] += lengths[position]
    return [sorted(share) for share in shares]


@dataclass
class SlotParts:
    """One adapter's training state in layout-free form, as gathered on rank 0."""

    spec: AdapterSpec  # targets resolved
    weights: LayerTensors
    moments: dict[str, LayerTensors] | None
    step: int | None


class ShardedTrainer:
    """One rank's trainer over an FSDP-sharded base (see the module docstring)."""

    def __init__(
        self,
        adapted: AdaptedModel,
        *,
        base_model_id: str,
        bank: str = "train",
        token_budget: int = 4096,
        cpu_group: Any = None,
    ):
        if not dist.is_initialized():
            raise DistError("torch.distributed is not initialised; call init_process_group first")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # gloo group for flags and Python objects (None: the default group, gloo on CPU)
        self.cpu_group = cpu_group
        self.engine = TrainEngine(
            adapted,
            bank=bank,
            base_model_id=base_model_id,
            token_budget=token_budget,
            with_optimizer=False,
        )
        self.engine.all_ranks_ok = self.all_ok
        self.bank = self.engine.bank
        self.base_model_id = base_model_id
        self.owned = owned_slots(self.bank.num_slots, self.world, self.rank)
        self.optimizer: BankAdamW | None = None
        # BankAdamW reserves its row 0 (slot 0): give it the row before ours
        self._first_row = self.owned.start - 1
        if len(self.owned):
            rows = slice(self._first_row, self.owned.stop)
            assert self.bank.grads is not None
            self.optimizer = BankAdamW(self.bank.params[rows], self.bank.grads[rows])
        self.pending: set[int] = set()
        self.hparams: dict[int, AdamHParams] = {}

    # ------------------------------------------------------------------ helpers
    def owner(self, slot: int) -> int:
        return slot_owner(slot, self.bank.num_slots, self.world)

    def _local(self, slot: int) -> int:
        return slot - self._first_row

    def all_ok(self, ok: bool) -> bool:
        """True on every rank iff `ok` is true on every rank (one tiny all-reduce)."""
        if self.world == 1:
            return ok
        flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
        dist.all_reduce(flag, group=self.cpu_group)
        return int(flag.item()) == 0

    def _agreed(self, action, undo=None):
        """Runs `action` on every rank; if it fails anywhere, `undo` runs where it succeeded and
        every rank raises (its own error, or a DistError naming the failure elsewhere)."""
        error: BaseException | None = None
        result = None
        try:
            result = action()
        except (ValueError, LookupError) as exc:  # user errors: bad slot, spec, checkpoint
            error = exc
        if not self.all_ok(error is None):
            if error is None:
                if undo is not None:
                    undo(result)
                raise DistError("the operation failed on another rank; it was undone here")
            raise error
        return result

    def _gather_to_zero(self, obj: Any) -> list[Any] | None:
        if self.world == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.cpu_group)
        return out

    # ------------------------------------------------------------------ adapters
    def create_adapter(self, spec: AdapterSpec, slot: int) -> int:
        """Every rank initialises the slot from the spec's seed with the layer's full fan-in
        (banks are whole on every rank), so the replicas agree bit for bit with no broadcast."""

        def undo(_: Any) -> None:
            self.bank.free(slot)

        self._agreed(lambda: self.bank.allocate(spec, slot), undo)
        self._reset(slot)
        return slot

    def free_adapter(self, slot: int) -> None:
        self._agreed(lambda: self.bank.free(slot))
        self._reset(slot)
        self.hparams.pop(slot, None)

    def _reset(self, slot: int) -> None:
        self.pending.discard(slot)
        if slot in self.owned and self.optimizer is not None:
            self.optimizer.reset_slot(self._local(slot))

    def import_weights(
        self, spec: AdapterSpec, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]], slot: int
    ) -> int:
        def load() -> int:
            allocated = self.bank.allocate(spec, slot, initialize=False)
            try:
                self.bank.load_slot_weights(allocated, weights)
            except BaseException:
                self.bank.free(allocated)
                raise
            return allocated

        self._agreed(load, lambda _: self.bank.free(slot))
        self._reset(slot)
        return slot

    # ------------------------------------------------------------------ compute
    def _filler(self, slot: int) -> PreparedItem:
        """A one-token row with zero loss weight: it runs the FSDP collectives of a micro-batch
        on a rank that got no rows, and adds exactly zero to `slot`'s gradient."""
        item = TrainItem(
            slot,
            [0],
            "cross_entropy",
            {"target_tokens": torch.zeros(1, dtype=torch.int64), "weights": torch.zeros(1)},
        )
        return self.engine.prepare([item], allow_base=slot == BASE_SLOT)[0]

    def run(self, items: Sequence[PreparedItem], *, backward: bool) -> BatchOutput | None:
        """forward (backward=False) or forward_backward over the whole batch; every rank gets
        the same items and runs its share. Returns the engine's BatchOutput on rank 0."""
        for item in items:
            if backward or item.slot != BASE_SLOT:  # slot 0 (the base) may be scored, not trained
                self.bank.check_slot(item.slot)
        items = list(items)
        plan = plan_microbatches([p.length for p in items], self.engine.token_budget)
        slots = sorted({p.slot for p in items})
        snapshot = None
        if backward and len(plan) > 1:
            assert self.bank.grads is not None
            snapshot = self.bank.grads[slots].clone()
        mine: list[tuple[int, ItemOutput]] = []
        try:
            for micro in plan:
                share = deal_rows([items[i].length for i in micro], self.world)[self.rank]
                indices = [micro[j] for j in share]
                batch = [items[i] for i in indices] or [self._filler(items[micro[0]].slot)]
                out = (
                    self.engine.forward_backward(batch) if backward else self.engine.forward(batch)
                )
                if indices:
                    mine.extend(zip(indices, out.items, strict=True))
        except TrainInputError:
            if snapshot is not None:
                assert self.bank.grads is not None
                with torch.no_grad():
                    self.bank.grads[slots] = snapshot
            raise
        if backward:
            self.pending.update(slots)
        gathered = self._gather_to_zero(mine)
        if gathered is None:
            return None
        outputs: list[ItemOutput | None] = [None] * len(items)
        for part in gathered:
            for index, output in part:
                outputs[index] = output
        if any(o is None for o in outputs):
            raise DistError("an item's output came back from no rank")
        finished = [o for o in outputs if o is not None]
        return BatchOutput(
            items=finished,
            num_microbatches=len(plan),
            slots=tuple(slots),
            metrics=merge_metrics(o.metrics for o in finished),
        )

    # ------------------------------------------------------------------ optimizer
    def optim_step(self, hparams: Mapping[int, AdamHParams]) -> dict[int, dict[str, float]] | None:
        """One AdamW step for the requested slots: their gradient rows are summed across ranks,
        each owner steps its rows with BankAdamW, then broadcasts them. Metrics on rank 0."""
        for slot, hp in hparams.items():
            self.bank.check_slot(slot)
            if not isinstance(hp, AdamHParams):
                raise ValueError(
                    f"hyper-parameters for slot {slot} must be AdamHParams, got {type(hp).__name__}"
                )
            try:
                hp.validate()
            except ValueError as exc:
                raise ValueError(f"slot {slot}: {exc}") from None
        active = sorted(s for s in hparams if s in self.pending)
        grads = self.bank.grads
        assert grads is not None
        if active and self.world > 1:
            summed = grads[active]  # a copy: one all-reduce for every stepping slot
            dist.all_reduce(summed)
            with torch.no_grad():
                grads[active] = summed
        metrics: dict[int, dict[str, float]] = {}
        mine = {s: hp for s, hp in hparams.items() if s in self.owned}
        if mine:
            assert self.optimizer is not None
            self.optimizer.note_gradient([self._local(s) for s in active if s in self.owned])
            local = self.optimizer.step({self._local(s): hp for s, hp in mine.items()})
            metrics = {s: local[self._local(s)] for s in mine}
        with torch.no_grad():
            for slot in active:
                if slot not in self.owned:
                    grads[slot].zero_()  # consumed by the owner's step
        if self.world > 1:
            for slot in active:
                dist.broadcast(self.bank.params[slot], src=self.owner(slot))
        self.pending.difference_update(active)
        self.hparams.update(hparams)
        gathered = self._gather_to_zero(metrics)
        if gathered is None:
            return None
        merged: dict[int, dict[str, float]] = {}
        for part in gathered:
            merged.update(part)
        return {s: merged[s] for s in hparams}

    # ------------------------------------------------------------------ state out
    def slot_weights(
        self, slot: int
    ) -> tuple[AdapterSpec, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Rank-local (any rank): the adapter's per-layer A/B on the CPU. Parameters are
        replicated, so this reads the local bank layer by layer and touches nothing of the base."""
        info = self.bank.check_slot(slot)
        views = self.bank.split_row(self.bank.params[slot].detach(), info.spec.rank, info.targets)
        return info.spec, {
            path: (A.to("cpu", copy=True), B.to("cpu", copy=True)) for path, (A, B) in views.items()
        }

    def slot_row(self, slot: int) -> tuple[SlotInfo, torch.Tensor]:
        """Rank-local: the slot's flat bank row (for a sampler bank with the same layout)."""
        info = self.bank.check_slot(slot)
        return info, self.bank.params[slot].detach().to("cpu", copy=True)

    def gather_state(self, slot: int) -> SlotParts | None:
        """Collective: weights (local on rank 0) and AdamW moments + step, which the slot's owner
        sends to rank 0 one layer at a time: one message per layer holding that layer's four
        moment matrices, read straight from the optimizer's rows, so the extra memory on the
        sender is one layer's worth. Only this adapter's tensors move; the base is never
        gathered. Returns the parts on rank 0."""
        info = self.bank.check_slot(slot)
        spec, rank, targets = info.spec, info.spec.rank, info.targets
        owner = self.owner(slot)
        if self.rank not in (0, owner):
            return None
        device = self.bank.params.device
        if self.rank == owner:
            assert self.optimizer is not None
            local = self._local(slot)
            step = int(self.optimizer.step_count[local])
            rows = {
                "exp_avg": self.bank.split_row(self.optimizer.exp_avg[local], rank, targets),
                "exp_avg_sq": self.bank.split_row(self.optimizer.exp_avg_sq[local], rank, targets),
            }
            if owner == 0:
                moments = {
                    name: {
                        path: (A.to("cpu", copy=True), B.to("cpu", copy=True))
                        for path, (A, B) in rows[name].items()
                    }
                    for name in MOMENTS
                }
                return SlotParts(
                    spec=spec, weights=self.slot_weights(slot)[1], moments=moments, step=step
                )
            dist.send(torch.tensor([step], dtype=torch.int64, device=device), dst=0)
            for path in targets:
                parts = [t.reshape(-1) for name in MOMENTS for t in rows[name][path]]
                dist.send(torch.cat(parts), dst=0)
            return None
        # rank 0, the state living on another rank: receive it layer by layer
        weights = self.slot_weights(slot)[1]
        step_buf = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(step_buf, src=owner)
        received: dict[str, LayerTensors] = {name: {} for name in MOMENTS}
        for path, (A, B) in weights.items():
            buffer = torch.empty(2 * (A.numel() + B.numel()), dtype=torch.float32, device=device)
            dist.recv(buffer, src=owner)
            pieces = buffer.cpu().split([A.numel(), B.numel(), A.numel(), B.numel()])
            received["exp_avg"][path] = (
                pieces[0].view(A.shape).clone(),
                pieces[1].view(B.shape).clone(),
            )
            received["exp_avg_sq"][path] = (
                pieces[2].view(A.shape).clone(),
                pieces[3].view(B.shape).clone(),
            )
        return SlotParts(spec=spec, weights=weights, moments=received, step=int(step_buf.item()))

    # ------------------------------------------------------------------ state in
    def load_state(
        self, state: TrainingState, slot: int, *, with_optimizer: bool, source: str
    ) -> int:
        """Restores a checkpoint (read once by the caller, shipped to every rank) into `slot`:
        weights on every rank, moments on the owner. Same per-layer format as one process, so
        a checkpoint moves freely between 1 and N ranks."""

        def load() -> int:
            allocated = apply_weights(
                state, source, bank=self.bank, base_model_id=self.base_model_id, slot=slot
            )
            if allocated in self.owned and self.optimizer is not None:
                local = self._local(allocated)
                self.optimizer.reset_slot(local)
                if with_optimizer and state.moments is not None:
                    assert state.step is not None and state.spec.targets is not None
                    row_state = {
                        name: self.bank.join_row(
                            state.moments[name], state.spec.rank, state.spec.targets
                        )
                        for name in MOMENTS
                    }
                    row_state["step"] = torch.tensor(state.step, dtype=torch.int64)
                    try:
                        self.optimizer.load_slot_state(local, row_state)
                    except ValueError as exc:
                        self.optimizer.reset_slot(local)
                        self.bank.free(allocated)
                        raise CheckpointError(f"{source}: {exc}") from None
            return allocated

        def undo(allocated: int | None) -> None:
            if allocated is not None:
                self.bank.free(allocated)

        slot = self._agreed(load, undo)
        self.pending.discard(slot)
        if isinstance(state.hparams, AdamHParams):  # the driver refuses other families
            self.hparams[slot] = state.hparams
        return slot
