"""Engine work the HTTP side asks for outside the op queues (unloading a session's models,
deleting a checkpoint). Each runs on the engine worker between rounds (`Scheduler.call`), since
the engine is only ever touched from that thread."""

from __future__ import annotations

from concurrent.futures import Future

from lorafleet.server.engine.executor import Executor
from lorafleet.server.ops.scheduler import Scheduler
from lorafleet.server.state.store import CheckpointRow


class EngineCalls:
    def __init__(self, scheduler: Scheduler, executor: Executor):
        self.scheduler = scheduler
        self.executor = executor

    def unload_models(self, model_ids: list[str], reason: str) -> Future[None]:
        """Frees the models' adapter slots and fails what they still have queued with `reason`."""

        def unload() -> None:
            self.executor.unload_models(model_ids)
            for model_id in model_ids:
                self.scheduler.forget_model(model_id, reason)

        return self.scheduler.call(unload)

    def delete_checkpoint(self, row: CheckpointRow) -> Future[None]:
        return self.scheduler.call(lambda: self.executor.delete_checkpoint(row))
