"""LoRA on fused MoE experts, routed by (expert, adapter) pairs.

transformers 5 stores an MoE layer's routed experts as one module holding 3-D parameters
(`gate_up_proj[E, 2I, H]`, `down_proj[E, H, I]`, or transposed) whose forward takes
`(hidden_states, top_k_index, top_k_weights)` from the router. A LoRA on such a projection is
one A/B pair per expert and per adapter; this module

- finds those modules from their structure (3-D parameters sharing a leading expert dimension,
  a forward taking the router's choice, and transformers' experts-interface flags), never from a
  list of class names. The router, a separate module, is never touched;
- wraps each one in `LoRAExperts`, which recomputes the experts forward itself so it can add the
  LoRA deltas inside it (a delta on gate/up must pass through the activation before `down_proj`,
  so it cannot be added to the module's output afterwards);
- exposes each targeted projection to the adapter banks as an `ExpertProjection`, a bank layer of
  E experts, so a `BankSet` holds expert LoRA in the same flat per-slot row as dense LoRA.

The forward sorts the (token, k) pairs once by the composite key (expert, adapter slot). Experts
then own contiguous segments, which the frozen expert GEMMs run as one grouped matmul over E
groups, and each (expert, adapter) owns a contiguous sub-segment, which the LoRA A and B products
run as one grouped matmul over E x adapters groups (int32 offsets). Autograd runs the same
grouped matmuls backwards, so every adapter's expert gradient lands in its own bank row.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from lorafleet.model.banks import BankError, LayerBank
from lorafleet.model.kernels import KERNELS, KernelName, _contiguous_grad, grouped_mm_fits
from lorafleet.model.routing import Routing, RoutingError, RoutingScope

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "ExpertProjection",
    "ExpertsError",
    "ExpertsLayout",
    "LoRAExperts",
    "PerExpertName",
    "experts_layout",
    "fused_expert_params",
    "per_expert_names",
]

_INTERFACE_FLAGS = ("has_gate", "is_transposed", "has_bias")


class ExpertsError(ValueError):
    """A fused-experts module this engine cannot put LoRA on (it would be silently dropped)."""


@dataclass(frozen=True)
class ExpertsLayout:
    """How one fused-experts module computes: the parameter names and the math around them."""

    num_experts: int
    hidden: int
    intermediate: int
    in_param: str  # the gate/up (or up) projection: hidden -> (2 x) intermediate
    out_param: str  # the down projection: intermediate -> hidden
    gated: bool
    transposed: bool  # weights stored [E, in, out] instead of [E, out, in]
    has_bias: bool

    def features(self, param: str) -> tuple[int, int]:
        """(in_features, out_features) of one expert of `param`."""
        if param == self.in_param:
            return self.hidden, (2 if self.gated else 1) * self.intermediate
        if param == self.out_param:
            return self.intermediate, self.hidden
        raise ExpertsError(f"{param!r} is not a projection of this experts module")


def _unwrap(module: nn.Module) -> nn.Module:
    return module.base_layer if isinstance(module, LoRAExperts) else module


def _takes_router_choice(module: nn.Module) -> bool:
    """The experts forward contract: (hidden_states, top_k_index, top_k_weights)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 3


def experts_layout(module: nn.Module, path: str = "") -> ExpertsLayout | None:
    """The layout of a fused-experts module, or None if `module` is not one.

    Raises ExpertsError for a module that holds fused experts (3-D weights sharing a leading
    expert dimension, a forward taking the router's choice) but not in a form this engine can
    compute: training "the MLP" of such a model must not silently skip its experts.
    """
    module = _unwrap(module)
    weights = {n: p for n, p in module.named_parameters(recurse=False) if p.dim() == 3}
    if len(weights) < 2 or len({int(p.shape[0]) for p in weights.values()}) != 1:
        return None
    if not _takes_router_choice(module):
        return None
    where = f"{type(module).__name__} at {path!r}" if path else type(module).__name__
    missing = [flag for flag in _INTERFACE_FLAGS if not hasattr(module, flag)]
    if not missing and bool(module.has_gate) and not hasattr(module, "_apply_gate"):
        missing = ["_apply_gate"]
    if missing:
        raise ExpertsError(
            f"{where} holds fused experts {sorted(weights)} but not through transformers' experts "
            f"interface (missing {missing}); expert LoRA cannot be attached to it"
        )
    if bool(getattr(module, "_is_expert_parallel", False)):
        raise ExpertsError(f"{where} is expert-parallel; expert LoRA needs every expert local")
    gated = bool(module.has_gate)
    transposed = bool(module.is_transposed)
    in_param = "gate_up_proj" if gated else "up_proj"
    out_param = "down_proj"
    if in_param not in weights or out_param not in weights:
        raise ExpertsError(
            f"{where}: expected 3-D parameters {in_param!r} and {out_param!r}, found {sorted(weights)}"
        )

    def in_out(param: torch.Tensor) -> tuple[int, int]:
        _, d1, d2 = param.shape
        return (int(d1), int(d2)) if transposed else (int(d2), int(d1))

    hidden, up_out = in_out(weights[in_param])
    intermediate, down_out = in_out(weights[out_param])
    if down_out != hidden or up_out != (2 if gated else 1) * intermediate:
        raise ExpertsError(
            f"{where}: {in_param} {tuple(weights[in_param].shape)} and {out_param} "
            f"{tuple(weights[out_param].shape)} do not chain (transposed={transposed}, gated={gated})"
        )
    has_bias = bool(module.has_bias)
    if has_bias:
        for name, width in ((in_param, up_out), (out_param, hidden)):
            bias = getattr(module, f"{name}_bias", None)
            if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (
                weights[in_param].shape[0],
                width,
            ):
                raise ExpertsError(
                    f"{where}: has_bias is set but {name}_bias is missing or misshaped"
                )
    return ExpertsLayout(
        num_experts=int(weights[in_param].shape[0]),
        hidden=hidden,
        intermediate=intermediate,
        in_param=in_param,
        out_param=out_param,
        gated=gated,
        transposed=transposed,
        has_bias=has_bias,
    )


@dataclass(frozen=True)
class ExpertParamInfo:
    """One fused expert projection that can carry LoRA, addressed as its parameter path."""

    path: str  # "<experts module path>.<param name>", as in PEFT's target_parameters
    module_path: str
    param: str
    num_experts: int
    in_features: int
    out_features: int


def fused_expert_params(model: nn.Module) -> tuple[dict[str, ExpertParamInfo], dict[str, str]]:
    """Every fused expert projection of `model` (keyed by parameter path), and the experts
    modules it cannot adapt (path -> reason). Paths are those of the unwrapped model."""
    found: dict[str, ExpertParamInfo] = {}
    unsupported: dict[str, str] = {}
    for module_path, module in model.named_modules():
        if isinstance(_parent_wrapper(model, module_path), LoRAExperts):
            continue  # the base module inside a wrapper; reported at the wrapper's path
        try:
            layout = experts_layout(module, module_path)
        except ExpertsError as exc:
            unsupported[module_path] = str(exc)
            continue
        if layout is None:
            continue
        for param in (layout.in_param, layout.out_param):
            in_features, out_features = layout.features(param)
            path = f"{module_path}.{param}" if module_path else param
            found[path] = ExpertParamInfo(
                path, module_path, param, layout.num_experts, in_features, out_features
            )
    return found, unsupported


def _parent_wrapper(model: nn.Module, module_path: str) -> nn.Module | None:
    parent_path, _, child = module_path.rpartition(".")
    if child != "base_layer":
        return None
    return model.get_submodule(parent_path) if parent_path else model


# ----------------------------------------------------------------------------------- banks


class ExpertProjection:
    """A fused expert projection as a bank layer: E experts of in -> out each, presented to the
    bank as the experts side by side (`in_features = E * in`, `out_features = E * out`; see
    banks.py), so checkpoints and optimizer rows treat it like any layer.

    Not an nn.Module: the wrapped experts module (`LoRAExperts`) owns the computation; this is
    the handle `BankSet` keeps per targeted parameter (A/B views, shapes, the frozen weight).
    """

    def __init__(self, owner: LoRAExperts, path: str, param: str):
        self._owner = owner
        self.path = path
        self.param = param
        layout = owner.layout
        self.num_experts = layout.num_experts
        self.expert_in_features, self.expert_out_features = layout.features(param)
        self.in_features = self.num_experts * self.expert_in_features
        self.out_features = self.num_experts * self.expert_out_features
        self._banks: dict[str, LayerBank] = {}
        self._root: weakref.ref[nn.Module] | None = None
        self._names: list[PerExpertName] | ExpertsError | None = None
        self._names_known = False

    @property
    def module_path(self) -> str:
        return self._owner.path

    @property
    def info(self) -> ExpertParamInfo:
        return ExpertParamInfo(
            self.path,
            self.module_path,
            self.param,
            self.num_experts,
            self.expert_in_features,
            self.expert_out_features,
        )

    def sibling_params(self) -> list[str]:
        """The experts module's fused projections in declaration order (which PEFT's nesting of
        one ParamWrapper per targeted parameter follows), targeted or not."""
        layout = self._owner.layout
        return [
            name
            for name, _ in self._owner.base_layer.named_parameters(recurse=False)
            if name in (layout.in_param, layout.out_param)
        ]

    def set_root(self, model: nn.Module) -> None:
        """The whole model, which knows its checkpoint's expert naming (see per_expert_names)."""
        self._root = weakref.ref(model)
        self._names_known = False

    def checkpoint_names(self) -> list[PerExpertName] | None:
        """Per-expert 2-D modules of the base checkpoint holding this projection (cached), or
        None when the checkpoint stores it fused."""
        if not self._names_known:
            root = None if self._root is None else self._root()
            if root is None:
                raise ExpertsError(
                    f"{self.path}: the model this projection belongs to is unknown or gone"
                )
            try:
                self._names = per_expert_names(root, self.info)
            except ExpertsError as exc:
                self._names = exc
            self._names_known = True
        if isinstance(self._names, ExpertsError):
            raise self._names
        return self._names

    @property
    def weight(self) -> torch.Tensor:
        """The frozen fused weight (3-D)."""
        return getattr(self._owner.base_layer, self.param)

    @property
    def kernel(self) -> KernelName:
        return self._owner.kernel

    @kernel.setter
    def kernel(self, value: KernelName) -> None:
        self._owner.kernel = value

    def attach(self, bank: str, layer_bank: LayerBank) -> None:
        if bank in self._banks:
            raise BankError(f"layer {self.path!r} already has a bank named {bank!r}")
        self._banks[bank] = layer_bank

    def bank(self, name: str) -> LayerBank | None:
        return self._banks.get(name)

    def __repr__(self) -> str:
        return (
            f"ExpertProjection(path={self.path!r}, experts={self.num_experts}, "
            f"in={self.expert_in_features}, out={self.expert_out_features}, banks={sorted(self._banks)})"
        )


# ----------------------------------------------------------------------------------- forward


@dataclass
class _PairGroups:
    """(token, k) pairs of one forward sorted by (expert, adapter); shared by both projections."""

    token: torch.Tensor  # int64 [P] token of each sorted pair
    expert: torch.Tensor  # int64 [P]
    weight: torch.Tensor  # [P] router weight of each sorted pair
    expert_offsets: torch.Tensor  # int32 [E]
    expert_counts: list[int] | None  # host copy, loop kernel only
    lora_rows: torch.Tensor | None  # int64 [M] sorted positions of adapter pairs; None = all
    lora_offsets: torch.Tensor | None  # int32 [E * n] over the adapter pairs
    lora_counts: list[int] | None
    lora_scale: torch.Tensor | None  # float32 [M, 1]
    active_slots: torch.Tensor | None  # int64 [n] bank slots in group order


def _group_pairs(
    routing: Routing,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    with_lora: bool,
    need_counts: bool,
) -> _PairGroups:
    device = top_k_index.device
    top_k = int(top_k_index.shape[-1])
    expert_ids = top_k_index.reshape(-1).to(torch.int64)
    active = routing.active_slots() if with_lora else []
    n = len(active)
    active_t: torch.Tensor | None = None  # the active slots as a tensor, when there are any
    if n:
        if routing.slot_ids is None or routing.slot_scales is None:
            raise RoutingError(
                "this routing carries no per-token slots; build it with build_routing"
            )
        # Slot -> 1 + its rank among this forward's active slots (0 = base model), so only the
        # adapters present cost a group, however many slots the bank has.
        compact = torch.zeros(routing.num_slots, dtype=torch.int64, device=device)
        active_t = torch.tensor(active, dtype=torch.int64, device=device)
        compact[active_t] = torch.arange(1, n + 1, device=device)
        sub = compact[routing.slot_ids].repeat_interleave(top_k)
        key = expert_ids * (n + 1) + sub
    else:
        key = expert_ids
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts * (n + 1)).view(num_experts, n + 1)
    token = order // top_k
    groups = _PairGroups(
        token=token,
        expert=expert_ids[order],
        weight=top_k_weights.reshape(-1)[order],
        expert_offsets=torch.cumsum(counts.sum(1), 0).to(torch.int32),
        expert_counts=counts.sum(1).tolist() if need_counts else None,
        lora_rows=None,
        lora_offsets=None,
        lora_counts=None,
        lora_scale=None,
        active_slots=None,
    )
    if n:
        assert routing.slot_ids is not None and routing.slot_scales is not None  # checked above
        lora_counts = counts[:, 1:].reshape(-1)
        pair_slot = routing.slot_ids[token]
        scale = routing.slot_scales[pair_slot].unsqueeze(1)
        base_tokens = routing.num_tokens - routing.num_active
        if base_tokens:  # some pairs belong to base-model rows: run LoRA on the others only
            rows = torch.nonzero(pair_slot > 0, as_tuple=False).reshape(-1)
            groups.lora_rows = rows
            scale = scale.index_select(0, rows)
        groups.lora_offsets = torch.cumsum(lora_counts, 0).to(torch.int32)
        groups.lora_counts = lora_counts.tolist() if need_counts else None
        groups.lora_scale = scale
        groups.active_slots = active_t
    return groups


def _segment_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    counts: list[int] | None,
    *,
    transposed: bool,
    grouped: bool,
) -> torch.Tensor:
    """x[rows of group g] @ weight[g] for rows sorted into contiguous groups.

    weight is [G, out, in] (a linear's layout), or [G, in, out] when `transposed`.
    """
    if grouped:
        mat2 = weight if transposed else weight.transpose(1, 2)
        return _contiguous_grad(torch._grouped_mm(x, mat2, offs=offsets))
    assert counts is not None
    out_features = weight.shape[2] if transposed else weight.shape[1]
    pieces = []
    start = 0
    for group, count in enumerate(counts):
        if count == 0:
            continue
        w = weight[group] if transposed else weight[group].T
        pieces.append(x[start : start + count] @ w)
        start += count
    if not pieces:
        return x.new_zeros((x.shape[0], out_features))
    return torch.cat(pieces, dim=0)


class _SlotRows(torch.autograd.Function):
    """`bank[slots]` whose backward adds straight into the bank's gradient rows.

    Autograd's own index_select backward would first build a zero gradient the size of the
    whole bank (every slot, every expert) per layer and step; with a hundred experts that is
    the largest tensor of the backward. Bank parameters always carry their `.grad` (a view of
    the bank's flat gradient buffer), so accumulating into it directly is the same result.
    """

    @staticmethod
    def forward(ctx: Any, bank_param: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        ctx.bank_param = bank_param
        ctx.save_for_backward(slots)
        return bank_param.detach().index_select(0, slots)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        (slots,) = ctx.saved_tensors
        target = ctx.bank_param.grad
        if target is None:
            raise RuntimeError(
                "expert bank parameter has no gradient buffer; is the bank trainable?"
            )
        target.index_add_(0, slots, grad.to(target.dtype))
        return None, None


def _slot_rows(bank_param: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    if bank_param.requires_grad and bank_param.grad is not None and torch.is_grad_enabled():
        return _SlotRows.apply(bank_param, slots)
    return bank_param.index_select(0, slots)


def _expert_major(
    bank: LayerBank, slots: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The active slots' expert LoRA as [E * n, r, in] / [E * n, out, r], group e * n + i: the
    group order of pairs sorted by (expert, adapter). One small copy per forward (a bank row is
    slot-major, so no view has this order); its backward lands in the bank's gradient rows."""
    A = _slot_rows(bank.A, slots)  # [n, r, E, in]
    B = _slot_rows(bank.B, slots)  # [n, E, out, r]
    n, r, experts, in_features = A.shape
    # contiguous(): with one adapter the reshape is a strided view, which grouped_mm rejects.
    A_g = A.permute(2, 0, 1, 3).reshape(experts * n, r, in_features).to(dtype).contiguous()
    B_g = B.transpose(0, 1).reshape(experts * n, B.shape[2], r).to(dtype).contiguous()
    return A_g, B_g


class LoRAExperts(nn.Module):
    """A frozen fused-experts module plus the expert LoRA banks of its projections.

    It replaces the experts module in the model tree and is called as it was, with the router's
    choice; the active routing (adapter slot per token) comes from the model's RoutingScope.
    """

    def __init__(
        self,
        base_layer: nn.Module,
        path: str,
        scope: RoutingScope,
        kernel: KernelName = "auto",
        *,
        params: Sequence[str] | None = None,
    ):
        super().__init__()
        layout = experts_layout(base_layer, path)
        if layout is None:
            raise ExpertsError(
                f"{path!r} ({type(base_layer).__name__}) is not a fused-experts module"
            )
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self.base_layer = base_layer
        self.path = path
        self.layout = layout
        self.kernel: KernelName = kernel
        self._scope = scope
        names = (layout.in_param, layout.out_param) if params is None else tuple(params)
        unknown = [p for p in names if p not in (layout.in_param, layout.out_param)]
        if unknown:
            raise ExpertsError(f"{path!r}: {unknown} are not projections of this experts module")
        self.projections: dict[str, ExpertProjection] = {
            p: ExpertProjection(self, f"{path}.{p}" if path else p, p) for p in names
        }

    @property
    def num_experts(self) -> int:
        return self.layout.num_experts

    def _use_grouped(self, dtype: torch.dtype, *dims: int) -> bool:
        if self.kernel == "loop":
            return False
        fits = grouped_mm_fits(dtype, *dims)
        if self.kernel == "grouped" and not fits:
            raise ValueError(
                f"kernel 'grouped' cannot run {self.path!r} in {dtype} with dims {dims}: every row "
                "must be a multiple of 16 bytes"
            )
        return fits

    def _bank(self, param: str, bank: str) -> LayerBank | None:
        projection = self.projections.get(param)
        return None if projection is None else projection.bank(bank)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        routing = self._scope.current(self.path)
        layout = self.layout
        # an HF experts module: its projections, gate and norms are named per architecture
        base: Any = self.base_layer
        if hidden_states.dim() != 2 or top_k_index.dim() != 2:
            raise ValueError(
                f"{self.path}: expected hidden_states [tokens, hidden] and top_k_index [tokens, k], got "
                f"{tuple(hidden_states.shape)} and {tuple(top_k_index.shape)}"
            )
        if hidden_states.shape[0] != routing.num_tokens:
            raise RoutingError(
                f"routing covers {routing.num_tokens} tokens but experts {self.path!r} got "
                f"{hidden_states.shape[0]}; build the routing from the batch fed to the model"
            )
        in_bank = self._bank(layout.in_param, routing.bank)
        out_bank = self._bank(layout.out_param, routing.bank)
        with_lora = (in_bank is not None or out_bank is not None) and routing.num_active > 0
        dtype = hidden_states.dtype
        dims = (layout.hidden, layout.intermediate, layout.features(layout.in_param)[1])
        base_grouped = self._use_grouped(dtype, *dims)
        r_store = (
            max(int(b.A.shape[1]) for b in (in_bank, out_bank) if b is not None) if with_lora else 0
        )
        lora_dtype = torch.float32 if hidden_states.device.type == "cpu" else dtype  # see _add_lora
        lora_grouped = with_lora and self._use_grouped(lora_dtype, *dims, r_store)
        groups = _group_pairs(
            routing,
            top_k_index,
            top_k_weights,
            layout.num_experts,
            with_lora,
            need_counts=not (base_grouped and (lora_grouped or not with_lora)),
        )

        xs = hidden_states.index_select(0, groups.token)
        w_in = getattr(base, layout.in_param)
        proj = _segment_mm(
            xs,
            w_in,
            groups.expert_offsets,
            groups.expert_counts,
            transposed=layout.transposed,
            grouped=base_grouped,
        )
        if layout.has_bias:
            proj = proj + getattr(base, f"{layout.in_param}_bias").index_select(0, groups.expert)
        if in_bank is not None and with_lora:
            proj = self._add_lora(proj, xs, in_bank, groups, lora_grouped)
        act = base._apply_gate(proj) if layout.gated else base.act_fn(proj)
        w_out = getattr(base, layout.out_param)
        out = _segment_mm(
            act,
            w_out,
            groups.expert_offsets,
            groups.expert_counts,
            transposed=layout.transposed,
            grouped=base_grouped,
        )
        if layout.has_bias:
            out = out + getattr(base, f"{layout.out_param}_bias").index_select(0, groups.expert)
        if out_bank is not None and with_lora:
            out = self._add_lora(out, act, out_bank, groups, lora_grouped)
        if getattr(base, "has_post_expert_norm", False):
            out = base.post_expert_norm(out)
        weighted = out * groups.weight.unsqueeze(-1).to(out.dtype)
        final = weighted.new_zeros((hidden_states.shape[0], weighted.shape[1]))
        return final.index_add(0, groups.token, weighted).to(dtype)

    def _add_lora(
        self, y: torch.Tensor, x: torch.Tensor, bank: LayerBank, groups: _PairGroups, grouped: bool
    ) -> torch.Tensor:
        assert groups.active_slots is not None and groups.lora_offsets is not None
        assert groups.lora_scale is not None
        # On CPU the LoRA products run in fp32 whatever the model dtype. Their many small
        # matmuls (one per expert x adapter, sizes changing every batch) in bf16 go through
        # oneDNN, which builds a kernel per shape and keeps only 1024: mixed batches thrashed
        # that cache and ran slower than one adapter, where fp32 ran no slower (and faster).
        # The bank is fp32 already, so only the routed rows are cast.
        compute = torch.float32 if x.device.type == "cpu" else x.dtype
        A_g, B_g = _expert_major(bank, groups.active_slots, compute)
        rows = groups.lora_rows
        xl = (x if rows is None else x.index_select(0, rows)).to(compute)
        hidden = _segment_mm(
            xl, A_g, groups.lora_offsets, groups.lora_counts, transposed=False, grouped=grouped
        )
        hidden = hidden * groups.lora_scale.to(hidden.dtype)
        delta = _segment_mm(
            hidden, B_g, groups.lora_offsets, groups.lora_counts, transposed=False, grouped=grouped
        )
        if rows is None:
            return y + delta.to(y.dtype)
        return y.index_add(0, rows, delta.to(y.dtype))

    def extra_repr(self) -> str:
        return f"path={self.path!r}, experts={self.num_experts}, projections={sorted(self.projections)}"


# ------------------------------------------------------------------------- checkpoint names


@dataclass(frozen=True)
class PerExpertName:
    """One per-expert 2-D module of the base checkpoint that holds part of a fused projection:
    expert `expert`'s output rows `rows` of the fused weight."""

    module: str  # e.g. "model.layers.0.mlp.experts.3.gate_proj"
    expert: int
    rows: tuple[int, int]  # [start, end) of the fused projection's output features


def per_expert_names(model: nn.Module, info: ExpertParamInfo) -> list[PerExpertName] | None:
    """How the model's own checkpoint splits a fused projection into per-expert 2-D weights, or
    None when the checkpoint stores it fused too.

    Asked of transformers itself: its save-time conversion (the inverse of the load-time
    merge) is run on a tensor whose entries label their (expert, output row), so the names and
    row slices are exactly those of `save_pretrained`, which is also what vLLM loads.
    """
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # pragma: no cover - transformers < 5
        return None
    if not hasattr(model, "config"):
        return None
    experts, out_features = info.num_experts, info.out_features
    labels = torch.arange(experts * out_features, dtype=torch.float64).view(
        experts, out_features, 1
    )
    # A [E, out, in]-ordered label; the conversion only sees the key and the leading two dims.
    # `config` is what marks an HF PreTrainedModel here (checked above)
    reverted = revert_weight_conversion(cast("PreTrainedModel", model), {info.path: labels})
    if set(reverted) == {info.path}:
        return None
    names: list[PerExpertName] = []
    covered = torch.zeros(experts * out_features, dtype=torch.bool)
    for key, value in reverted.items():
        module, _, leaf = key.rpartition(".")
        flat = value.reshape(-1)
        if leaf != "weight" or value.dim() != 2 or value.shape[1] != 1 or flat.numel() == 0:
            raise ExpertsError(
                f"{info.path}: the checkpoint conversion gives {key} {tuple(value.shape)}; not a per-expert linear"
            )
        ids = flat.to(torch.int64)
        expert = int(ids[0]) // out_features
        start = int(ids[0]) % out_features
        expected = torch.arange(
            expert * out_features + start, expert * out_features + start + ids.numel()
        )
        if not torch.equal(ids, expected) or bool(covered[ids].any()):
            raise ExpertsError(
                f"{info.path}: the checkpoint conversion maps {key} to a non-contiguous block"
            )
        covered[ids] = True
        names.append(
            PerExpertName(module=module, expert=expert, rows=(start, start + int(ids.numel())))
        )
    if not bool(covered.all()):
        raise ExpertsError(
            f"{info.path}: the checkpoint conversion does not cover every expert row"
        )
    return sorted(names, key=lambda n: (n.expert, n.rows))
