"""The training models loaded in this process: which trainer slot each one holds.

A model's row in the store outlives the process; its slot does not, so after a restart (or its
session's end) the model is known but not live, and every op on it fails with that reason.
Written and read on the engine worker thread only."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from lorafleet.interfaces import Trainer
from lorafleet.server.errors import UserError
from lorafleet.server.store import ModelRow, Store


@dataclass
class LiveModel:
    model_id: str
    tenant: str
    session_id: str
    slot: int
    base_model: str
    optimizer: str = "adamw"  # its optimizer family, fixed at creation (adapters.hparams)


class LiveModels:
    def __init__(self, store: Store, trainer: Trainer, max_adapters: int):
        self.store = store
        self.trainer = trainer
        self.max_adapters = max_adapters  # named in the error when every slot is taken
        self._by_id: dict[str, LiveModel] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, model_id: str | None) -> LiveModel:
        live = self._by_id.get(model_id or "")
        if live is None:
            raise UserError(
                f"model {model_id!r} is not loaded any more (its session finished or the server restarted)"
            )
        return live

    def require_free_slot(self) -> None:
        if not self.trainer.bank.free_slots():
            raise UserError(
                f"all {self.max_adapters} training adapter slots of this server are in use; close another "
                "ServiceClient (its models are unloaded) or ask the operator to raise --max-adapters"
            )

    def add(
        self,
        model_id: str,
        tenant: str,
        session_id: str,
        base_model: str,
        slot: int,
        lora: dict[str, Any],
        user_metadata: dict | None,
        optimizer: str = "adamw",
    ) -> None:
        """Records a model whose adapter now sits in `slot`: its row, then its live entry."""
        now = time.time()
        self.store.add_model(
            ModelRow(
                model_id=model_id,
                tenant=tenant,
                session_id=session_id,
                base_model=base_model,
                lora_rank=int(lora["rank"]),
                lora=lora,
                user_metadata=user_metadata,
                created_at=now,
                last_request_time=now,
                status="active",
            )
        )
        self._by_id[model_id] = LiveModel(model_id, tenant, session_id, slot, base_model, optimizer)

    def unload(self, model_ids: list[str]) -> None:
        """Frees the models' adapter slots; the caller fails what they still have queued."""
        for model_id in model_ids:
            live = self._by_id.pop(model_id, None)
            if live is not None:
                self.trainer.free_adapter(live.slot)
            self.store.set_model_status(model_id, "unloaded")
