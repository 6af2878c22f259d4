"""Metering read back (lorafleet's own, not the Tinker API): `GET /api/v1/lorafleet/usage`
for a tenant's own usage (an operator key: `?tenant=<id>` or `?tenant=*`), and `GET /metrics`,
Prometheus text, for operator keys only. Both are behind the key gate like every route."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response

from lorafleet.server.http import API
from lorafleet.server.http.off_loop import OffLoop
from lorafleet.server.http.usage import METRICS_CONTENT_TYPE, Usage

METRICS_ROUTE = "/metrics"


def add_routes(app: FastAPI, usage: Usage, off: OffLoop) -> None:

    @app.get(f"{API}/lorafleet/usage")
    async def read_usage(
        request: Request,
        of: Annotated[str | None, Query(alias="tenant")] = None,
        days: int = 30,
    ) -> dict[str, Any]:
        return await off.call(request, lambda who: usage.report(who, of, days))

    @app.get(METRICS_ROUTE)
    async def metrics(request: Request) -> Response:
        text = await off.call(request, usage.metrics)
        return Response(text, media_type=METRICS_CONTENT_TYPE)
