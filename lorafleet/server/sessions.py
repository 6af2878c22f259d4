"""Client sessions: created by each ServiceClient, kept alive by heartbeats, and finished by the
client or, once its heartbeats stop, by maintenance. A finished session's models are unloaded:
a crashed client never calls finish, and its adapter slots would stay taken."""

from __future__ import annotations

from typing import Any

from lorafleet.server import ids, schemas
from lorafleet.server.auth import Tenant
from lorafleet.server.engine_calls import EngineCalls
from lorafleet.server.errors import ApiError
from lorafleet.server.ownership import Ownership
from lorafleet.server.store import Store


class Sessions:
    def __init__(self, store: Store, ownership: Ownership, engine: EngineCalls):
        self.store = store
        self.ownership = ownership
        self.engine = engine

    def create(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.CreateSession, body)
        session_id = ids.new_session_id()
        self.store.add_session(session_id, tenant.id, req.model_dump())
        return {"session_id": session_id, "type": "create_session"}

    def heartbeat(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.SessionRef, body)
        row = self.ownership.session(tenant, req.session_id, active=False)
        if row.finished_at is not None:
            raise ApiError(f"session {req.session_id!r} has finished", status=410)
        self.store.heartbeat(req.session_id)
        return {"type": "session_heartbeat"}

    def finish(self, tenant: Tenant, session_id: str, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.FinishSession, body)
        self.ownership.session(tenant, session_id, active=False)
        reason = (req.reason or {}).get("type")
        self.store.finish_session(session_id, str(reason) if reason is not None else None)
        self._unload_models(session_id, "finished")
        return {"status": "finished"}

    def expire_stale(self, heartbeat_before: float, timeout_s: float) -> None:
        """Finishes the sessions whose last heartbeat is older than `heartbeat_before`."""
        for session in self.store.stale_sessions(heartbeat_before):
            self.store.finish_session(session.session_id, "expired")
            self._unload_models(session.session_id, f"sent no heartbeat for {timeout_s:.0f} s")

    def _unload_models(self, session_id: str, why: str) -> None:
        models = [m.model_id for m in self.store.session_models(session_id) if m.status == "active"]
        if models:
            message = f"session {session_id} {why}; its models were unloaded (resume one from a checkpoint)"
            self.engine.unload_models(models, message)
