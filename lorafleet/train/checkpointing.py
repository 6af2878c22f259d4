"""A trainer slot and its optimizer state <-> the checkpoint format of `lorafleet.adapters`.

The format is plain data (`adapters/checkpoint.py`); this module is the optimizer's side of
it: the moments of one `BankAdamW` or `BankDimuon` slot become per-layer tensors on save, and
go back into a slot's optimizer state of the same family on restore, bit-exact. It lives in
`train/` so that `adapters/` never imports the trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from lorafleet.adapters.checkpoint import (
    OPTIMIZER_MOMENTS,
    CheckpointError,
    LayerTensors,
    TrainingState,
    apply_weights,
    check_base_model,
    check_fits,
    read_training_state,
    split_row_exact,
    write_training_state,
)
from lorafleet.adapters.hparams import DimuonHParams, OptimHParams
from lorafleet.fsio import PathLike, atomic_directory, atomic_save_safetensors
from lorafleet.model.banks import BankSet
from lorafleet.train.dimuon import BankDimuon
from lorafleet.train.optim import BankAdamW
from lorafleet.train.slot_state import SlotState

BankOptimizer = BankAdamW | BankDimuon


def optimizer_family(optimizer: BankOptimizer) -> str:
    """The checkpoint's name (`adapters.hparams.OPTIMIZERS`) of a bank optimizer's family."""
    return "dimuon" if isinstance(optimizer, BankDimuon) else "adamw"


__all__ = [
    "BankOptimizer",
    "apply_training_state",
    "optimizer_family",
    "read_slot_state",
    "restore_training_state",
    "save_training_state",
    "write_slot_state",
]

SLOT_STATE_DIR = "state"  # the checkpoint, in the format above
GRADIENT_NAME = "gradient.safetensors"  # the pending gradient, per layer like the weights


def _check_optimizer(bank: BankSet, optimizer: BankOptimizer | None) -> None:
    if optimizer is None:
        return
    if optimizer.params.data_ptr() != bank.params.data_ptr() or tuple(
        optimizer.params.shape
    ) != tuple(bank.params.shape):
        raise CheckpointError(
            f"the optimizer does not manage bank {bank.name!r} (built over other params)"
        )


def save_training_state(
    dest: PathLike,
    *,
    bank: BankSet,
    slot: int,
    optimizer: BankOptimizer | None,
    base_model_id: str,
    hparams: OptimHParams | None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes the adapter in `slot` (and its optimizer state, if `optimizer` is given) to `dest`.

    A gradient accumulated but not yet stepped is not saved: checkpoints are taken between
    optimizer steps, and a restored slot starts with no pending gradient.
    """
    _check_optimizer(bank, optimizer)
    info = bank.check_slot(slot)
    rank, targets = info.spec.rank, info.targets
    weights = split_row_exact(bank, bank.params[slot], rank, targets, f"slot {slot} weights")
    moments: dict[str, LayerTensors] | None = None
    step: int | None = None
    family = "adamw" if optimizer is None else optimizer_family(optimizer)
    if optimizer is not None:
        state = optimizer.slot_state(slot)
        step = int(state["step"])
        moments = {
            name: split_row_exact(bank, state[name], rank, targets, f"slot {slot} optimizer {name}")
            for name in OPTIMIZER_MOMENTS[family]
        }
    return write_training_state(
        dest,
        spec=info.spec,
        base_model_id=base_model_id,
        weights=weights,
        moments=moments,
        step=step,
        hparams=hparams,
        metadata=metadata,
        overwrite=overwrite,
        optimizer=family if optimizer is not None else _hparams_family(hparams),
    )


def _hparams_family(hparams: OptimHParams | None) -> str:
    """Without optimizer state, the recorded hyper-parameters still name the family."""
    return "dimuon" if isinstance(hparams, DimuonHParams) else "adamw"


def restore_training_state(
    src: PathLike,
    *,
    bank: BankSet,
    optimizer: BankOptimizer | None,
    base_model_id: str,
    slot: int | None = None,
    load_optimizer: bool = True,
) -> int:
    """Allocates a slot (any free one, or `slot`) holding the checkpointed adapter; returns it.

    With an optimizer, the slot's AdamW state is the saved one (or fresh, when not saved or
    `load_optimizer` is false). `optimizer=None` restores weights only, e.g. into an
    inference bank. All checks run before the slot is claimed; a failure leaves it free.
    """
    src = Path(src)
    return apply_training_state(
        read_training_state(src),
        src,
        bank=bank,
        optimizer=optimizer,
        base_model_id=base_model_id,
        slot=slot,
        load_optimizer=load_optimizer,
    )


def apply_training_state(
    state: TrainingState,
    src: PathLike,
    *,
    bank: BankSet,
    optimizer: BankOptimizer | None,
    base_model_id: str,
    slot: int | None = None,
    load_optimizer: bool = True,
) -> int:
    """`restore_training_state` for a checkpoint already read (and validated) by the caller, so
    a server that checked it before queueing the load does not parse it again; `src` names it
    in errors."""
    if optimizer is None:
        return apply_weights(state, src, bank=bank, base_model_id=base_model_id, slot=slot)
    check_base_model(state, src, base_model_id)
    _check_optimizer(bank, optimizer)
    check_fits(state, bank, src)
    spec = state.spec
    assert spec.targets is not None
    slot_state: dict[str, torch.Tensor] | None = None
    if load_optimizer and state.moments is not None:
        assert state.step is not None
        family = optimizer_family(optimizer)
        if state.optimizer != family:
            raise CheckpointError(
                f"{src}: checkpoint holds {state.optimizer} optimizer state, but it is being "
                f"restored under the {family} optimizer; an adapter's optimizer is fixed"
            )
        slot_state = {
            name: bank.join_row(state.moments[name], spec.rank, spec.targets)
            for name in OPTIMIZER_MOMENTS[family]
        }
        slot_state["step"] = torch.tensor(state.step, dtype=torch.int64)

    slot = bank.allocate(spec, slot, initialize=False)
    try:
        bank.load_slot_weights(slot, state.weights)
        optimizer.reset_slot(slot)
        if slot_state is not None:
            optimizer.load_slot_state(slot, slot_state)
    except BaseException:
        optimizer.reset_slot(slot)
        bank.free(slot)
        raise
    return slot


# ------------------------------------------------------------------ a paged-out slot


def write_slot_state(dest: PathLike, state: SlotState, *, bank: BankSet, base_model_id: str) -> int:
    """Writes an exported slot (`TrainEngine.export_slot`) to `dest` atomically, as a training
    checkpoint (`dest/state`) plus its pending gradient (`dest/gradient.safetensors`), which no
    checkpoint holds; returns the bytes written. `bank` gives the row layout."""
    spec = state.spec
    assert spec.targets is not None  # resolved by the bank that exported it
    targets = tuple(spec.targets)
    what = f"paged adapter {dest}"
    weights = split_row_exact(bank, state.params, spec.rank, targets, f"{what} weights")
    moments = {
        name: split_row_exact(bank, row, spec.rank, targets, f"{what} optimizer {name}")
        for name, row in state.moments.items()
    }
    grads = None
    if state.grads is not None:
        grads = split_row_exact(bank, state.grads, spec.rank, targets, f"{what} gradient")
    with atomic_directory(dest) as tmp:
        write_training_state(
            tmp / SLOT_STATE_DIR,
            spec=spec,
            base_model_id=base_model_id,
            weights=weights,
            moments=moments,
            step=state.step,
            hparams=state.hparams,
            metadata={"pending_gradient": state.pending},
            optimizer=state.optimizer,
        )
        if grads is not None:
            tensors = {
                f"{p}.{w}": t for p, (A, B) in grads.items() for w, t in (("A", A), ("B", B))
            }
            atomic_save_safetensors(tmp / GRADIENT_NAME, tensors, metadata={"format": "pt"})
        written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
    return written


def read_slot_state(src: PathLike, *, bank: BankSet, base_model_id: str) -> SlotState:
    """Reads what `write_slot_state` wrote back into the bank's row layout (host rows)."""
    src = Path(src)
    state = read_training_state(src / SLOT_STATE_DIR)
    where = src / SLOT_STATE_DIR
    check_base_model(state, where, base_model_id)
    check_fits(state, bank, where)
    spec = state.spec
    assert spec.targets is not None
    if state.moments is None or state.step is None:
        raise CheckpointError(f"{where}: a paged adapter must hold its optimizer state")
    pending = state.metadata.get("pending_gradient")
    if not isinstance(pending, bool):
        raise CheckpointError(f"{where}: metadata pending_gradient must be a bool, got {pending!r}")
    grads = None
    grad_path = src / GRADIENT_NAME
    if grad_path.is_file():
        try:
            raw = load_file(grad_path)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{grad_path}: not a readable safetensors file: {exc}") from exc
        expected = {f"{p}.{w}" for p in spec.targets for w in ("A", "B")}
        if set(raw) != expected:
            raise CheckpointError(f"{grad_path}: tensors do not match the adapter's layers")
        layers = {p: (raw[f"{p}.A"], raw[f"{p}.B"]) for p in spec.targets}
        grads = _host_row(bank, layers, spec.rank, spec.targets)
    return SlotState(
        spec=spec,
        optimizer=state.optimizer,
        params=_host_row(bank, state.weights, spec.rank, spec.targets),
        moments={
            name: _host_row(bank, state.moments[name], spec.rank, spec.targets)
            for name in OPTIMIZER_MOMENTS[state.optimizer]
        },
        step=state.step,
        pending=pending,
        grads=grads,
        hparams=state.hparams,
    )


def _host_row(
    bank: BankSet, tensors: LayerTensors, rank: int, targets: tuple[str, ...]
) -> torch.Tensor:
    return bank.join_row(tensors, rank, targets).cpu()
