"""lorafleet's own counters (not part of the Tinker API): batches per kind, mixed and
cross-tenant batches, loaded models, pending operations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from lorafleet.server.routes import API
from lorafleet.server.routes.bodies import tenant


def add_routes(app: FastAPI, stats: Callable[[], dict[str, Any]]) -> None:

    @app.get(f"{API}/lorafleet/stats")
    async def server_stats(request: Request) -> dict[str, Any]:
        tenant(request)
        return stats()
