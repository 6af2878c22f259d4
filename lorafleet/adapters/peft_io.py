"""PEFT-format LoRA directories in and out of a bank slot.

The exchange format with the rest of the ecosystem (PEFT, vLLM, the HF Hub) is what
`PeftModel.save_pretrained` writes for a LoRA on a causal LM: `adapter_config.json` plus
`adapter_model.safetensors` with keys `base_model.model.<module path>.lora_{A,B}.weight`.

Fused MoE experts (3-D parameters, see model/experts.py) are written in one of two layouts:
- "peft": PEFT's `target_parameters` form. One `lora_A[E * r, in]` / `lora_B[out, r * E]` pair
  per targeted parameter (A expert-major, B rank-major, as PEFT's ParamWrapper reshapes them),
  under the experts module's path; a second targeted parameter of the same module sits one
  `base_layer.` deeper, because PEFT nests one wrapper per parameter (declaration order, the
  first innermost). PEFT loads it; so does vLLM for architectures it keeps fused (3-D).
- "checkpoint": the base checkpoint's own per-expert 2-D modules (e.g. `experts.3.gate_proj`
  and `experts.3.up_proj`, sharing expert 3's A, each with its rows of B), as transformers'
  save-time conversion names them. That is the layout vLLM loads for architectures whose
  checkpoints store experts one by one (Qwen3-MoE, Mixtral). A projection the checkpoint
  itself stores fused is written in the "peft" form.

Imports are strict: PEFT has many LoRA variants (DoRA, rank patterns, bias training, PiSSA
residual bases, ...) that load without complaint as plain LoRA weights but compute something
else. Anything this engine does not compute is rejected by name instead of silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from lorafleet.fsio import PathLike, atomic_directory, atomic_save_safetensors, atomic_write_json
from lorafleet.model.banks import AdapterSpec, BankSet, SlotInfo, layer_experts
from lorafleet.model.experts import ExpertProjection, ExpertsError

__all__ = [
    "CONFIG_NAME",
    "EXPERT_LAYOUTS",
    "WEIGHTS_NAME",
    "ExportableBank",
    "PeftFormatError",
    "export_peft",
    "import_peft",
    "peft_config",
    "read_peft",
]

EXPERT_LAYOUTS = ("peft", "checkpoint")
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# The PEFT release whose LoraConfig fields (and their defaults) the export reproduces.
PEFT_FORMAT_VERSION = "0.21.2"

# LoraConfig.to_dict() of peft 0.21.2 for a default LoRA, minus the per-adapter fields.
_PEFT_DEFAULTS: dict[str, Any] = {
    "alora_invocation_tokens": None,
    "alpha_pattern": {},
    "arrow_config": None,
    "auto_mapping": None,
    "bias": "none",
    "corda_config": None,
    "ensure_weight_tying": False,
    "eva_config": None,
    "exclude_modules": None,
    "fan_in_fan_out": False,
    "inference_mode": True,
    "init_lora_weights": True,
    "kasa_config": None,
    "layer_replication": None,
    "layers_pattern": None,
    "layers_to_transform": None,
    "loftq_config": {},
    "lora_bias": False,
    "lora_dropout": 0.0,
    "lora_ga_config": None,
    "megatron_config": None,
    "megatron_core": "megatron.core",
    "modules_to_save": None,
    "monteclora_config": None,
    "peft_type": "LORA",
    "peft_version": PEFT_FORMAT_VERSION,
    "qalora_group_size": 16,
    "rank_pattern": {},
    "revision": None,
    "target_parameters": None,
    "task_type": "CAUSAL_LM",
    "trainable_token_indices": None,
    "use_bdlora": None,
    "use_dora": False,
    "use_qalora": False,
    "velora_config": None,
}

# Fields whose value does not change what a loaded adapter computes (bookkeeping, module
# selection already reflected in the weight file, training-only knobs, or settings that only
# matter together with a feature checked elsewhere).
_IGNORED_FIELDS = frozenset(
    {
        "auto_mapping",
        "base_model_name_or_path",
        "ensure_weight_tying",
        "eva_config",
        "exclude_modules",
        "inference_mode",
        "layers_pattern",
        "layers_to_transform",
        "loftq_config",
        "lora_dropout",
        "megatron_core",
        "peft_version",
        "qalora_group_size",
        "revision",
        "target_modules",
        "task_type",
    }
)
_CHECKED_FIELDS = frozenset(
    {"peft_type", "r", "lora_alpha", "use_rslora", "init_lora_weights", "target_parameters"}
)
# init_lora_weights values that only pick the starting point. The others (pissa, olora, corda,
# loftq, lora_ga, mica, ...) go with a modified base model or a different forward.
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")

_LORA_KEY = re.compile(r"(?P<path>.+)\.lora_(?P<which>[AB])(?:\.(?P<adapter>[^.]+))?\.weight")
_BASE_KEY = re.compile(r"(?P<path>.+)\.base_layer\.weight")


class PeftFormatError(ValueError):
    """A PEFT adapter directory that is malformed or uses a feature this engine lacks."""


def _json_number(value: float) -> int | float:
    """PEFT writes lora_alpha as given (usually an int); keep integral alphas integral."""
    return int(value) if float(value).is_integer() else float(value)


def peft_config(
    spec: AdapterSpec,
    targets: list[str],
    base_model_name_or_path: str,
    target_parameters: list[str] | None = None,
) -> dict[str, Any]:
    """The adapter_config.json PEFT would write for this adapter."""
    config = dict(_PEFT_DEFAULTS)
    config.update(
        {
            "base_model_name_or_path": base_model_name_or_path,
            "lora_alpha": _json_number(spec.alpha),
            "r": spec.rank,
            "target_modules": list(targets) if targets or not target_parameters else None,
            "target_parameters": list(target_parameters) if target_parameters else None,
            "use_rslora": bool(spec.use_rslora),
        }
    )
    return config


# ------------------------------------------------------------------------ expert layouts


def _peft_param_match(path: str, names: list[str]) -> bool:
    return any(path == name or path.endswith("." + name) for name in names)


def _nesting_prefix(projection: ExpertProjection, targeted: list[str]) -> str:
    """Key prefix of a fused projection in PEFT's nested-ParamWrapper layout: the first
    targeted parameter (declaration order) is the innermost wrapper."""
    module_path = projection.module_path
    order = [p for p in projection.sibling_params() if f"{module_path}.{p}" in targeted]
    depth = len(order) - 1 - order.index(projection.param)
    return f"{module_path}." + "base_layer." * depth


def _split_experts(
    A: torch.Tensor, B: torch.Tensor, experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bank form (experts side by side: A[r, E * in], B[E * out, r]) -> A[E, r, in], B[E, out, r]."""
    rank = A.shape[0]
    return A.view(rank, experts, -1).transpose(0, 1), B.view(experts, -1, rank)


def _join_experts(A_e: torch.Tensor, B_e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `_split_experts`."""
    experts, rank, in_features = A_e.shape
    A = A_e.transpose(0, 1).reshape(rank, experts * in_features)
    B = B_e.reshape(experts * B_e.shape[1], rank)
    return A.contiguous(), B.contiguous()


class ExportableBank(Protocol):
    """What an export reads of a bank: its layers and one slot's spec and weights (a `BankSet`,
    or a sharded trainer's mirror of one that fetches the weights from the ranks)."""

    @property
    def name(self) -> str: ...

    @property
    def layers(self) -> Mapping[str, object]: ...

    def check_slot(self, slot: int) -> SlotInfo: ...

    def slot_weights(self, slot: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]: ...


def _expert_tensors(
    bank: ExportableBank, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]], layout: str
) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """Tensors (without the `base_model.model.` prefix) for the expert layers of one slot, plus
    the per-expert module names and the fused parameter paths they cover."""
    tensors: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    fused: dict[str, ExpertProjection] = {}
    for path, (A, B) in weights.items():
        projection = bank.layers[path]
        assert isinstance(projection, ExpertProjection)
        names = None
        if layout == "checkpoint":
            try:
                names = projection.checkpoint_names()
            except ExpertsError as exc:
                raise ValueError(
                    f"cannot write {path} in the base checkpoint's layout: {exc}"
                ) from exc
        if names is None:
            fused[path] = projection
            continue
        A_e, B_e = _split_experts(A, B, projection.num_experts)
        for name in names:
            start, end = name.rows
            tensors[f"{name.module}.lora_A.weight"] = A_e[name.expert].contiguous()
            tensors[f"{name.module}.lora_B.weight"] = B_e[name.expert, start:end].contiguous()
            modules.append(name.module)
    targeted = sorted(fused)
    for path, projection in fused.items():
        A, B = weights[path]
        A_e, B_e = _split_experts(A, B, projection.num_experts)
        prefix = _nesting_prefix(projection, targeted)
        # PEFT's ParamWrapper: lora_A [E * r, in] expert-major rows (e * r + j), lora_B
        # [out, r * E] rank-major columns (j * E + e).
        tensors[f"{prefix}lora_A.weight"] = A_e.reshape(-1, A_e.shape[2]).contiguous()
        tensors[f"{prefix}lora_B.weight"] = (
            B_e.permute(1, 2, 0).reshape(B_e.shape[1], -1).contiguous()
        )
    return tensors, sorted(modules), targeted


def _bank_expert_weights(
    bank: BankSet,
    config: Mapping[str, Any],
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
    src: Path,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Rewrites expert LoRA read from a file (either layout) into bank paths and bank form;
    dense entries pass through. Keys that name no expert projection are left for the dense
    checks to reject."""
    projections = [layer for layer in bank.layers.values() if isinstance(layer, ExpertProjection)]
    if not projections:
        return weights
    r = int(config["r"])
    out = dict(weights)
    targets = config.get("target_parameters") or []
    # "peft" layout: nested keys under the experts module path.
    by_module: dict[str, list[ExpertProjection]] = {}
    for projection in projections:
        by_module.setdefault(projection.module_path, []).append(projection)
    converted: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if targets:
        for module_path, members in by_module.items():
            keys = {
                k: v
                for k, v in weights.items()
                if re.fullmatch(re.escape(module_path) + r"(\.base_layer)*", k)
            }
            if not keys:
                continue
            params = [
                p
                for p in members[0].sibling_params()
                if _peft_param_match(f"{module_path}.{p}", targets)
            ]
            if len(keys) != len(params):
                raise PeftFormatError(
                    f"{src}: {len(keys)} LoRA pairs under {module_path} but target_parameters selects "
                    f"{len(params)} of its expert parameters ({params})"
                )
            by_param = {p.param: p for p in members}
            for key, (A, B) in keys.items():
                depth = key.count(".base_layer")
                if depth >= len(params):
                    raise PeftFormatError(
                        f"{src}: {key} is nested deeper than the {len(params)} targeted parameters"
                    )
                param = params[len(params) - 1 - depth]
                if param not in by_param:
                    raise PeftFormatError(
                        f"{src}: {module_path}.{param} is not a layer of bank {bank.name!r}"
                    )
                projection = by_param[param]
                experts = projection.num_experts
                if A.shape[0] != experts * r or B.shape[1] != experts * r:
                    raise PeftFormatError(
                        f"{src}: {key} has lora_A {tuple(A.shape)} / lora_B {tuple(B.shape)}, expected "
                        f"({experts} experts x r={r}, in) / (out, r x experts)"
                    )
                converted[projection.path] = _join_experts(
                    A.view(experts, r, -1), B.view(B.shape[0], r, experts).permute(2, 0, 1)
                )
                del out[key]
    # "checkpoint" layout: per-expert 2-D modules.
    pieces: dict[str, dict[int, list[tuple[tuple[int, int], torch.Tensor, torch.Tensor, str]]]] = {}
    owners: dict[str, ExpertProjection] = {}
    for projection in projections:
        try:
            names = projection.checkpoint_names()
        except ExpertsError:
            names = None
        for name in names or []:
            if name.module in weights:
                A, B = out.pop(name.module)
                pieces.setdefault(projection.path, {}).setdefault(name.expert, []).append(
                    (name.rows, A, B, name.module)
                )
                owners[projection.path] = projection
    for path, per_expert in pieces.items():
        if path in converted:
            raise PeftFormatError(f"{src}: {path} is given both fused and per expert")
        projection = owners[path]
        A_e = torch.zeros(projection.num_experts, r, projection.expert_in_features)
        B_e = torch.zeros(projection.num_experts, projection.expert_out_features, r)
        for expert, parts in per_expert.items():
            first = parts[0]
            for rows, A, B, module in parts:
                if not torch.equal(A, first[1]):
                    raise PeftFormatError(
                        f"{src}: {module} and {first[3]} have different lora_A, but they are one fused "
                        f"projection ({path}) whose experts share one A; only such adapters import exactly"
                    )
                if B.shape[0] != rows[1] - rows[0]:
                    raise PeftFormatError(
                        f"{src}: {module} lora_B has {B.shape[0]} rows, the checkpoint module has {rows[1] - rows[0]}"
                    )
                B_e[expert, rows[0] : rows[1]] = B
            A_e[expert] = first[1]
        converted[path] = _join_experts(A_e, B_e)
    out.update(converted)
    return out


def export_peft(
    bank: ExportableBank,
    slot: int,
    dest: PathLike,
    *,
    base_model_name_or_path: str,
    dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
    expert_layout: str = "peft",
) -> Path:
    """Writes the adapter in `slot` as a PEFT LoRA directory that PEFT and vLLM load as is.

    Module paths are written in full in `target_modules`, which PEFT matches exactly, so a
    subset of layers (one block's q_proj, lm_head only) round-trips without regex tricks.
    Expert LoRA goes in `expert_layout` ("peft" or "checkpoint", see the module docstring).
    """
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    if not isinstance(base_model_name_or_path, str) or not base_model_name_or_path:
        raise ValueError(
            f"base_model_name_or_path must be a non-empty string, got {base_model_name_or_path!r}"
        )
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}"
        )
    info = bank.check_slot(slot)
    weights = bank.slot_weights(slot)
    tensors: dict[str, torch.Tensor] = {}
    dense: list[str] = []
    expert_weights = {}
    for path, (A, B) in weights.items():
        for which, t in (("A", A), ("B", B)):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(
                    f"slot {slot} of bank {bank.name!r}: {path} {which} contains NaN or inf; not exporting it"
                )
        if layer_experts(bank.layers[path]) != 1:
            expert_weights[path] = (A, B)
            continue
        dense.append(path)
        for which, t in (("A", A), ("B", B)):
            tensors[f"{_PREFIX}{path}.lora_{which}.weight"] = t.to(dtype)
    target_parameters: list[str] = []
    if expert_weights:
        expert_tensors, modules, target_parameters = _expert_tensors(
            bank, expert_weights, expert_layout
        )
        tensors.update({f"{_PREFIX}{key}": t.to(dtype) for key, t in expert_tensors.items()})
        dense.extend(modules)
    config = peft_config(info.spec, dense, base_model_name_or_path, target_parameters)
    dest = Path(dest)
    with atomic_directory(dest, overwrite=overwrite) as tmp:
        atomic_write_json(tmp / CONFIG_NAME, config)
        atomic_save_safetensors(tmp / WEIGHTS_NAME, tensors, metadata={"format": "pt"})
    return dest


# ------------------------------------------------------------------------------- reading


def _is_default(value: Any) -> bool:
    return value is None or value is False or value in ({}, [], "")


def _validate_config(config: Any, where: Path) -> None:
    if not isinstance(config, dict):
        raise PeftFormatError(f"{where}: expected a JSON object, got {type(config).__name__}")
    if config.get("peft_type") != "LORA":
        raise PeftFormatError(
            f"{where}: peft_type is {config.get('peft_type')!r}, only 'LORA' is supported"
        )
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise PeftFormatError(f"{where}: r must be a positive integer, got {r!r}")
    alpha = config.get("lora_alpha")
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise PeftFormatError(
            f"{where}: lora_alpha must be a positive finite number, got {alpha!r}"
        )
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise PeftFormatError(f"{where}: use_rslora must be true or false, got {use_rslora!r}")
    init = config.get("init_lora_weights", True)
    if not any(init is v if isinstance(v, bool) else init == v for v in _PLAIN_INITS):
        raise PeftFormatError(
            f"{where}: init_lora_weights={init!r} is not supported (such adapters need a modified "
            f"base model or a different forward); supported: {list(_PLAIN_INITS)}"
        )
    target_parameters = config.get("target_parameters")
    if target_parameters is not None and (
        not isinstance(target_parameters, list)
        or not all(isinstance(t, str) and t for t in target_parameters)
    ):
        raise PeftFormatError(
            f"{where}: target_parameters must be a list of parameter names, got {target_parameters!r}"
        )
    bias = config.get("bias", "none")
    if bias != "none":
        raise PeftFormatError(f"{where}: bias={bias!r} is not supported (only 'none')")
    for name, value in sorted(config.items()):
        if name in _IGNORED_FIELDS or name in _CHECKED_FIELDS or name == "bias":
            continue
        if not _is_default(value) and value != _PEFT_DEFAULTS.get(name):
            raise PeftFormatError(
                f"{where}: {name}={value!r} is not supported (only plain LoRA can be imported)"
            )


def _parse_key(key: str) -> tuple[str, str, str | None]:
    """(module path, 'A' | 'B' | 'base', adapter name or None) for one tensor name."""
    bare = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
    match = _LORA_KEY.fullmatch(bare)
    if match is not None:
        return match["path"], match["which"], match["adapter"]
    match = _BASE_KEY.fullmatch(bare)
    if match is not None:
        return match["path"], "base", None
    raise KeyError(key)


def _is_param_wrapper(path: str, config: Mapping[str, Any]) -> bool:
    """Whether a key's module path is a module whose parameters target_parameters selects."""
    module = re.sub(r"(\.base_layer)+$", "", path)
    for target in config.get("target_parameters") or []:
        owner = target.rpartition(".")[0]
        if owner and (module == owner or module.endswith("." + owner)):
            return True
    return False


def read_peft(src: PathLike) -> tuple[dict[str, Any], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Reads and validates a PEFT LoRA directory: (config, {module path: (A[r, in], B[out, r])}).

    Tensors come back as fp32 (exact for bf16/fp16 files). Both key spellings are accepted:
    `...lora_A.weight` (what save_pretrained writes) and `...lora_A.<adapter>.weight` (a raw
    state_dict), as long as the file holds a single adapter.
    """
    config, weights, _ = _read(Path(src))
    return config, weights


def _read(
    src: Path,
) -> tuple[dict[str, Any], dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
    config_path, weights_path = src / CONFIG_NAME, src / WEIGHTS_NAME
    if not src.is_dir():
        raise PeftFormatError(f"{src} is not a directory")
    for required in (config_path, weights_path):
        if not required.is_file():
            hint = " (only safetensors weights are supported)" if required is weights_path else ""
            raise PeftFormatError(f"{src}: missing {required.name}{hint}")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PeftFormatError(f"{config_path}: not valid JSON: {exc}") from exc
    _validate_config(config, config_path)
    try:
        raw = load_file(weights_path)
    except (SafetensorError, OSError) as exc:
        raise PeftFormatError(f"{weights_path}: not a readable safetensors file: {exc}") from exc

    r = config["r"]
    parts: dict[str, dict[str, torch.Tensor]] = {}
    bases: dict[str, torch.Tensor] = {}
    adapters: set[str | None] = set()
    unexpected: list[str] = []
    for key, tensor in raw.items():
        try:
            path, which, adapter = _parse_key(key)
        except KeyError:
            unexpected.append(key)
            continue
        if which == "base":
            bases[path] = tensor
            continue
        adapters.add(adapter)
        parts.setdefault(path, {})[which] = tensor
    if unexpected:
        raise PeftFormatError(
            f"{weights_path}: tensors that are not plain LoRA A/B weights: {sorted(unexpected)[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}"
        )
    if len(adapters) > 1:
        names = sorted("(none)" if a is None else a for a in adapters)
        raise PeftFormatError(f"{weights_path}: holds several adapters {names}; expected one")
    if not parts:
        raise PeftFormatError(f"{weights_path}: contains no LoRA weights")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for path in sorted(parts):
        pair = parts[path]
        missing = [w for w in ("A", "B") if w not in pair]
        if missing:
            raise PeftFormatError(f"{weights_path}: {path} has no lora_{missing[0]} weight")
        A, B = pair["A"], pair["B"]
        for which, t in (("A", A), ("B", B)):
            if not t.is_floating_point():
                raise PeftFormatError(
                    f"{weights_path}: {path} lora_{which} has dtype {t.dtype}, expected a float type"
                )
        # A fused-experts parameter (target_parameters) holds E experts' pairs: [E * r, in].
        rows = (
            A.shape[0]
            if A.dim() == 2 and _is_param_wrapper(path, config) and A.shape[0] % r == 0
            else r
        )
        if A.dim() != 2 or A.shape[0] != rows:
            raise PeftFormatError(
                f"{weights_path}: {path} lora_A has shape {tuple(A.shape)}, expected (r={r}, in_features)"
            )
        if B.dim() != 2 or B.shape[1] != rows:
            raise PeftFormatError(
                f"{weights_path}: {path} lora_B has shape {tuple(B.shape)}, expected (out_features, r={rows})"
            )
        A32, B32 = A.to(torch.float32), B.to(torch.float32)
        for which, t in (("A", A32), ("B", B32)):
            if not bool(torch.isfinite(t).all()):
                raise PeftFormatError(f"{weights_path}: {path} lora_{which} contains NaN or inf")
        weights[path] = (A32, B32)
    orphan_bases = sorted(set(bases) - set(weights))
    if orphan_bases:
        raise PeftFormatError(
            f"{weights_path}: full base weights saved for non-LoRA modules {orphan_bases[:8]}"
        )
    return config, weights, bases


def _same_base(saved: torch.Tensor, base: torch.Tensor) -> bool:
    if saved.shape != base.shape:
        return False
    if torch.equal(saved.to(base.device, base.dtype), base):
        return True
    return torch.equal(saved, base.detach().to("cpu", saved.dtype))


def _check_against_bank(
    bank: BankSet,
    config: Mapping[str, Any],
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    bases: Mapping[str, torch.Tensor],
    src: Path,
) -> None:
    if config["r"] > bank.r_max:
        raise PeftFormatError(
            f"{src}: r={config['r']} exceeds r_max {bank.r_max} of bank {bank.name!r}"
        )
    unknown = [p for p in weights if p not in bank.layers]
    if unknown:
        raise PeftFormatError(
            f"{src}: modules {unknown[:8]}{' ...' if len(unknown) > 8 else ''} are not layers of bank "
            f"{bank.name!r} (it wraps {len(bank.layers)} layers, e.g. {list(bank.layers)[:3]})"
        )
    for path, (A, B) in weights.items():
        layer = bank.layers[path]
        if A.shape[1] != layer.in_features:
            raise PeftFormatError(
                f"{src}: {path} lora_A has shape {tuple(A.shape)}, the layer has in_features={layer.in_features}"
            )
        if B.shape[0] != layer.out_features:
            raise PeftFormatError(
                f"{src}: {path} lora_B has shape {tuple(B.shape)}, the layer has out_features={layer.out_features}"
            )
    for path, saved in bases.items():
        # PEFT saves lm_head/embed_tokens base weights alongside the adapter when they are
        # targeted (save_embedding_layers); harmless only if they are the frozen base's own.
        if not _same_base(saved, bank.layers[path].weight):
            raise PeftFormatError(
                f"{src}: {path}.base_layer.weight differs from this base model's {path} weight; "
                f"adapters that change base weights are not supported"
            )


def import_peft(bank: BankSet, src: PathLike, *, slot: int | None = None, seed: int = 0) -> int:
    """Loads a PEFT LoRA directory into a slot (any free one, or `slot`); returns the slot.

    The adapter targets exactly the modules present in the weight file. Everything is
    validated before a slot is claimed, so a rejected directory leaves the bank unchanged.
    """
    src = Path(src)
    config, weights, bases = _read(src)
    weights = _bank_expert_weights(bank, config, weights, src)
    _check_against_bank(bank, config, weights, bases, src)
    spec = AdapterSpec(
        rank=config["r"],
        alpha=float(config["lora_alpha"]),
        use_rslora=bool(config.get("use_rslora", False)),
        seed=seed,
        targets=tuple(weights),
    )
    slot = bank.allocate(spec, slot, initialize=False)
    try:
        bank.load_slot_weights(slot, weights)
    except BaseException:
        bank.free(slot)
        raise
    return slot
