"""Client sessions: created by each ServiceClient, kept alive by heartbeats, and finished by the
client or, once its heartbeats stop, by maintenance. A finished session's models are unloaded:
a crashed client never calls finish, and its adapter slots would stay taken.

The RestClient reads them back (get, list, search), moves them between projects, and exports a
session's requests as a trace. A tenant sees only its own sessions: "accessible" scopes and
owners reach nothing more here, since sessions are never shared."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import quote, urlencode

from fastapi import FastAPI, Query, Request

from lorafleet.server.errors import ApiError, DiskFull, NotFound, UserError
from lorafleet.server.http import API, resource_json, schemas
from lorafleet.server.http.off_loop import OffLoop
from lorafleet.server.http.signed_urls import UrlSigner
from lorafleet.server.ops.engine_calls import EngineCalls
from lorafleet.server.state import ids
from lorafleet.server.state.keys import Tenant
from lorafleet.server.state.ownership import Ownership
from lorafleet.server.state.store import SessionRow, Store

TRACES_ROUTE = "/api/v1/lorafleet/traces"
"""Where signed trace links point: `<TRACES_ROUTE>/<session_id>`."""
MAX_PROJECT_ID = 256
MAX_TRACE_EVENTS = 100_000  # a trace covers the retained futures (future_ttl_s), at most this many
SEARCH_BATCH = 200
ACCESS_SCOPES = ("owned", "accessible")
STATUS_TYPES = ("active", "cancelled", "failed", "client_finished")


def _check_scope(access_scope: str) -> None:
    if access_scope not in ACCESS_SCOPES:
        raise UserError(f"access_scope must be 'owned' or 'accessible', got {access_scope!r}")


def _status_matches(row: SessionRow, wanted: list[dict[str, Any]]) -> bool:
    status = resource_json.session_status(row)
    for query in wanted:
        if status is None or query.get("type") != status["type"]:
            continue
        reasons = query.get("reasons")
        if status["type"] == "client_finished" and reasons is not None:
            if status["reason"]["type"] in reasons:
                return True
            continue
        return True
    return False


def _check_statuses(statuses: list[dict[str, Any]] | None) -> None:
    if statuses is None:
        return
    if not statuses:
        raise UserError("statuses must be null or a non-empty list")
    for i, query in enumerate(statuses):
        if query.get("type") not in STATUS_TYPES:
            raise UserError(
                f"statuses[{i}].type must be one of {', '.join(STATUS_TYPES)}, got {query.get('type')!r}"
            )


class _Search:
    """One search request's filters, as a predicate on session rows."""

    def __init__(self, tenant: Tenant, req: schemas.SessionSearch):
        owner = req.owner
        if owner.type not in ("own", "accessible", "user"):
            raise UserError(f"owner.type must be 'own', 'accessible' or 'user', got {owner.type!r}")
        if owner.type == "user" and not 1 <= len(owner.owner_urns or []) <= 10:
            raise UserError("owner.owner_urns must list 1 to 10 owners")
        self.nobody = owner.type == "user" and tenant.id not in (owner.owner_urns or [])
        if req.display_name is not None and not req.display_name.strip():
            raise UserError("display_name must not be empty (pass null to match every name)")
        _check_statuses(req.statuses)
        self.req = req
        self.words = (req.display_name or "").lower().split()

    def matches(self, row: SessionRow) -> bool:
        req, info = self.req, row.info
        if req.session_id is not None or self.words:
            name = str(info.get("display_name") or "").lower()
            by_id = req.session_id is not None and row.session_id == req.session_id
            by_name = bool(self.words) and all(w in name for w in self.words)
            if not (by_id or by_name):
                return False
        if req.project_ids is not None and info.get("project_id") not in req.project_ids:
            return False
        metadata = info.get("user_metadata") or {}
        if any(
            str(metadata.get(k)) != v or k not in metadata for k, v in req.user_metadata.items()
        ):
            return False
        return req.statuses is None or _status_matches(row, req.statuses)


class Sessions:
    def __init__(
        self,
        store: Store,
        ownership: Ownership,
        engine: EngineCalls,
        signer: UrlSigner,
        public_url: str = "http://127.0.0.1:8000",
    ):
        """`public_url`: the base trace links name (public_url.py), never a request's Host."""
        self.public_url = public_url
        self.store = store
        self.ownership = ownership
        self.engine = engine
        self.signer = signer
        # heartbeats a full disk kept out of SQLite: session_id -> time (one per live session)
        self._beats_in_memory: dict[str, float] = {}
        self._beats_lock = threading.Lock()

    def create(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.CreateSession, body)
        session_id = ids.new_session_id()
        self.store.sessions.add(session_id, tenant.id, req.model_dump())
        return {"session_id": session_id, "type": "create_session"}

    def heartbeat(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.SessionRef, body)
        row = self.ownership.session(tenant, req.session_id, active=False)
        if row.finished_at is not None:
            raise ApiError(f"session {req.session_id!r} has finished", status=410)
        try:
            self.store.sessions.heartbeat(req.session_id)
        except DiskFull:
            # The client is alive whether or not the disk can say so: kept in memory, else a
            # full-disk episode longer than the session timeout would unload every tenant's
            # models (expire_stale) once space came back.
            with self._beats_lock:
                self._beats_in_memory[req.session_id] = time.time()
        else:
            with self._beats_lock:
                self._beats_in_memory.pop(req.session_id, None)
        return {"type": "session_heartbeat"}

    def finish(self, tenant: Tenant, session_id: str, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.FinishSession, body)
        self.ownership.session(tenant, session_id, active=False)
        reason = (req.reason or {}).get("type")
        self.store.sessions.finish(session_id, str(reason) if reason is not None else None)
        with self._beats_lock:
            self._beats_in_memory.pop(session_id, None)
        self._unload_models(session_id, "finished")
        return {"status": "finished"}

    def expire_stale(self, heartbeat_before: float, timeout_s: float) -> None:
        """Finishes the sessions whose last heartbeat is older than `heartbeat_before`."""
        for session in self.store.sessions.stale(heartbeat_before):
            with self._beats_lock:
                if self._beats_in_memory.get(session.session_id, 0.0) >= heartbeat_before:
                    continue
                self._beats_in_memory.pop(session.session_id, None)
            self.store.sessions.finish(session.session_id, "expired")
            self._unload_models(session.session_id, f"sent no heartbeat for {timeout_s:.0f} s")

    def _unload_models(self, session_id: str, why: str) -> None:
        """A finished session's models leave their slots, and its stability records go: they
        can only be trained on by its models (ops/stability.py)."""
        self.store.stability_records.delete_of_session(session_id)
        models = [
            m.model_id for m in self.store.models.of_session(session_id) if m.status == "active"
        ]
        if models:
            message = f"session {session_id} {why}; its models were unloaded (resume one from a checkpoint)"
            self.engine.unload_models(models, message)

    # ------------------------------------------------------------------ RestClient
    def get(self, tenant: Tenant, session_id: str, access_scope: str) -> dict[str, Any]:
        _check_scope(access_scope)
        row = self.ownership.session(tenant, session_id, active=False)
        runs = [m.model_id for m in self.store.models.of_session(session_id)]
        return resource_json.session(
            row, runs, self.store.sampling_sessions.ids_of_session(session_id)
        )

    def list_ids(
        self, tenant: Tenant, limit: int, offset: int, access_scope: str
    ) -> dict[str, Any]:
        _check_scope(access_scope)
        limit, offset = resource_json.page(limit, offset)
        rows, _total = self.store.sessions.page(tenant.id, limit, offset)
        return {"sessions": [r.session_id for r in rows]}

    def assign_project(self, tenant: Tenant, session_id: str, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.AssignProject, body)
        if not req.project_id.strip() or len(req.project_id) > MAX_PROJECT_ID:
            raise UserError(
                f"project_id must be a non-empty string of at most {MAX_PROJECT_ID} characters, "
                f"got {req.project_id[:80]!r}"
            )
        row = self.ownership.session(tenant, session_id, active=False)
        self.store.sessions.set_info(session_id, {**row.info, "project_id": req.project_id})
        return {}

    def search(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        """Newest first; the cursor names the last session returned. Costs one indexed pass
        over the tenant's sessions at most, whatever the filters."""
        req = schemas.parse(schemas.SessionSearch, body)
        search = _Search(tenant, req)
        found: list[SessionRow] = []
        before = None if req.cursor is None else self._cursor(tenant, req.cursor)
        while not search.nobody and len(found) <= req.limit:
            batch = self.store.sessions.before(tenant.id, before, SEARCH_BATCH)
            found += [row for row in batch if search.matches(row)]
            if len(batch) < SEARCH_BATCH:
                break
            before = (batch[-1].created_at, batch[-1].session_id)
        page, more = found[: req.limit], len(found) > req.limit
        summaries = [
            resource_json.session_summary(
                row, *self.store.checkpoints.session_usage(row.session_id)
            )
            for row in page
        ]
        last = page[-1] if more else None
        cursor = (
            None
            if last is None
            else {
                "last_created_at": datetime.fromtimestamp(last.created_at, UTC).isoformat(),
                "last_session_id": last.session_id,
            }
        )
        return {"sessions": summaries, "next_cursor": cursor}

    def _cursor(self, tenant: Tenant, cursor: schemas.SearchCursor) -> tuple[float, str]:
        """The exact position: the named session's own timestamp (the ISO form the client
        echoes back is rounded to microseconds)."""
        row = self.store.sessions.get(cursor.last_session_id)
        if row is not None and row.tenant == tenant.id:
            return row.created_at, row.session_id
        try:
            when = datetime.fromisoformat(cursor.last_created_at)
        except ValueError:
            raise UserError(
                f"cursor.last_created_at {cursor.last_created_at[:80]!r} is not an ISO timestamp"
            ) from None
        if when.tzinfo is None:
            raise UserError(
                "cursor.last_created_at needs a timezone (pass next_cursor back unchanged)"
            )
        return when.timestamp(), cursor.last_session_id

    def trace_export(self, tenant: Tenant, session_id: str) -> dict[str, Any]:
        """The trace is built when its link is fetched, so it is always ready here."""
        self.ownership.session(tenant, session_id, active=False)
        link = self.signer.sign(tenant.id, f"trace/{session_id}")
        url = f"{self.public_url}{TRACES_ROUTE}/{quote(session_id)}?{urlencode(link.query)}"
        return {"status": "ready", "url": url}

    def trace(
        self, session_id: str, signed_for: str | None, expires: str | None, sig: str | None
    ) -> dict[str, Any]:
        """The session's retained requests as a Chrome trace-event JSON document, which
        ui.perfetto.dev opens (the SDK names the file `.pftrace`; Perfetto reads both): one
        track per training run or sampler, one slice per request from submission to result."""
        owner = self.signer.verify(signed_for, f"trace/{session_id}", expires, sig)
        row = self.store.sessions.get(session_id)
        if row is None or row.tenant != owner:
            raise NotFound(f"unknown session_id {session_id!r}")
        scopes = [m.model_id for m in self.store.models.of_session(session_id)]
        scopes += self.store.sampling_sessions.ids_of_session(session_id)
        track = {scope: i + 1 for i, scope in enumerate(scopes)}
        now = time.time()
        events: list[dict[str, Any]] = [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": scope}}
            for scope, tid in track.items()
        ]
        for future in self.store.futures.of_scopes(scopes, MAX_TRACE_EVENTS):
            end = future.finished_at if future.finished_at is not None else now
            events.append(
                {
                    "name": future.kind,
                    "cat": "request",
                    "ph": "X",
                    "pid": 1,
                    "tid": track.get(future.scope or "", 0),
                    "ts": future.created_at * 1e6,
                    "dur": max(0.0, end - future.created_at) * 1e6,
                    "args": {
                        "request_id": future.request_id,
                        "seq_id": future.seq_id,
                        "state": future.state,
                    },
                }
            )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "metadata": {"session_id": session_id},
        }


# A `ServiceClient`'s session: created, kept alive by heartbeats, finished on close; and the
# RestClient's session routes (get, list, search, project, trace export and its signed link).


def add_routes(app: FastAPI, sessions: Sessions, off: OffLoop) -> None:

    @app.post(f"{API}/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        return await off.json(request, sessions.create)

    @app.post(f"{API}/session_heartbeat")
    async def session_heartbeat(request: Request) -> dict[str, Any]:
        return await off.json(request, sessions.heartbeat)

    @app.post(f"{API}/sessions/{{session_id}}/finish")
    async def finish_session(session_id: str, request: Request) -> dict[str, Any]:
        return await off.json(request, lambda who, body: sessions.finish(who, session_id, body))

    # registered before any /sessions/{session_id} GET so "search" is never read as an id
    @app.post(f"{API}/sessions/search")
    async def search_sessions(request: Request) -> dict[str, Any]:
        return await off.json(request, sessions.search)

    @app.get(f"{API}/sessions")
    async def list_sessions(
        request: Request, limit: int = 20, offset: int = 0, access_scope: str = "owned"
    ) -> dict[str, Any]:
        return await off.call(
            request, lambda who: sessions.list_ids(who, limit, offset, access_scope)
        )

    @app.get(f"{API}/sessions/{{session_id}}")
    async def get_session(
        session_id: str, request: Request, access_scope: str = "owned"
    ) -> dict[str, Any]:
        return await off.call(request, lambda who: sessions.get(who, session_id, access_scope))

    @app.put(f"{API}/sessions/{{session_id}}/project")
    async def assign_project(session_id: str, request: Request) -> dict[str, Any]:
        return await off.json(
            request, lambda who, body: sessions.assign_project(who, session_id, body)
        )

    @app.get(f"{API}/sessions/{{session_id}}/trace_export")
    async def trace_export(session_id: str, request: Request) -> dict[str, Any]:
        return await off.call(request, lambda who: sessions.trace_export(who, session_id))

    @app.get(f"{TRACES_ROUTE}/{{session_id}}")
    async def trace(
        session_id: str,
        signed_for: Annotated[str | None, Query(alias="tenant")] = None,
        expires: str | None = None,
        sig: str | None = None,
    ) -> dict[str, Any]:
        """No API key (app.KeyGate lets TRACES_ROUTE through): the signature is the credential."""
        return await off.public(
            f"traces:{signed_for}", lambda: sessions.trace(session_id, signed_for, expires, sig)
        )
