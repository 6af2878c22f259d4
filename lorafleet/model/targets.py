"""Which linear layers of a base model an adapter may target.

Two vocabularies resolve to the same thing, a sorted tuple of module paths:
- PEFT's `target_modules`: a list of names (a module matches when its path equals the name or
  ends with "." + name), a regex string (full match on the path), or "all-linear" (every
  nn.Linear except the output embedding and MoE routers);
- Tinker's switches `train_attn`, `train_mlp`, `train_unembed`.

Attention vs MLP is read from the module tree (the nearest ancestor that is an attention block),
not from a list of projection names, so new architectures need no table here.

Fused MoE experts (3-D expert parameters, see experts.py) are addressed by parameter path, as
PEFT's `target_parameters` does ("model.layers.0.mlp.experts.gate_up_proj"); Tinker's
`train_mlp` covers them, since on an MoE model the experts are the MLP.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from lorafleet.model.banks import LoRALinear
from lorafleet.model.experts import LoRAExperts, fused_expert_params

ALL_LINEAR = "all-linear"


class TargetError(ValueError):
    """A target specification that names nothing, or something that cannot carry LoRA."""


@dataclass(frozen=True)
class LinearInfo:
    path: str
    in_features: int
    out_features: int
    role: str  # "attn" | "mlp" (every other linear but the unembedding) | "unembed"


def _is_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention")


def _router_paths(model: nn.Module) -> set[str]:
    """Linear gates that pick experts: a linear whose sibling `experts` holds as many experts as
    the gate has outputs, or a single-output gate that scales a shared expert. They must stay
    frozen (LoRA on a router changes routing, not experts)."""
    routers: set[str] = set()
    for parent_path, parent in model.named_modules():
        experts = getattr(parent, "experts", None)
        if experts is None:
            continue
        num_experts = _count_experts(experts)
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Linear) and child.out_features in (num_experts, 1):
                routers.add(f"{parent_path}.{child_name}" if parent_path else child_name)
    return routers


def _count_experts(experts: nn.Module) -> int:
    if isinstance(experts, LoRAExperts):
        return experts.num_experts
    if isinstance(experts, nn.ModuleList):
        return len(experts)
    for param in experts.parameters(recurse=False):
        if param.dim() == 3:
            return int(param.shape[0])
    return -1


def linear_layers(model: nn.Module) -> dict[str, LinearInfo]:
    """Every nn.Linear that can carry LoRA, keyed by module path, with its structural role."""
    get_unembed = getattr(model, "get_output_embeddings", None)
    unembed = get_unembed() if get_unembed is not None else None
    routers = _router_paths(model)
    infos: dict[str, LinearInfo] = {}

    def visit(module: nn.Module, path: str, in_attention: bool) -> None:
        for child_name, child in module.named_children():
            child_path = f"{path}.{child_name}" if path else child_name
            # An already wrapped layer is still the same linear layer at the same path.
            linear = child.base_layer if isinstance(child, LoRALinear) else child
            if isinstance(linear, nn.Linear):
                if child_path in routers:
                    continue
                if child is unembed or linear is unembed:
                    role = "unembed"
                elif in_attention:
                    role = "attn"
                else:
                    role = "mlp"
                infos[child_path] = LinearInfo(
                    child_path, linear.in_features, linear.out_features, role
                )
            else:
                visit(child, child_path, in_attention or _is_attention(child))

    visit(model, "", False)
    return infos


def _peft_match(path: str, spec: str | Sequence[str]) -> bool:
    if isinstance(spec, str):
        return re.fullmatch(spec, path) is not None
    return any(path == name or path.endswith("." + name) for name in spec)


def resolve_target_modules(
    model: nn.Module, target_modules: str | Sequence[str]
) -> tuple[str, ...]:
    """PEFT semantics; every listed name must match at least one linear layer."""
    infos = linear_layers(model)
    if isinstance(target_modules, str) and target_modules == ALL_LINEAR:
        chosen = [p for p, info in infos.items() if info.role != "unembed"]
    elif isinstance(target_modules, str):
        try:
            re.compile(target_modules)
        except re.error as exc:
            raise TargetError(f"target_modules regex {target_modules!r} is invalid: {exc}") from exc
        chosen = [p for p in infos if _peft_match(p, target_modules)]
        if not chosen:
            raise TargetError(f"target_modules regex {target_modules!r} matches no linear layer")
    else:
        names = list(target_modules)
        if not names:
            raise TargetError("target_modules is empty")
        for name in names:
            if not isinstance(name, str) or not name:
                raise TargetError(f"target_modules entry {name!r} is not a module name")
            if not any(_peft_match(p, [name]) for p in infos):
                known = sorted({p.rsplit(".", 1)[-1] for p in infos})
                raise TargetError(
                    f"target module {name!r} matches no linear layer of this model "
                    f"(linear layer names: {known})"
                )
        chosen = [p for p in infos if _peft_match(p, names)]
    if not chosen:
        raise TargetError(f"target_modules {target_modules!r} selects no linear layer")
    return tuple(sorted(chosen))


def resolve_target_parameters(
    model: nn.Module, target_parameters: Sequence[str]
) -> tuple[str, ...]:
    """PEFT's `target_parameters` for fused experts: a parameter matches when its path equals a
    name or ends with "." + name; every name must match at least one fused expert projection."""
    if isinstance(target_parameters, str) or not list(target_parameters):
        raise TargetError(
            f"target_parameters must be a non-empty list of names, got {target_parameters!r}"
        )
    params, unsupported = fused_expert_params(model)
    chosen: set[str] = set()
    for name in target_parameters:
        if not isinstance(name, str) or not name:
            raise TargetError(f"target_parameters entry {name!r} is not a parameter name")
        matched = [p for p in params if _peft_match(p, [name])]
        if not matched:
            known = sorted({p.rsplit(".", 1)[-1] for p in params})
            hint = (
                f"; unsupported experts modules: {sorted(unsupported.values())[:1]}"
                if unsupported
                else ""
            )
            raise TargetError(
                f"target parameter {name!r} matches no fused expert projection of this model "
                f"(expert parameters: {known}){hint}"
            )
        chosen.update(matched)
    return tuple(sorted(chosen))


def resolve_tinker_targets(
    model: nn.Module, *, train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True
) -> tuple[str, ...]:
    """Tinker's LoraConfig switches, mapped onto the model's structure (fused MoE expert
    projections count as MLP; their routers never count)."""
    roles = {
        role
        for role, on in (("attn", train_attn), ("mlp", train_mlp), ("unembed", train_unembed))
        if on
    }
    if not roles:
        raise TargetError("train_attn, train_mlp and train_unembed are all false: nothing to train")
    chosen = tuple(sorted(p for p, info in linear_layers(model).items() if info.role in roles))
    if train_mlp:
        experts, unsupported = fused_expert_params(model)
        if unsupported:
            # Training "the MLP" while skipping experts we cannot compute would be the silent
            # expert-LoRA drop this engine exists to avoid.
            raise TargetError(
                f"train_mlp on a model whose experts cannot carry LoRA: {next(iter(unsupported.values()))}"
            )
        chosen = tuple(sorted(set(chosen) | set(experts)))
    if not chosen:
        raise TargetError(f"this model has no linear layer with role in {sorted(roles)}")
    return chosen
