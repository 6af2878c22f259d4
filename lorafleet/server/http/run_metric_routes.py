"""`POST /api/v1/lorafleet/runs/{model_id}/metrics` (lorafleet's own, not the Tinker API): a
client's per-step metrics for one of its runs, shown as curves in the console beside the
server's own loss (`lorafleet rl` posts its rewards here). Behind the key gate like every route;
bounded per call and per run (run_metrics.py)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from lorafleet.server.http import API
from lorafleet.server.http.off_loop import OffLoop
from lorafleet.server.ops.run_metrics import RunMetrics

RUN_METRICS_ROUTE = f"{API}/lorafleet/runs/{{model_id}}/metrics"


def add_routes(app: FastAPI, run_metrics: RunMetrics, off: OffLoop) -> None:

    @app.post(RUN_METRICS_ROUTE)
    async def post_metrics(model_id: str, request: Request) -> dict[str, Any]:
        # off the loop: the per-run bounds count the run's points (a scan of up to 200 000
        # rows), which on the event loop would stall every tenant's requests
        return await off.json(request, lambda who, body: run_metrics.post(who, model_id, body))
