"""The server's view of a sharded trainer: the `TrainEngine` interface over remote ranks.

`DistTrainEngine` answers every call the server makes on a `TrainEngine` (prepare, create/free,
forward, forward_backward, optim_step, save/load state, PEFT export) by sending commands to the
ranks, so the server code does not change with the placement. Its `bank` is a `RemoteBank`:
the slot table is mirrored here (validation and slot choice stay local and instant), and adapter
tensors are fetched from rank 0 only when something needs them (export, publish, canary),
never the base.

Slot choice is made here and sent with each command, so every rank allocates the same slot.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from lorafleet.adapters.checkpoint import TrainingState, read_training_state, write_training_state
from lorafleet.adapters.hparams import OptimHParams
from lorafleet.adapters.peft_io import export_peft, read_peft
from lorafleet.model.banks import AdapterSpec, BankError, SlotInfo, SlotTable
from lorafleet.train.canary_probe import trainer_canary_logprobs
from lorafleet.train.engine import BatchOutput
from lorafleet.train.items import ItemLimits, PreparedItem, TrainItem
from lorafleet.train.optim import AdamHParams

_ADAMW_ONLY = (
    "the sharded (FSDP) trainer supports only the adamw optimizer: its ranks shard AdamW "
    "moments by slot and have no Dimuon state; run a single-process server for dimuon"
)


class RankClient(Protocol):
    """A transport to the ranks (torchrun socket or Ray actors)."""

    info: dict[str, Any]

    def call(self, name: str, **kwargs: Any) -> Any: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LayerShape:
    """What the server needs to know of a wrapped layer: its shape, not its weights."""

    in_features: int
    out_features: int
    num_experts: int = 1


class _RowFetcher:
    """`bank.params[slot]` for a remote bank: the slot's flat row, fetched from rank 0."""

    def __init__(self, bank: RemoteBank):
        self._bank = bank

    def __getitem__(self, slot: int) -> torch.Tensor:
        return self._bank.slot_row(slot)


class RemoteBank(SlotTable):
    """Mirror of the ranks' training bank: slots, specs and scales here; tensors on request.

    An `AdapterBank` (lorafleet.interfaces): what exporters, sampler publishing and the canary
    read (check_slot, slot_weights, params[slot], scales, layers, row_size, layout). The slot
    table is `SlotTable`, the base of `BankSet` too, so validation messages are identical.
    """

    trainable = True

    def __init__(self, engine: DistTrainEngine, info: Mapping[str, Any], name: str = "train"):
        self._engine = engine
        self.name = name
        self.num_slots = int(info["num_slots"])
        self.r_max = int(info["r_max"])
        self.row_size = int(info["row_size"])
        self._layout = [(path, tuple(a), tuple(b)) for path, a, b in info["layout"]]
        self.layers: dict[str, LayerShape] = {
            path: LayerShape(i, o, e) for path, i, o, e in info["layers"]
        }
        self.slots: list[SlotInfo | None] = [None] * self.num_slots
        self.scales = torch.zeros(self.num_slots, dtype=torch.float32)
        self.params = _RowFetcher(self)
        self._cache: dict[tuple[str, int], tuple[int, Any]] = {}
        self._cache_lock = threading.Lock()

    def layout(self) -> list[tuple[str, tuple[int, int], tuple[int, int]]]:
        """The ranks' row layout (BankSet.layout), so a row copy can check it matches."""
        return list(self._layout)

    # --------------------------------------------------------------- mirror updates
    def _set(self, slot: int, spec: AdapterSpec) -> None:
        targets = self.resolve_targets(spec)
        self.slots[slot] = SlotInfo(spec=replace(spec, targets=targets), targets=targets)
        self.scales[slot] = spec.scale

    def _clear(self, slot: int) -> None:
        self.slots[slot] = None
        self.scales[slot] = 0.0

    # --------------------------------------------------------------- tensors, from rank 0
    def _fetch(self, kind: str, slot: int) -> Any:
        self.check_slot(slot)
        generation = self._engine.generation
        with self._cache_lock:
            hit = self._cache.get((kind, slot))
            if hit is not None and hit[0] == generation:
                return hit[1]
        value = self._engine.client.call(f"slot_{kind}", slot=slot)
        with self._cache_lock:
            self._cache[(kind, slot)] = (generation, value)
        return value

    def slot_weights(self, slot: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (A[rank, in], B[out, rank]) copies, as BankSet.slot_weights."""
        _, weights = self._fetch("weights", slot)
        return {path: (A.clone(), B.clone()) for path, (A, B) in weights.items()}

    def slot_row(self, slot: int) -> torch.Tensor:
        _, row = self._fetch("row", slot)
        return row.clone()


class DistTrainEngine:
    """A `Trainer` (lorafleet.interfaces) run by remote ranks (see the module docstring)."""

    def __init__(self, client: RankClient):
        self.client = client
        info = client.info
        self.info = dict(info)
        self.base_model_id: str = info["base_model_id"]
        self.vocab_size = int(info["vocab_size"])
        self.max_length: int | None = info["max_length"]
        self.world = int(info["world"])
        self.generation = 0  # bumped by every call that may change adapter weights
        self.hparams: dict[int, AdamHParams] = {}
        self.bank = RemoteBank(self, info)

    @property
    def pager(self) -> None:
        """None: the ranks keep hard slots (a run's sharded state does not page out yet), so a
        server over them holds a run per slot and refuses one past them."""
        return None

    # ---------------------------------------------------------------- settings
    def set_token_budget(self, value: int) -> None:
        """Micro-batch budget of padded tokens on every rank (they start with RankSettings')."""
        self.client.call("set_token_budget", token_budget=value)

    def _changed(self) -> None:
        self.generation += 1

    def _pick_slot(self, slot: int | None) -> int:
        if slot is not None:
            return slot
        free = self.bank.free_slots()
        if not free:
            raise BankError(
                f"no free slot in bank {self.bank.name!r} (all {self.bank.num_slots - 1} in use)"
            )
        return free[0]

    # ---------------------------------------------------------------- adapters
    def create_adapter(
        self, spec: AdapterSpec, slot: int | None = None, *, optimizer: str = "adamw"
    ) -> int:
        if optimizer != "adamw":
            raise ValueError(f"optimizer {optimizer!r} refused: {_ADAMW_ONLY}")
        spec.validate()
        slot = self._pick_slot(slot)
        self._changed()
        slot = self.client.call("create_adapter", spec=spec, slot=slot)
        self.bank._set(slot, spec)
        return slot

    def free_adapter(self, slot: int) -> None:
        self.bank.check_slot(slot)
        self._changed()
        self.client.call("free_adapter", slot=slot)
        self.bank._clear(slot)
        self.hparams.pop(slot, None)

    # ---------------------------------------------------------------- validation
    def prepare(
        self, items: Sequence[TrainItem], *, allow_base: bool = False
    ) -> list[PreparedItem]:
        """The single-process engine's validation (`ItemLimits`), over the mirrored slot table."""
        return self._item_limits().prepare(items, allow_base=allow_base)

    def _item_limits(self) -> ItemLimits:
        return ItemLimits(self.bank, self.vocab_size, self.max_length)

    # ---------------------------------------------------------------- compute
    def forward(self, items: Sequence[TrainItem] | Sequence[PreparedItem]) -> BatchOutput:
        """As TrainEngine.forward: slot 0 scores the base model."""
        return self.client.call(
            "forward", items=self._item_limits().ensure_prepared(items, allow_base=True)
        )

    def canary_logprobs(self, slot: int | None, tokens: Sequence[int]) -> torch.Tensor:
        """As TrainEngine.canary_logprobs: one `forward` over the ranks."""
        return trainer_canary_logprobs(self, slot, tokens)

    def forward_backward(self, items: Sequence[TrainItem] | Sequence[PreparedItem]) -> BatchOutput:
        return self.client.call(
            "forward_backward", items=self._item_limits().ensure_prepared(items)
        )

    def optim_step(self, hparams: Mapping[int, OptimHParams]) -> dict[int, dict[str, float]]:
        adam: dict[int, AdamHParams] = {}
        for slot, hp in hparams.items():
            self.bank.check_slot(slot)
            if not isinstance(hp, AdamHParams):
                raise ValueError(f"slot {slot}: {type(hp).__name__} refused: {_ADAMW_ONLY}")
            adam[slot] = hp
        self._changed()
        metrics = self.client.call("optim_step", hparams=adam)
        self.hparams.update(adam)
        return metrics

    # ---------------------------------------------------------------- state files (written here)
    def save_state(
        self, slot: int, dest: str | Path, *, metadata: dict | None = None, overwrite: bool = False
    ) -> Path:
        """Gathers the adapter's weights and AdamW state from the ranks and writes the same
        checkpoint a single process writes, on this machine (no filesystem is shared)."""
        self.bank.check_slot(slot)
        parts = self.client.call("gather_state", slot=slot)
        return write_training_state(
            Path(dest),
            spec=parts.spec,
            base_model_id=self.base_model_id,
            weights=parts.weights,
            moments=parts.moments,
            step=parts.step,
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
        """Reads the checkpoint here and ships it to the ranks (they never read server paths)."""
        if isinstance(src, TrainingState):
            state, where = src, str(source or "<checkpoint>")
        else:
            state, where = read_training_state(Path(src)), str(src)
        family = state.optimizer if optimizer is None else optimizer
        if family != "adamw":
            raise ValueError(f"{where}: optimizer {family!r} refused: {_ADAMW_ONLY}")
        slot = self._pick_slot(slot)
        self._changed()
        slot = self.client.call(
            "load_state", state=state, slot=slot, with_optimizer=with_optimizer, source=where
        )
        self.bank._set(slot, state.spec)
        if isinstance(state.hparams, AdamHParams):
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
        config, weights = read_peft(Path(src))
        spec = AdapterSpec(
            rank=config["r"],
            alpha=float(config["lora_alpha"]),
            use_rslora=bool(config.get("use_rslora", False)),
            seed=seed,
            targets=tuple(weights),
        )
        slot = self._pick_slot(slot)
        self._changed()
        slot = self.client.call("import_weights", spec=spec, weights=weights, slot=slot)
        self.bank._set(slot, spec)
        return slot

    def close(self) -> None:
        self.client.close()
