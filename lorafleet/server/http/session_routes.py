"""A `ServiceClient`'s session: created, kept alive by heartbeats, finished on close; and the
RestClient's session routes (get, list, search, project, trace export and its signed link)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Query, Request

from lorafleet.server.http import API
from lorafleet.server.http.off_loop import OffLoop
from lorafleet.server.http.sessions import TRACES_ROUTE, Sessions


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
