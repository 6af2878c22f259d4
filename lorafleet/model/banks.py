"""Adapter banks: per-slot LoRA A/B for every targeted linear of one frozen base model.

A `BankSet` is one named family of slots (e.g. "train" or "sample") spanning all wrapped layers.
All of its values live in one flat fp32 tensor `params[slots, P]` (and `grads[slots, P]`): slot
s's row is every A and B of the adapter in slot s. Each layer's `A[slots, r_max, in]` and
`B[slots, out, r_max]` are views into it (a plain linear's B is stored rank-major, see
`_b_view`). One row per adapter makes the optimizer one vectorised update over selected rows,
and checkpoints/sync one contiguous copy.

Heterogeneous ranks share a bank: slot s uses the first `rank[s]` rows of A and columns of B.
The rest start at zero and stay exactly zero (their gradients are zero because the matching
A rows and B columns are zero), so no mask is needed in the hot path; `load_slot_weights` keeps
it that way for imported weights.

A layer may also be a bank of E experts (a fused MoE projection, see experts.py). It presents
itself as the E experts side by side, `in_features = E * in` and `out_features = E * out`, so
its layout-free form is a dense layer's: `A[rank, E * in]` (expert e's A in columns
e * in .. (e + 1) * in) and `B[E * out, rank]` (expert e's B in rows e * out ..). The kernel
views the same storage as `A[slots, r_max, E, in]` and `B[slots, E, out, r_max]`. Checkpoints,
optimizer moments and slot copies therefore need no expert special case.

The bank values are not registered as parameters of the HF model: `model.parameters()` is the
frozen base only, and `BankSet.params` is the one obvious answer to "what is trainable".
"""

from __future__ import annotations

import hashlib
import math
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from lorafleet.model import hugepages, native
from lorafleet.model.kernels import (
    KernelName,
    add_lora_fused,
    add_lora_native,
    add_lora_output,
    lora_hidden,
)
from lorafleet.model.routing import BASE_SLOT, Routing, RoutingScope

if TYPE_CHECKING:
    from lorafleet.interfaces import AdapterBank

# Bank parameters are row-slices of the flat [slots, P] buffer, so their gradients (views of
# the flat gradient buffer) are strided by design. Autograd accumulates into them in place, which
# is exactly what we want; its notice about the layout contract is expected here.
warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout contract")

_ALIGN = 8  # elements; keeps every view 32-byte aligned, as grouped_mm needs 16-byte strides
ALIGN_ELEMENTS = _ALIGN  # (memory.py sizes a row before a bank exists)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class BankError(ValueError):
    """A bank operation with arguments that cannot be honoured (slot, rank, shapes)."""


@dataclass(frozen=True)
class AdapterSpec:
    """What defines one adapter's structure and initialisation (its signature, plus the seed)."""

    rank: int
    alpha: float
    use_rslora: bool = False
    seed: int = 0
    targets: tuple[str, ...] | None = None  # module paths; None = every layer of the bank

    @property
    def scale(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank

    def validate(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise BankError(f"rank must be a positive integer, got {self.rank!r}")
        if not math.isfinite(float(self.alpha)) or self.alpha <= 0:
            raise BankError(f"alpha must be a positive finite number, got {self.alpha!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise BankError(f"seed must be an integer, got {self.seed!r}")


def init_seed(adapter_seed: int, module_path: str, which: str) -> int:
    """Per-(adapter, layer) RNG seed: an adapter initialises identically in any slot and any
    process, and adding a layer elsewhere does not shift its random stream."""
    digest = hashlib.sha256(f"{adapter_seed}|{module_path}|{which}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def kaiming_uniform_A(
    rank: int, fan_in: int, seed: int, *, width: int | None = None
) -> torch.Tensor:
    """PEFT's default A init (kaiming_uniform with a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
    fan_in being the full layer's input width, never a shard's (one expert's, for experts,
    whose A is `width` = E * fan_in wide)."""
    bound = 1.0 / math.sqrt(fan_in)
    gen = torch.Generator().manual_seed(seed)
    return torch.empty(rank, fan_in if width is None else width).uniform_(
        -bound, bound, generator=gen
    )


def layer_experts(layer: object) -> int:
    """Experts side by side in a bank layer: 1 for a linear, E for a fused expert projection."""
    return int(getattr(layer, "num_experts", 1))


class InputGroup:
    """Layers of one bank set that are fed the same input tensor (q/k/v, gate/up).

    Their A's sit side by side in every slot's row, so `A` views them as one stacked
    [slots, members * r_store, in] matrix and a single grouped matmul projects the input for
    every member. The first member to run in a forward computes it; the others take their
    columns, as long as they really got the same tensor under the same routing (checked by
    identity, so a model that feeds them different inputs just computes each on its own).
    Small decode batches are dominated by per-call overhead, so this saves about a third of
    the LoRA matmul calls of a transformer layer. (The native CPU path needs no group: it runs
    a layer's whole LoRA in one call, see kernels.add_lora_native.)
    """

    def __init__(self, members: Sequence[str], A: nn.Parameter, r_store: int):
        self.members = tuple(members)
        self.A = A
        self.r_store = r_store
        self._local = threading.local()  # a trainer and a sampler thread may run at once

    def hidden(
        self,
        member: int,
        x_key: torch.Tensor,
        x: torch.Tensor,
        routing: Routing,
        kernel: KernelName,
    ) -> torch.Tensor | None:
        """Member `member`'s columns of the shared A-projection of `x` (see kernels.lora_hidden)."""
        entry = getattr(self._local, "entry", None)
        if entry is None or entry[0] is not x_key or entry[1] is not routing or member in entry[3]:
            entry = (x_key, routing, lora_hidden(x, self.A, routing, kernel), set[int]())
            self._local.entry = entry
        _, _, hidden, served = entry
        served.add(member)
        if len(served) == len(self.members):
            self._local.entry = None  # every member served: release the input and the graph
        if hidden is None:
            return None
        return hidden[:, member * self.r_store : (member + 1) * self.r_store]


def _b_view(flat: torch.Tensor, layer: BankLayer, r_store: int) -> torch.Tensor:
    """[slots, out, r_store] view of B values stored in flat [slots, out * r_store] rows.

    A plain linear's B is stored rank-major ([r_store, out] per slot) and viewed transposed:
    the expand step then reads each rank row of B as one contiguous stream, which on CPU
    makes decode-sized products faster (docs/performance.md). An expert bank keeps
    [E, out / E, r_store]."""
    slots = flat.shape[0]
    out = layer.out_features
    experts = layer_experts(layer)
    if experts != 1:
        return flat.view(slots, experts, out // experts, r_store)
    return flat.view(slots, r_store, out).transpose(1, 2)


@dataclass
class LayerBank:
    """One bank set's A/B views for one wrapped layer."""

    A: nn.Parameter  # [slots, r_max, in], or [slots, r_max, E, in / E] for E experts
    B: nn.Parameter  # [slots, out, r_max], or [slots, E, out / E, r_max]
    a_span: tuple[int, int]  # column span of A in the flat row
    b_span: tuple[int, int]
    group: InputGroup | None = None  # set when this layer shares its input with siblings
    member: int = 0  # its index in the group
    native_plan: native.LayerPlan | None = None  # A and B as the native CPU kernels read them


class BankLayer(Protocol):
    """What a bank set needs of a layer it spans: a wrapped linear (`LoRALinear`) or one fused
    expert projection (experts.ExpertProjection), which is not an nn.Module."""

    kernel: KernelName

    @property
    def path(self) -> str: ...

    @property
    def in_features(self) -> int: ...

    @property
    def out_features(self) -> int: ...

    @property
    def weight(self) -> torch.Tensor: ...

    def attach(self, bank: str, layer_bank: LayerBank) -> None: ...

    def bank(self, name: str) -> LayerBank | None: ...


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus the LoRA banks of every bank set that targets it.

    The routing (which slot each token uses, and which bank set) comes from the model's
    `RoutingScope`, set by whoever runs the forward.
    """

    def __init__(
        self, base_layer: nn.Linear, path: str, scope: RoutingScope, kernel: KernelName = "auto"
    ):
        super().__init__()
        self.base_layer = base_layer
        self.path = path
        self.kernel: KernelName = kernel
        self._scope = scope
        self._banks: dict[str, LayerBank] = {}
        # Plain ints: a decode step reads them in every layer call, and going through
        # nn.Module attribute lookup each time adds up over a step's layer calls.
        self._in_features = int(base_layer.in_features)
        self._out_features = int(base_layer.out_features)

    @property
    def in_features(self) -> int:
        return self._in_features

    @property
    def out_features(self) -> int:
        return self._out_features

    @property
    def weight(self) -> torch.Tensor:
        """The frozen base weight (HF code reads `lm_head.weight`, e.g. for tied embeddings)."""
        return self.base_layer.weight

    def attach(self, bank: str, layer_bank: LayerBank) -> None:
        if bank in self._banks:
            raise BankError(f"layer {self.path!r} already has a bank named {bank!r}")
        self._banks[bank] = layer_bank

    def bank(self, name: str) -> LayerBank | None:
        return self._banks.get(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        routing = self._scope.current(self.path)
        layer_bank = self._banks.get(routing.bank)
        if layer_bank is None or routing.num_active == 0:
            # This bank set does not target this layer (its adapters leave it as the base),
            # or every token of the forward is a base-model token.
            return out
        if add_lora_native(out, x, layer_bank.A, layer_bank.native_plan, routing, self.kernel):
            return out
        fused = add_lora_fused(out, x, layer_bank.A, layer_bank.B, routing, self.kernel)
        if fused is not None:
            return fused
        flat_x = x.reshape(-1, self._in_features)
        flat_out = out.reshape(-1, self._out_features)
        group = layer_bank.group
        if group is None:
            hidden = lora_hidden(flat_x, layer_bank.A, routing, self.kernel)
        else:
            hidden = group.hidden(layer_bank.member, x, flat_x, routing, self.kernel)
        if hidden is None:
            return out
        return add_lora_output(flat_out, hidden, layer_bank.B, routing, self.kernel).view_as(out)

    def extra_repr(self) -> str:
        return f"path={self.path!r}, banks={sorted(self._banks)}"


def _usable_groups(
    input_groups: Sequence[Sequence[str]], layers: Mapping[str, BankLayer]
) -> list[tuple[str, ...]]:
    """The groups whose members this bank wraps as plain linears of one input width."""
    usable = []
    seen: set[str] = set()
    for group in input_groups:
        wanted = set(group) - seen
        members = tuple(p for p in layers if p in wanted and layer_experts(layers[p]) == 1)
        widths = {layers[p].in_features for p in members}
        if len(members) >= 2 and len(widths) == 1:
            usable.append(members)
            seen.update(members)
    return usable


@dataclass
class SlotInfo:
    spec: AdapterSpec
    targets: tuple[str, ...]  # resolved module paths this adapter trains


class SlotTable:
    """The slot bookkeeping of a bank: which slots hold which adapter, and the checks on them.

    `BankSet` holds the tensors too; a sharded trainer's server-side mirror
    (`lorafleet.distributed.remote.RemoteBank`) holds only this table, and both inherit the same
    checks so that their error messages are identical.
    """

    name: str
    num_slots: int
    slots: list[SlotInfo | None]
    layers: Mapping[str, object]

    def free_slots(self) -> list[int]:
        return [s for s in range(1, self.num_slots) if self.slots[s] is None]

    def used_slots(self) -> list[int]:
        return [s for s in range(1, self.num_slots) if self.slots[s] is not None]

    def check_slot(self, slot: int) -> SlotInfo:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 1 <= slot < self.num_slots:
            raise BankError(
                f"slot {slot!r} is not an adapter slot of bank {self.name!r} (1..{self.num_slots - 1})"
            )
        info = self.slots[slot]
        if info is None:
            raise BankError(f"slot {slot} of bank {self.name!r} is not allocated")
        return info

    def resolve_targets(self, spec: AdapterSpec) -> tuple[str, ...]:
        if spec.targets is None:
            return tuple(self.layers)
        unknown = [t for t in spec.targets if t not in self.layers]
        if unknown:
            raise BankError(
                f"adapter targets {unknown} are not layers of bank {self.name!r} "
                f"(it wraps {len(self.layers)} layers, e.g. {list(self.layers)[:3]})"
            )
        if not spec.targets:
            raise BankError("adapter targets is empty")
        return tuple(t for t in self.layers if t in set(spec.targets))


@dataclass
class BankSet(SlotTable):
    """One family of adapter slots across a fixed set of layers."""

    name: str
    layers: dict[str, BankLayer]
    num_slots: int
    r_max: int
    params: torch.Tensor  # fp32 [slots, P]
    grads: torch.Tensor | None  # fp32 [slots, P], None for inference-only banks
    layer_banks: dict[str, LayerBank]
    slots: list[SlotInfo | None] = field(default_factory=list)
    scales: torch.Tensor = field(default_factory=lambda: torch.zeros(0))

    @classmethod
    def create(
        cls,
        name: str,
        layers: Mapping[str, BankLayer],
        *,
        num_slots: int,
        r_max: int,
        trainable: bool = True,
        device: torch.device | str | None = None,
        input_groups: Sequence[Sequence[str]] = (),
    ) -> BankSet:
        """`input_groups` lists layers known to be fed the same input (see `InputGroup`);
        groups are laid out to share one A-projection. Only the bank's plain linears with
        equal in_features count, and a group needs two of them."""
        if not isinstance(num_slots, int) or num_slots < 2:
            raise BankError(f"num_slots must be >= 2 (slot 0 is the base model), got {num_slots!r}")
        if not isinstance(r_max, int) or r_max < 1:
            raise BankError(f"r_max must be a positive integer, got {r_max!r}")
        if not layers:
            raise BankError(f"bank {name!r} targets no layer")
        r_store = _round_up(r_max, _ALIGN)
        groups = _usable_groups(input_groups, layers)
        group_of = {path: group for group in groups for path in group}
        a_spans: dict[str, tuple[int, int]] = {}
        b_spans: dict[str, tuple[int, int]] = {}
        cursor = 0
        for path in layers:
            if path in a_spans:
                continue
            # A group's A's first, back to back (r_store * in is a multiple of _ALIGN, so no
            # gap): one [members * r_store, in] view per slot. Then their B's.
            members = group_of.get(path, (path,))
            for member in members:
                a_len = r_store * layers[member].in_features
                a_spans[member] = (cursor, cursor + a_len)
                cursor = _round_up(cursor + a_len, _ALIGN)
            for member in members:
                b_len = layers[member].out_features * r_store
                b_spans[member] = (cursor, cursor + b_len)
                cursor = _round_up(cursor + b_len, _ALIGN)
        spans = {path: (a_spans[path], b_spans[path]) for path in layers}
        if device is None:
            device = next(iter(layers.values())).weight.device
        params = hugepages.zeros(num_slots, cursor, device=device)
        grads = torch.zeros_like(params) if trainable else None
        layer_banks: dict[str, LayerBank] = {}
        for path, layer in layers.items():
            (a0, a1), (b0, b1) = spans[path]
            experts = layer_experts(layer)
            a_shape: tuple[int, ...] = (num_slots, r_store, layer.in_features)
            if experts != 1:
                a_shape = (num_slots, r_store, experts, layer.in_features // experts)
            A = nn.Parameter(params[:, a0:a1].view(a_shape), requires_grad=trainable)
            B = nn.Parameter(_b_view(params[:, b0:b1], layer, r_store), requires_grad=trainable)
            if grads is not None:
                A.grad = grads[:, a0:a1].view(a_shape)
                B.grad = _b_view(grads[:, b0:b1], layer, r_store)
            plan = native.layer_plan(A, B, row_rest=cursor - b0) if experts == 1 else None
            layer_bank = LayerBank(A=A, B=B, a_span=(a0, a1), b_span=(b0, b1), native_plan=plan)
            layer.attach(name, layer_bank)
            layer_banks[path] = layer_bank
        for members in groups:
            a0, a1 = a_spans[members[0]][0], a_spans[members[-1]][1]
            stacked = (num_slots, len(members) * r_store, layers[members[0]].in_features)
            A = nn.Parameter(params[:, a0:a1].view(stacked), requires_grad=trainable)
            if grads is not None:
                A.grad = grads[:, a0:a1].view(stacked)
            group = InputGroup(members, A, r_store)
            for index, member in enumerate(members):
                layer_banks[member].group = group
                layer_banks[member].member = index
        bank = cls(
            name=name,
            layers=dict(layers),
            num_slots=num_slots,
            r_max=r_max,
            params=params,
            grads=grads,
            layer_banks=layer_banks,
        )
        bank.slots = [None] * num_slots
        bank.scales = torch.zeros(num_slots, dtype=torch.float32, device=device)
        return bank

    # ------------------------------------------------------------------ slots
    @property
    def trainable(self) -> bool:
        return self.grads is not None

    @property
    def row_size(self) -> int:
        return int(self.params.shape[1])

    def allocate(
        self, spec: AdapterSpec, slot: int | None = None, *, initialize: bool = True
    ) -> int:
        """Claims a slot for `spec` and initialises it as PEFT does (A random, B zero)."""
        spec.validate()
        if spec.rank > self.r_max:
            raise BankError(f"rank {spec.rank} exceeds r_max {self.r_max} of bank {self.name!r}")
        targets = self.resolve_targets(spec)
        if slot is None:
            free = self.free_slots()
            if not free:
                raise BankError(
                    f"no free slot in bank {self.name!r} (all {self.num_slots - 1} in use)"
                )
            slot = free[0]
        elif not isinstance(slot, int) or not 1 <= slot < self.num_slots:
            raise BankError(
                f"slot {slot!r} is not an adapter slot of bank {self.name!r} (1..{self.num_slots - 1})"
            )
        elif self.slots[slot] is not None:
            raise BankError(f"slot {slot} of bank {self.name!r} is already in use")
        self.slots[slot] = SlotInfo(spec=replace(spec, targets=targets), targets=targets)
        self.scales[slot] = spec.scale
        self._zero_slot(slot)
        if initialize:
            self._init_slot(slot)
        return slot

    def free(self, slot: int) -> None:
        self.check_slot(slot)
        self.slots[slot] = None
        self.scales[slot] = 0.0
        self._zero_slot(slot)

    @torch.no_grad()
    def _zero_slot(self, slot: int) -> None:
        self.params[slot].zero_()
        if self.grads is not None:
            self.grads[slot].zero_()

    @torch.no_grad()
    def _init_slot(self, slot: int) -> None:
        info = self.slots[slot]
        assert info is not None
        rank = info.spec.rank
        for path in info.targets:
            layer = self.layers[path]
            # An expert's A has one expert's fan-in, as PEFT draws it.
            fan_in = layer.in_features // layer_experts(layer)
            init = kaiming_uniform_A(
                rank, fan_in, init_seed(info.spec.seed, path, "A"), width=layer.in_features
            )
            self.layer_banks[path].A[slot, :rank].copy_(
                init.view_as(self.layer_banks[path].A[slot, :rank])
            )

    # ------------------------------------------------------------ weights io
    def split_row(
        self, row: torch.Tensor, rank: int, targets: Sequence[str]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Views of a flat [P] row (params, grads or optimizer moments) as per-layer
        (A[rank, in], B[out, rank]): the layout-free form used by checkpoints and exports."""
        if row.shape != (self.row_size,):
            raise BankError(f"row has shape {tuple(row.shape)}, expected ({self.row_size},)")
        r_store = self.layer_banks[next(iter(self.layer_banks))].A.shape[1]
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for path in targets:
            layer = self.layers[path]
            layer_bank = self.layer_banks[path]
            (a0, a1), (b0, b1) = layer_bank.a_span, layer_bank.b_span
            A = row[a0:a1].view(r_store, layer.in_features)[:rank]
            B = _b_view(row[b0:b1].unsqueeze(0), layer, r_store).view(layer.out_features, r_store)[
                :, :rank
            ]
            out[path] = (A, B)
        return out

    def join_row(
        self,
        tensors: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        rank: int,
        targets: Sequence[str],
    ) -> torch.Tensor:
        """Inverse of `split_row`: a fresh flat row, zero outside the given layers and rank."""
        row = torch.zeros(self.row_size, dtype=torch.float32, device=self.params.device)
        views = self.split_row(row, rank, targets)
        for path in targets:
            A, B = tensors[path]
            views[path][0].copy_(A)
            views[path][1].copy_(B)
        return row

    def slot_weights(self, slot: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the adapter's targeted layers: path -> (A[rank, in], B[out, rank]), fp32."""
        info = self.check_slot(slot)
        views = self.split_row(self.params[slot].detach(), info.spec.rank, info.targets)
        return {path: (A.clone(), B.clone()) for path, (A, B) in views.items()}

    @torch.no_grad()
    def load_slot_weights(
        self, slot: int, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Writes A/B for an allocated slot; every targeted layer must be given, shapes exact."""
        info = self.check_slot(slot)
        rank = info.spec.rank
        missing = [p for p in info.targets if p not in weights]
        extra = [p for p in weights if p not in info.targets]
        if missing or extra:
            raise BankError(
                f"weights for slot {slot} do not match its targets: missing {missing[:5]}, unexpected {extra[:5]}"
            )
        for path in info.targets:
            A, B = weights[path]
            layer = self.layers[path]
            if tuple(A.shape) != (rank, layer.in_features):
                raise BankError(
                    f"{path}: A has shape {tuple(A.shape)}, expected {(rank, layer.in_features)}"
                )
            if tuple(B.shape) != (layer.out_features, rank):
                raise BankError(
                    f"{path}: B has shape {tuple(B.shape)}, expected {(layer.out_features, rank)}"
                )
            for which, t in (("A", A), ("B", B)):
                if not torch.isfinite(t).all():
                    raise BankError(f"{path}: {which} contains NaN or inf")
        self._zero_slot(slot)
        self.params[slot].copy_(self.join_row(weights, rank, info.targets))

    def layout(self) -> list[tuple[str, tuple[int, int], tuple[int, int]]]:
        """Where each layer's A and B sit in a slot's flat row."""
        return [(path, lb.a_span, lb.b_span) for path, lb in self.layer_banks.items()]

    @torch.no_grad()
    def copy_slot_from(self, other: AdapterBank, src_slot: int, dst_slot: int) -> None:
        """Row copy between bank sets over the same layers (e.g. trainer -> sampler publish)."""
        if other.layout() != self.layout():
            raise BankError(f"bank {other.name!r} and {self.name!r} do not share a layout")
        info = other.check_slot(src_slot)
        if self.slots[dst_slot] is None:
            self.allocate(info.spec, dst_slot, initialize=False)
        self.params[dst_slot].copy_(other.params[src_slot])
        self.scales[dst_slot] = other.scales[src_slot]

    def slot_ids_for_rows(self, row_slots: Sequence[int], seq_len: int) -> torch.Tensor:
        """[rows, seq_len] slot ids for a padded batch whose row i belongs to row_slots[i]."""
        for slot in row_slots:
            if slot != BASE_SLOT:
                self.check_slot(slot)
        ids = torch.tensor(list(row_slots), dtype=torch.int64, device=self.params.device)
        return ids.unsqueeze(1).expand(len(row_slots), seq_len)
