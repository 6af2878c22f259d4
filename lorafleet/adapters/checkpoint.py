"""Per-adapter training state: save one slot, restore it into any compatible bank.

A checkpoint is a directory:
- `state.json`: format version, the adapter's signature (rank, alpha, rsLoRA, target module
  paths, base model id), seed, optimizer step, last hyper-parameters, user metadata;
- `weights.safetensors`: `<module path>.A` [rank, in] and `<module path>.B` [out, rank], fp32;
- `optimizer.safetensors` (when saved with an optimizer): the optimizer's moments in the same
  per-layer form (AdamW: `exp_avg.<path>.A`, `exp_avg_sq.<path>.B`, ...; Dimuon:
  `momentum.<path>.A`, ...) plus the 0-d int64 `step`. `state.json` names the family under
  `optimizer`; a checkpoint without that field predates Dimuon and is AdamW.

Tensors are stored per layer, never as the bank's flat row, because the row layout depends on
the bank (r_max, which layers it wraps, their order): a checkpoint must restore into another
process, another slot, or a bank built differently, and stay bit-exact.

This module is the format as plain data (`TrainingState`: weights, moments, step,
hyper-parameters), its atomic read/write, and the bank-level steps every user shares: a slot's
row split into exact per-layer tensors, the checks that a state fits a bank, and a weights-only
restore (what a sampler needs). Turning optimizer state into checkpoint data and back is the
trainer's business (`lorafleet.train.checkpointing`), so this package knows no optimizer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from lorafleet.adapters.hparams import (
    OPTIMIZERS,
    AdamHParams,
    DimuonHParams,
    OptimHParams,
    hparams_from_dict,
)
from lorafleet.fsio import PathLike, atomic_directory, atomic_save_safetensors, atomic_write_json
from lorafleet.model.banks import AdapterSpec, BankSet

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MOMENTS",
    "OPTIMIZER_MOMENTS",
    "CheckpointError",
    "LayerTensors",
    "TrainingState",
    "apply_weights",
    "check_base_model",
    "check_fits",
    "read_training_state",
    "restore_weights",
    "split_row_exact",
    "write_training_state",
]

FORMAT = "lorafleet.training_state"
FORMAT_VERSION = 1
STATE_NAME = "state.json"
WEIGHTS_NAME = "weights.safetensors"
OPTIMIZER_NAME = "optimizer.safetensors"
MOMENTS = ("exp_avg", "exp_avg_sq")
OPTIMIZER_MOMENTS: dict[str, tuple[str, ...]] = {"adamw": MOMENTS, "dimuon": ("momentum",)}

LayerTensors = dict[str, tuple[torch.Tensor, torch.Tensor]]


class CheckpointError(ValueError):
    """A checkpoint that is malformed, or that does not fit the bank/base model it is restored into."""


@dataclass
class TrainingState:
    """A checkpoint as read from disk, validated on its own (not yet against a bank)."""

    spec: AdapterSpec  # targets = module paths, seed = the adapter's init seed
    base_model_id: str
    weights: LayerTensors  # path -> (A[rank, in], B[out, rank]), fp32
    moments: dict[str, LayerTensors] | None  # OPTIMIZER_MOMENTS[optimizer] -> per-layer
    step: int | None  # optimizer steps taken; None when saved without an optimizer
    hparams: OptimHParams | None
    metadata: dict[str, Any]
    created_at: str
    optimizer: str = "adamw"  # the family the adapter was trained with (OPTIMIZERS)


# ---------------------------------------------------------------------------------- save


def split_row_exact(
    bank: BankSet, row: torch.Tensor, rank: int, targets: tuple[str, ...], what: str
) -> LayerTensors:
    """Per-layer copies of a row, refusing rows the per-layer form would not restore exactly.

    Outside the adapter's rank and layers a row is zero by construction (see banks.py); if it
    is not, something wrote there and the checkpoint would silently differ from the slot.
    """
    residual = row.detach().clone()
    for A, B in bank.split_row(residual, rank, targets).values():
        A.zero_()
        B.zero_()
    if bool(residual.any()):
        raise CheckpointError(
            f"{what} has non-zero values outside the adapter's rank {rank} and target layers; "
            "refusing to write a checkpoint that would not restore exactly"
        )
    out: LayerTensors = {}
    for path, (A, B) in bank.split_row(row.detach(), rank, targets).items():
        if not (bool(torch.isfinite(A).all()) and bool(torch.isfinite(B).all())):
            raise CheckpointError(f"{what}: {path} contains NaN or inf; not saving it")
        out[path] = (A.clone(), B.clone())
    return out


def write_training_state(
    dest: PathLike,
    *,
    spec: AdapterSpec,
    base_model_id: str,
    weights: LayerTensors,
    moments: Mapping[str, LayerTensors] | None,
    step: int | None,
    hparams: OptimHParams | None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    optimizer: str = "adamw",
) -> Path:
    """Writes a checkpoint from its layout-free parts (per-layer A/B, per-layer moments), e.g.
    gathered from the ranks of a sharded trainer; `spec.targets` lists the layers in order."""
    if not isinstance(base_model_id, str) or not base_model_id:
        raise CheckpointError(f"base_model_id must be a non-empty string, got {base_model_id!r}")
    if optimizer not in OPTIMIZERS:
        raise CheckpointError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    hparams_type = AdamHParams if optimizer == "adamw" else DimuonHParams
    if hparams is not None and not isinstance(hparams, hparams_type):
        raise CheckpointError(
            f"hparams of a {optimizer} checkpoint must be {hparams_type.__name__} or None, "
            f"got {type(hparams).__name__}"
        )
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
        raise CheckpointError(f"metadata must be a dict, got {type(metadata).__name__}")
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"metadata is not plain JSON: {exc}") from exc
    if spec.targets is None or list(weights) != list(spec.targets):
        raise CheckpointError(
            f"weights cover layers {list(weights)[:3]}..., not the adapter's targets {spec.targets}"
        )
    if (moments is None) != (step is None):
        raise CheckpointError("optimizer moments and step go together (both or neither)")
    tensors = {
        f"{path}.{which}": t
        for path, (A, B) in weights.items()
        for which, t in (("A", A), ("B", B))
    }

    opt_tensors: dict[str, torch.Tensor] | None = None
    if moments is not None:
        assert step is not None
        opt_tensors = {"step": torch.tensor(int(step), dtype=torch.int64)}
        if sorted(moments) != sorted(OPTIMIZER_MOMENTS[optimizer]):
            raise CheckpointError(
                f"{optimizer} optimizer state is {list(OPTIMIZER_MOMENTS[optimizer])}, "
                f"got {sorted(moments)}"
            )
        for name in OPTIMIZER_MOMENTS[optimizer]:
            if list(moments[name]) != list(spec.targets):
                raise CheckpointError(
                    f"optimizer {name} covers other layers than the adapter's targets"
                )
            for path, (A, B) in moments[name].items():
                opt_tensors[f"{name}.{path}.A"] = A
                opt_tensors[f"{name}.{path}.B"] = B

    doc = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "signature": {
            "rank": spec.rank,
            "alpha": spec.alpha,
            "use_rslora": bool(spec.use_rslora),
            "targets": list(spec.targets),
            "base_model_id": base_model_id,
        },
        "seed": spec.seed,
        "step": step,
        "has_optimizer_state": opt_tensors is not None,
        "optimizer": optimizer,
        "hparams": hparams.to_dict() if hparams is not None else None,
        "metadata": metadata,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    dest = Path(dest)
    with atomic_directory(dest, overwrite=overwrite) as tmp:
        atomic_save_safetensors(tmp / WEIGHTS_NAME, tensors, metadata={"format": "pt"})
        if opt_tensors is not None:
            atomic_save_safetensors(tmp / OPTIMIZER_NAME, opt_tensors, metadata={"format": "pt"})
        atomic_write_json(tmp / STATE_NAME, doc)
    return dest


# ---------------------------------------------------------------------------------- read


def _field(doc: Mapping[str, Any], name: str, types: type | tuple[type, ...], where: str) -> Any:
    if name not in doc:
        raise CheckpointError(f"{where}: missing field {name!r}")
    value = doc[name]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise CheckpointError(f"{where}: field {name!r} has a wrong type: {value!r}")
    if not isinstance(value, types):
        raise CheckpointError(f"{where}: field {name!r} has a wrong type: {value!r}")
    return value


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path.parent}: missing {path.name}")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from exc


def _layer_tensors(
    tensors: Mapping[str, torch.Tensor], prefix: str, spec: AdapterSpec, where: Path
) -> LayerTensors:
    """Pulls `<prefix><path>.A/.B` for every target, checking dtype, rank and finiteness."""
    out: LayerTensors = {}
    assert spec.targets is not None
    for path in spec.targets:
        pair = []
        for which in ("A", "B"):
            key = f"{prefix}{path}.{which}"
            t = tensors[key]
            if t.dtype != torch.float32 or t.dim() != 2:
                raise CheckpointError(
                    f"{where}: {key} must be a 2-D float32 tensor, got {t.dtype} {tuple(t.shape)}"
                )
            rank_dim = t.shape[0] if which == "A" else t.shape[1]
            if rank_dim != spec.rank:
                raise CheckpointError(
                    f"{where}: {key} has shape {tuple(t.shape)}, which does not match rank {spec.rank}"
                )
            if not bool(torch.isfinite(t).all()):
                raise CheckpointError(f"{where}: {key} contains NaN or inf")
            pair.append(t)
        out[path] = (pair[0], pair[1])
    return out


def _check_keys(tensors: Mapping[str, torch.Tensor], expected: set[str], where: Path) -> None:
    missing = sorted(expected - set(tensors))
    unexpected = sorted(set(tensors) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: tensors do not match the signature: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def read_training_state(src: PathLike) -> TrainingState:
    """Reads and validates a checkpoint directory on its own terms (no bank needed)."""
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a checkpoint directory")
    state_path = src / STATE_NAME
    if not state_path.is_file():
        raise CheckpointError(f"{src}: missing {STATE_NAME}")
    try:
        doc = json.loads(state_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{state_path}: not valid JSON: {exc}") from exc
    where = str(state_path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(
            f"{where}: not a lorafleet training state (format {doc.get('format') if isinstance(doc, dict) else None!r})"
        )
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: format_version {version!r} is not supported (expected {FORMAT_VERSION})"
        )

    sig = _field(doc, "signature", dict, where)
    rank = _field(sig, "rank", int, where)
    alpha = _field(sig, "alpha", (int, float), where)
    use_rslora = _field(sig, "use_rslora", bool, where)
    targets = _field(sig, "targets", list, where)
    base_model_id = _field(sig, "base_model_id", str, where)
    if (
        not targets
        or not all(isinstance(t, str) and t for t in targets)
        or len(set(targets)) != len(targets)
    ):
        raise CheckpointError(
            f"{where}: signature targets must be distinct module paths, got {targets!r}"
        )
    if rank < 1 or not math.isfinite(alpha) or alpha <= 0:
        raise CheckpointError(f"{where}: signature has invalid rank {rank!r} or alpha {alpha!r}")
    seed = _field(doc, "seed", int, where)
    spec = AdapterSpec(
        rank=rank, alpha=alpha, use_rslora=use_rslora, seed=seed, targets=tuple(targets)
    )

    step = _field(doc, "step", (int, type(None)), where)
    has_opt = _field(doc, "has_optimizer_state", bool, where)
    if has_opt and (step is None or step < 0):
        raise CheckpointError(
            f"{where}: step must be a non-negative integer with optimizer state, got {step!r}"
        )
    optimizer = doc.get("optimizer", "adamw")
    if optimizer not in OPTIMIZERS:
        raise CheckpointError(f"{where}: optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    moment_names = OPTIMIZER_MOMENTS[optimizer]
    hparams_doc = _field(doc, "hparams", (dict, type(None)), where)
    try:
        hparams = hparams_from_dict(optimizer, hparams_doc) if hparams_doc is not None else None
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: invalid hparams: {exc}") from exc
    metadata = _field(doc, "metadata", dict, where)
    created_at = _field(doc, "created_at", str, where)

    weights_path = src / WEIGHTS_NAME
    raw = _load_tensors(weights_path)
    _check_keys(raw, {f"{p}.{w}" for p in targets for w in ("A", "B")}, weights_path)
    weights = _layer_tensors(raw, "", spec, weights_path)

    moments: dict[str, LayerTensors] | None = None
    opt_path = src / OPTIMIZER_NAME
    if has_opt:
        raw_opt = _load_tensors(opt_path)
        expected = {"step"} | {
            f"{m}.{p}.{w}" for m in moment_names for p in targets for w in ("A", "B")
        }
        _check_keys(raw_opt, expected, opt_path)
        saved_step = raw_opt["step"]
        if saved_step.dtype != torch.int64 or saved_step.dim() != 0 or int(saved_step) != step:
            raise CheckpointError(
                f"{opt_path}: step tensor {saved_step!r} does not match state.json step {step}"
            )
        moments = {m: _layer_tensors(raw_opt, f"{m}.", spec, opt_path) for m in moment_names}
        for path, pair in moments.get("exp_avg_sq", {}).items():
            if any(bool((t < 0).any()) for t in pair):
                raise CheckpointError(f"{opt_path}: exp_avg_sq of {path} has negative values")
        for name in moment_names:
            for path, (A, B) in moments[name].items():
                if A.shape != weights[path][0].shape or B.shape != weights[path][1].shape:
                    raise CheckpointError(
                        f"{opt_path}: {name} of {path} does not have the weights' shapes"
                    )
    elif opt_path.exists():
        raise CheckpointError(
            f"{src}: has {OPTIMIZER_NAME} but state.json says it holds no optimizer state"
        )

    return TrainingState(
        spec=spec,
        base_model_id=base_model_id,
        weights=weights,
        moments=moments,
        step=step,
        hparams=hparams,
        metadata=metadata,
        created_at=created_at,
        optimizer=optimizer,
    )


# ------------------------------------------------------------------------------- restore


def check_base_model(state: TrainingState, src: PathLike, base_model_id: str) -> None:
    """A state trained on one base model is meaningless on another: refuse it by name."""
    if state.base_model_id != base_model_id:
        raise CheckpointError(
            f"{src}: checkpoint was trained on base model {state.base_model_id!r}, "
            f"but it is being restored onto {base_model_id!r}"
        )


def check_fits(state: TrainingState, bank: BankSet, src: PathLike) -> None:
    """The adapter's rank, layers and layer shapes must exist in `bank`."""
    spec = state.spec
    if spec.rank > bank.r_max:
        raise CheckpointError(
            f"{src}: adapter rank {spec.rank} exceeds r_max {bank.r_max} of bank {bank.name!r}"
        )
    assert spec.targets is not None
    missing = [p for p in spec.targets if p not in bank.layers]
    if missing:
        raise CheckpointError(
            f"{src}: target layers {missing[:8]}{' ...' if len(missing) > 8 else ''} are not layers of bank "
            f"{bank.name!r} (it wraps {len(bank.layers)} layers, e.g. {list(bank.layers)[:3]})"
        )
    for path, (A, B) in state.weights.items():
        layer = bank.layers[path]
        if A.shape[1] != layer.in_features or B.shape[0] != layer.out_features:
            raise CheckpointError(
                f"{src}: {path} has A {tuple(A.shape)} / B {tuple(B.shape)}, but the layer is "
                f"{layer.in_features} -> {layer.out_features}"
            )


def restore_weights(
    src: PathLike, *, bank: BankSet, base_model_id: str, slot: int | None = None
) -> int:
    """Allocates a slot (any free one, or `slot`) holding the checkpointed adapter's weights,
    e.g. in an inference bank; returns it. The optimizer state, if saved, is not read into
    anything. All checks run before the slot is claimed; a failure leaves it free."""
    src = Path(src)
    return apply_weights(
        read_training_state(src), src, bank=bank, base_model_id=base_model_id, slot=slot
    )


def apply_weights(
    state: TrainingState,
    src: PathLike,
    *,
    bank: BankSet,
    base_model_id: str,
    slot: int | None = None,
) -> int:
    """`restore_weights` for a checkpoint already read (and validated) by the caller; `src`
    names it in errors."""
    check_base_model(state, src, base_model_id)
    check_fits(state, bank, src)
    slot = bank.allocate(state.spec, slot, initialize=False)
    try:
        bank.load_slot_weights(slot, state.weights)
    except BaseException:
        bank.free(slot)
        raise
    return slot
