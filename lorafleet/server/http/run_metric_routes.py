"""`POST /api/v1/lorafleet/runs/{model_id}/metrics` (lorafleet's own, not the Tinker API): a
client's per-step metrics for one of its runs, shown as curves in the console beside the
server's own loss (`lorafleet rl` posts its rewards here). Behind the key gate like every route;
bounded per call and per run (run_metrics.py)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from lorafleet.server.http import API
from lorafleet.server.http.bodies import BodyReader, tenant
from lorafleet.server.ops.run_metrics import RunMetrics

RUN_METRICS_ROUTE = f"{API}/lorafleet/runs/{{model_id}}/metrics"


def add_routes(app: FastAPI, run_metrics: RunMetrics, bodies: BodyReader) -> None:

    @app.post(RUN_METRICS_ROUTE)
    async def post_metrics(model_id: str, request: Request) -> dict[str, Any]:
        body = await bodies.json(request)
        # on a worker thread: the per-run bounds count the run's points (a scan of up to
        # 200 000 rows), which on the event loop would stall every tenant's requests
        return await run_in_threadpool(run_metrics.post, tenant(request), model_id, body)
