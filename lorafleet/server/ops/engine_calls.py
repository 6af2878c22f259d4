"""Engine work the HTTP side asks for outside the op queues (unloading a session's models,
deleting a checkpoint). Each runs on the engine worker between rounds (`Scheduler.call`), since
the engine is only ever touched from that thread."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from lorafleet.server.ops.scheduler import Scheduler
from lorafleet.server.state.store import CheckpointRow


class Upkeep(Protocol):
    """What the engine does besides running ops (the executor implements it)."""

    def unload_models(self, model_ids: list[str]) -> None: ...

    def delete_checkpoint(self, checkpoint: CheckpointRow) -> None: ...


class EngineCalls:
    def __init__(self, scheduler: Scheduler, engine: Upkeep):
        self.scheduler = scheduler
        self.engine = engine

    def unload_models(self, model_ids: list[str], reason: str) -> Future[None]:
        """Frees the models' adapter slots and fails what they still have queued with `reason`."""

        def unload() -> None:
            self.engine.unload_models(model_ids)
            for model_id in model_ids:
                self.scheduler.forget_model(model_id, reason)

        return self.scheduler.call(unload)

    def delete_checkpoint(self, row: CheckpointRow) -> Future[None]:
        return self.scheduler.call(lambda: self.engine.delete_checkpoint(row))
