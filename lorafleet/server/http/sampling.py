"""The sampling operations: sampling sessions (a saved checkpoint or the bare base, under an id
the SDK derives) and sample requests, which are not ordered by seq_id but deduplicated by it."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request

from lorafleet.server.errors import ApiError, Conflict, UserError
from lorafleet.server.http import API, parse, schemas
from lorafleet.server.http.off_loop import OffLoop
from lorafleet.server.http.served import ServedBase
from lorafleet.server.ops import stability
from lorafleet.server.ops.abandoned import AbandonedSamples
from lorafleet.server.ops.intake import Intake, Place
from lorafleet.server.ops.stability import StabilityPolicy
from lorafleet.server.ops.types import Op, Recording, Refused, Sample
from lorafleet.server.state import ids
from lorafleet.server.state.keys import Tenant
from lorafleet.server.state.ownership import Ownership
from lorafleet.server.state.paths import parse_tinker_path
from lorafleet.server.state.store import SamplingSessionRow, Store


class Sampling:
    def __init__(
        self,
        store: Store,
        ownership: Ownership,
        intake: Intake,
        served: ServedBase,
        stability_policy: StabilityPolicy | None = None,
        abandoned: AbandonedSamples | None = None,
    ):
        self.store = store
        self.ownership = ownership
        self.intake = intake
        self.served = served
        self.stability_policy = stability_policy or StabilityPolicy()
        self.abandoned = abandoned  # cancels samples whose client stopped polling

    def create_session(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.CreateSamplingSession, body)
        self.ownership.session(tenant, req.session_id)
        sampler_id = ids.sampling_session_id(req.session_id, req.sampling_session_seq_id)
        adapter_id: str | None = None
        if req.model_path is not None:
            checkpoint = self.ownership.readable_checkpoint(
                tenant, parse_tinker_path(req.model_path, "model_path")
            )
            base_model = (
                self.served.check(req.base_model)
                if req.base_model
                else checkpoint.info["base_model"]
            )
            adapter_id = checkpoint.tinker_path
        elif req.base_model is not None:
            base_model = self.served.check(req.base_model)
        else:
            raise UserError("create_sampling_session needs base_model or model_path")
        existing = self.store.sampling_sessions.get(sampler_id)
        if existing is not None:
            if (
                existing.tenant == tenant.id
                and existing.model_path == req.model_path
                and existing.adapter_id == adapter_id
            ):
                return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}
            raise Conflict(
                f"sampling_session_seq_id {req.sampling_session_seq_id} is already used in session {req.session_id}"
            )
        self.store.sampling_sessions.add(
            SamplingSessionRow(
                sampler_id,
                tenant.id,
                req.session_id,
                base_model,
                req.model_path,
                adapter_id,
                0 if adapter_id is not None else None,
                time.time(),
            )
        )
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    def sample(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.Sample, body)
        parse.check_num_samples(req.num_samples, self.served.limits.max_num_samples)
        scope: str | None = None
        adapter: tuple[str, int] | None = None
        checkpoint_path: str | None = None
        session_id: str | None = None
        if req.sampling_session_id is not None:
            row = self.ownership.sampling_session(tenant, req.sampling_session_id)
            scope = row.sampling_session_id
            session_id = row.session_id
            if row.adapter_id is not None:
                adapter = (row.adapter_id, row.adapter_version or 0)
                checkpoint_path = row.model_path
        elif req.model_path is not None:
            checkpoint = self.ownership.readable_checkpoint(
                tenant, parse_tinker_path(req.model_path, "model_path")
            )
            adapter, checkpoint_path = (checkpoint.tinker_path, 0), checkpoint.tinker_path
        elif req.base_model is not None:
            self.served.check(req.base_model)
        else:
            raise UserError("asample needs sampling_session_id, model_path or base_model")
        record = self._recording(tenant, req, session_id)
        op: Op
        cancel = threading.Event()  # set once its client has stopped polling (abandoned.py)
        try:
            op = replace(parse.sample_args(req, adapter, checkpoint_path, record), cancel=cancel)
            parse.check_sample_cost(op, self.served.limits, self.served.context_length)
        except ApiError as exc:
            op = Refused(exc, "sample")
        if record is not None and isinstance(op, Sample):
            max_new = op.params.max_tokens or max(
                (self.served.context_length or 0) - len(op.prompt), 0
            )
            bound = stability.record_bound(len(op.prompt), op.num_samples, max_new)
            stability.check_room(self.store, tenant.id, self.stability_policy, bound)
        place = Place(scope=scope, seq_id=req.seq_id if scope is not None else None)
        promise = self.intake.submit(tenant, op, place, parse.fingerprint(body))
        if self.abandoned is not None and not isinstance(op, Refused):
            self.abandoned.register(promise.request_id, tenant.id, cancel)
        return {
            **promise.json(),
            "sample_sequence_ids": ids.sample_sequence_ids(promise.request_id, req.num_samples),
        }

    def _recording(
        self, tenant: Tenant, req: schemas.Sample, session_id: str | None
    ) -> Recording | None:
        """Where a `record_stability_info=true` sample's record goes: its sampling client's
        session (a sample without one has nobody to train on the record, and is refused)."""
        if not req.record_stability_info:
            return None
        if session_id is None:
            raise UserError(
                "record_stability_info=true needs a sampling client of a session "
                "(sampling_session_id): records belong to the session that sampled them, and a "
                "sample by model_path or base_model alone has none"
            )
        return Recording(session_id, self.stability_policy.quota_bytes)


# A `SamplingClient`'s operations: open a sampling session, sample (answered with a future).


def add_routes(app: FastAPI, sampling: Sampling, off: OffLoop) -> None:

    @app.post(f"{API}/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        return await off.json(request, sampling.create_session)

    @app.post(f"{API}/asample")
    async def asample(request: Request) -> dict[str, Any]:
        return await off.json(request, sampling.sample)
