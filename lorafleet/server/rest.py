"""The REST resources besides the futures: model info, training runs, their checkpoints (listed,
given a TTL, deleted), weights info and samplers, all scoped to the caller's tenant."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from lorafleet.server import requests, schemas, views
from lorafleet.server.auth import Tenant
from lorafleet.server.engine_calls import EngineCalls
from lorafleet.server.ownership import Ownership
from lorafleet.server.paths import TinkerPath, parse_tinker_path
from lorafleet.server.served import ServedBase
from lorafleet.server.store import ModelRow, Store


def _checkpoint_path(run_id: str, checkpoint_id: str) -> TinkerPath:
    return parse_tinker_path(f"tinker://{run_id}/{checkpoint_id}", "checkpoint_id")


class Rest:
    def __init__(self, store: Store, ownership: Ownership, engine: EngineCalls, served: ServedBase):
        self.store = store
        self.ownership = ownership
        self.engine = engine
        self.served = served

    def get_info(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.ModelRef, body)
        return views.model_info(self.ownership.model(tenant, req.model_id), self.served)

    def get_sampler(self, tenant: Tenant, sampler_id: str) -> dict[str, Any]:
        return views.sampler(self.ownership.sampling_session(tenant, sampler_id))

    def _run(self, row: ModelRow) -> dict[str, Any]:
        return views.training_run(
            row,
            self.store.last_checkpoint(row.model_id, "training"),
            self.store.last_checkpoint(row.model_id, "sampler"),
        )

    def list_training_runs(self, tenant: Tenant, limit: int, offset: int) -> dict[str, Any]:
        limit, offset = views.page(limit, offset)
        rows, total = self.store.list_models(tenant.id, limit, offset)
        return {
            "training_runs": [self._run(r) for r in rows],
            "cursor": views.cursor(offset, limit, total),
        }

    def get_training_run(self, tenant: Tenant, run_id: str) -> dict[str, Any]:
        return self._run(self.ownership.model(tenant, run_id))

    def list_checkpoints(
        self, tenant: Tenant, run_id: str | None, limit: int = 1000, offset: int = 0
    ) -> dict[str, Any]:
        limit, offset = views.page(limit, offset)
        if run_id is not None:
            self.ownership.model(tenant, run_id)
        rows, total = self.store.list_checkpoints(tenant.id, run_id, limit, offset)
        return {
            "checkpoints": [views.checkpoint(r) for r in rows],
            "cursor": views.cursor(offset, limit, total),
        }

    def delete_checkpoint(self, tenant: Tenant, run_id: str, checkpoint_id: str) -> Future[None]:
        row = self.ownership.checkpoint(tenant, _checkpoint_path(run_id, checkpoint_id))
        return self.engine.delete_checkpoint(row)

    def set_checkpoint_ttl(
        self, tenant: Tenant, run_id: str, checkpoint_id: str, body: Any
    ) -> dict[str, Any]:
        req = schemas.parse(schemas.SetTtl, body)
        row = self.ownership.checkpoint(tenant, _checkpoint_path(run_id, checkpoint_id))
        row.expires_at = requests.expires_at(req.ttl_seconds)
        self.store.put_checkpoint(row)
        return {}

    def weights_info(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.WeightsInfo, body)
        row = self.ownership.checkpoint(tenant, parse_tinker_path(req.tinker_path, "tinker_path"))
        return views.weights_info(row)
