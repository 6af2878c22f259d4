"""A `ServiceClient`'s session: created, kept alive by heartbeats, finished on close; and the
RestClient's session routes (get, list, search, project, trace export and its signed link)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Query, Request

from lorafleet.server.http import API
from lorafleet.server.http.bodies import BodyReader, tenant
from lorafleet.server.http.sessions import TRACES_ROUTE, Sessions


def add_routes(app: FastAPI, sessions: Sessions, bodies: BodyReader) -> None:

    @app.post(f"{API}/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        return sessions.create(tenant(request), await bodies.json(request))

    @app.post(f"{API}/session_heartbeat")
    async def session_heartbeat(request: Request) -> dict[str, Any]:
        return sessions.heartbeat(tenant(request), await bodies.json(request))

    @app.post(f"{API}/sessions/{{session_id}}/finish")
    async def finish_session(session_id: str, request: Request) -> dict[str, Any]:
        return sessions.finish(tenant(request), session_id, await bodies.json(request))

    # registered before any /sessions/{session_id} GET so "search" is never read as an id
    @app.post(f"{API}/sessions/search")
    async def search_sessions(request: Request) -> dict[str, Any]:
        return sessions.search(tenant(request), await bodies.json(request))

    @app.get(f"{API}/sessions")
    async def list_sessions(
        request: Request, limit: int = 20, offset: int = 0, access_scope: str = "owned"
    ) -> dict[str, Any]:
        return sessions.list_ids(tenant(request), limit, offset, access_scope)

    @app.get(f"{API}/sessions/{{session_id}}")
    async def get_session(
        session_id: str, request: Request, access_scope: str = "owned"
    ) -> dict[str, Any]:
        return sessions.get(tenant(request), session_id, access_scope)

    @app.put(f"{API}/sessions/{{session_id}}/project")
    async def assign_project(session_id: str, request: Request) -> dict[str, Any]:
        return sessions.assign_project(tenant(request), session_id, await bodies.json(request))

    @app.get(f"{API}/sessions/{{session_id}}/trace_export")
    async def trace_export(session_id: str, request: Request) -> dict[str, Any]:
        return sessions.trace_export(tenant(request), session_id)

    @app.get(f"{TRACES_ROUTE}/{{session_id}}")
    async def trace(
        session_id: str,
        signed_for: Annotated[str | None, Query(alias="tenant")] = None,
        expires: str | None = None,
        sig: str | None = None,
    ) -> dict[str, Any]:
        """No API key (app.KeyGate lets TRACES_ROUTE through): the signature is the credential."""
        return sessions.trace(session_id, signed_for, expires, sig)
