"""The run-metrics route keeps the event loop free: a post's bound checks count the run's
points (up to 200 000 rows), and run on the loop they held up every other request."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, cast

import httpx
from fastapi import FastAPI, Request

from lorafleet.server.http import run_metric_routes as route
from lorafleet.server.http.bodies import BodyReader
from lorafleet.server.http.off_loop import Lanes, OffLoop
from lorafleet.server.state.keys import Tenant


class SlowMetrics:
    """A post that takes as long as a count over a big run (or until released)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def post(self, tenant: Tenant, run: str, body: Any) -> dict[str, Any]:
        self.release.wait(timeout=3)
        return {"accepted": len(body["points"])}


def test_a_slow_post_does_not_hold_up_other_requests():
    metrics = SlowMetrics()
    app = FastAPI()

    @app.middleware("http")
    async def as_tenant(request: Request, call_next: Any) -> Any:
        request.state.tenant = Tenant("t")  # what KeyGate sets
        return await call_next(request)

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {}

    lanes = Lanes(2)
    route.add_routes(app, cast(Any, metrics), OffLoop(BodyReader(1 << 20, 1 << 20, 10.0), lanes))
    done: list[str] = []

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

            async def post() -> None:
                body = {"points": [{"name": "r", "step": 0, "value": 1}]}
                r = await client.post("/api/v1/lorafleet/runs/run-1/metrics", json=body)
                assert r.json() == {"accepted": 1}
                done.append("post")

            async def other() -> None:
                await asyncio.sleep(0.2)  # the post is waiting by now
                assert (await client.get("/ping")).status_code == 200
                done.append("ping")
                metrics.release.set()

            await asyncio.gather(post(), other())

    started = time.monotonic()
    try:
        asyncio.run(scenario())
    finally:
        lanes.close()
    assert done == ["ping", "post"]  # before the fix: the post held the loop for its 3 s
    assert time.monotonic() - started < 2.5
