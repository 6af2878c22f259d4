"""A `ServiceClient`'s session: created, kept alive by heartbeats, finished on close."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from lorafleet.server.routes import API
from lorafleet.server.routes.bodies import BodyReader, tenant
from lorafleet.server.sessions import Sessions


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
