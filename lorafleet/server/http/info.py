"""What a client asks before it trains: liveness, the SDK's configs, the served base and its
limits. Telemetry is accepted and dropped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from lorafleet.server.http import API, resource_json
from lorafleet.server.http.bodies import tenant
from lorafleet.server.http.served import ServedBase

Health = Callable[[], tuple[int, dict[str, str]]]
"""`Service.health`: the status code and the states (engine, disk) /healthz answers."""


def add_routes(app: FastAPI, served: ServedBase, *, health: Health) -> None:

    @app.get(f"{API}/healthz")
    async def healthz() -> JSONResponse:
        status, body = health()
        return JSONResponse(body, status_code=status)

    @app.post(f"{API}/client/config")
    async def client_config(request: Request) -> dict[str, Any]:
        tenant(request)
        return resource_json.client_config()

    @app.post(f"{API}/client/dynamic_config")
    async def dynamic_config(request: Request) -> dict[str, Any]:
        tenant(request)
        return resource_json.dynamic_config()

    @app.get(f"{API}/get_server_capabilities")
    async def capabilities(request: Request) -> dict[str, Any]:
        tenant(request)
        return resource_json.capabilities(served)

    @app.post(f"{API}/telemetry")
    async def telemetry(request: Request) -> dict[str, str]:
        tenant(request)
        return {"status": "accepted"}
