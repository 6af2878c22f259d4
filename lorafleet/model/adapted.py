"""A frozen base model with adapter banks injected into its target linears.

`AdaptedModel` owns the wrapped layers, the bank sets over them (e.g. one for training and one
for sampling, sharing the same base weights) and the routing scope. Running a forward means
choosing a bank set and a slot per token:

    with adapted.routing("train", slot_ids):
        logits = adapted.model(input_ids).logits
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from lorafleet.model.banks import BankError, BankSet, LoRALinear
from lorafleet.model.experts import ExpertProjection, ExpertsError, LoRAExperts, fused_expert_params
from lorafleet.model.kernel_check import KernelVerdict
from lorafleet.model.kernels import KERNELS, KernelName
from lorafleet.model.routing import Routing, RoutingError, RoutingScope, build_routing
from lorafleet.model.targets import TargetError, linear_layers


class AdaptedModel:
    """Base model + wrapped layers + named bank sets. Knows nothing of tenants or HTTP.

    `share_inputs` probes once which wrapped linears are fed the same tensor (q/k/v, gate/up
    in the usual decoder) so banks lay them out to share one A-projection (banks.InputGroup);
    off, every layer projects on its own (same values).
    """

    def __init__(
        self,
        model: nn.Module,
        layer_paths: Sequence[str],
        *,
        kernel: KernelName = "auto",
        share_inputs: bool = True,
    ):
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if not layer_paths:
            raise TargetError("no layer to adapt: layer_paths is empty")
        self.model = model
        self.scope = RoutingScope()
        self.banks: dict[str, BankSet] = {}
        linears = linear_layers(model)
        # Fused MoE expert projections are addressed by parameter path (PEFT's target_parameters
        # form, e.g. "model.layers.0.mlp.experts.gate_up_proj"); one wrapper per experts module.
        expert_params, _ = fused_expert_params(model)
        expert_targets: dict[str, list[str]] = {}
        for path in sorted(set(layer_paths)):
            if path in expert_params:
                info = expert_params[path]
                expert_targets.setdefault(info.module_path, []).append(info.param)
        self.layers: dict[str, LoRALinear | ExpertProjection] = {}
        self.experts: dict[str, LoRAExperts] = {}
        for path in sorted(set(layer_paths)):
            if path in expert_params:
                self._wrap_experts(model, expert_params[path].module_path, expert_targets, kernel)
                continue
            if path not in linears:
                raise TargetError(
                    f"{path!r} is not a linear layer or fused expert projection that can carry LoRA"
                )
            parent_path, _, child_name = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            base = getattr(parent, child_name)
            if isinstance(base, LoRALinear):
                raise TargetError(f"{path!r} already carries adapter banks; wrap a model only once")
            wrapper = LoRALinear(base, path, self.scope, kernel)
            setattr(parent, child_name, wrapper)
            self.layers[path] = wrapper
        self.layers = dict(sorted(self.layers.items()))
        for param in model.parameters():
            param.requires_grad_(False)
        self.input_groups = (
            probe_input_groups(model, self.layers, self.scope) if share_inputs else []
        )
        # which LoRA kernel runs and why, once the start-up check ran (kernel_check.py)
        self.kernel_verdict: KernelVerdict | None = None

    def _wrap_experts(
        self, model: nn.Module, module_path: str, targets: dict[str, list[str]], kernel: KernelName
    ) -> None:
        if module_path in self.experts:
            return
        parent_path, _, child_name = module_path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        base = getattr(parent, child_name)
        if isinstance(base, LoRAExperts):
            raise TargetError(
                f"{module_path!r} already carries adapter banks; wrap a model only once"
            )
        try:
            wrapper = LoRAExperts(
                base, module_path, self.scope, kernel, params=targets[module_path]
            )
        except ExpertsError as exc:
            raise TargetError(str(exc)) from exc
        setattr(parent, child_name, wrapper)
        self.experts[module_path] = wrapper
        for projection in wrapper.projections.values():
            projection.set_root(model)
            self.layers[projection.path] = projection

    @property
    def kernel(self) -> str:
        return next(iter(self.layers.values())).kernel

    def set_kernel(self, kernel: KernelName) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        for layer in self.layers.values():
            layer.kernel = kernel

    def add_bank(
        self,
        name: str,
        *,
        num_slots: int,
        r_max: int,
        trainable: bool = True,
        layer_paths: Sequence[str] | None = None,
    ) -> BankSet:
        if name in self.banks:
            raise BankError(f"bank set {name!r} already exists")
        paths = list(self.layers) if layer_paths is None else list(layer_paths)
        unknown = [p for p in paths if p not in self.layers]
        if unknown:
            raise BankError(f"bank {name!r}: layers {unknown[:5]} are not wrapped")
        bank = BankSet.create(
            name,
            {p: self.layers[p] for p in paths},
            num_slots=num_slots,
            r_max=r_max,
            trainable=trainable,
            input_groups=self.input_groups,
        )
        self.banks[name] = bank
        return bank

    def bank(self, name: str) -> BankSet:
        try:
            return self.banks[name]
        except KeyError:
            raise BankError(f"no bank set named {name!r} (have {sorted(self.banks)})") from None

    def make_routing(self, bank: str, slot_ids: torch.Tensor) -> Routing:
        bank_set = self.bank(bank)
        if not isinstance(slot_ids, torch.Tensor):
            raise RoutingError(f"slot_ids must be a torch.Tensor, got {type(slot_ids).__name__}")
        if slot_ids.device != bank_set.params.device:
            raise RoutingError(
                f"slot_ids are on device {slot_ids.device} but bank {bank!r} is on {bank_set.params.device}"
            )
        routing = build_routing(slot_ids, bank_set.scales, bank=bank)
        for slot in routing.active_slots():
            if bank_set.slots[slot] is None:
                raise RoutingError(
                    f"routing uses slot {slot}, which holds no adapter in bank {bank!r}"
                )
        return routing

    @contextmanager
    def routing(self, bank: str, slot_ids: torch.Tensor) -> Iterator[Routing]:
        """Forwards inside this scope route token t through slot slot_ids[t] of `bank`."""
        routing = self.make_routing(bank, slot_ids)
        with self.scope.use(routing):
            yield routing


@torch.no_grad()
def probe_input_groups(
    model: nn.Module, layers: Mapping[str, object], scope: RoutingScope
) -> list[list[str]]:
    """Which wrapped linears receive the very same input tensor, found by one 2-token base
    forward (read from the model's real data flow, not from module names). Skipped (no groups)
    for a model whose weights are not materialised (meta device)."""
    linears = {path: layer for path, layer in layers.items() if isinstance(layer, LoRALinear)}
    parameter = next(model.parameters(), None)
    if not linears or parameter is None or parameter.device.type == "meta":
        return []
    seen: list[tuple[torch.Tensor, list[str]]] = []

    def record(path: str) -> Callable[[nn.Module, tuple], None]:
        def hook(module: nn.Module, args: tuple) -> None:
            for tensor, paths in seen:
                if tensor is args[0]:
                    paths.append(path)
                    return
            seen.append((args[0], [path]))

        return hook

    handles = [layer.register_forward_pre_hook(record(path)) for path, layer in linears.items()]
    base_only = build_routing(
        torch.zeros(1, 2, dtype=torch.int64, device=parameter.device),
        torch.zeros(1, device=parameter.device),
        bank="",  # no layer carries a bank of this name: a pure base forward
    )
    try:
        with scope.use(base_only):
            model(
                input_ids=torch.zeros(1, 2, dtype=torch.int64, device=parameter.device),
                use_cache=False,
            )
    finally:
        for handle in handles:
            handle.remove()
    return [paths for _, paths in seen if len(paths) > 1]
