"""Opening a console event stream checks its view by building it once (a run's curves, up to
tens of thousands of points; the fleet's usage): on a worker thread, so a page opening a big
run does not hold up every other request the server is answering."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, cast

import httpx
from fastapi import FastAPI

from lorafleet.server.console.routes import CONSOLE_API, Console, add_routes
from lorafleet.server.console.sessions import ConsoleSessions
from lorafleet.server.console.sse import EventStreams
from lorafleet.server.errors import NotFound
from lorafleet.server.state.keys import Tenant, hash_key
from lorafleet.server.state.tenants import Tenancy, TenantsConfig, TenantSpec

KEY = "tml-console-loop-0123456789"


class SlowViews:
    """The first look at the run (the route's check) is slow; the stream's own look finds the
    run gone, which ends the stream."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.looks = 0

    def check_run(self, tenant: Tenant, run: str) -> None:
        self.run(tenant, run)

    def run(self, tenant: Tenant, run: str, after_step: int = -1) -> dict[str, Any]:
        self.looks += 1
        if self.looks == 1:
            self.release.wait(timeout=3)
            return {}
        raise NotFound(f"unknown model_id {run!r}")

    def overview(self, tenant: Tenant) -> dict[str, Any]:
        return {}


def test_opening_a_run_stream_does_not_hold_up_other_requests():
    tenancy = Tenancy(TenantsConfig.from_specs([TenantSpec("t", (hash_key(KEY),))], "t"))
    sessions = ConsoleSessions(lambda: tenancy.current)
    views = SlowViews()
    app = FastAPI()
    add_routes(app, Console(sessions, cast(Any, views), EventStreams(sessions, interval_s=0.01)))
    done: list[str] = []

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            assert (
                await client.post(f"{CONSOLE_API}/session", json={"key": KEY})
            ).status_code == 200

            async def stream() -> None:
                r = await client.get(f"{CONSOLE_API}/events", params={"run": "big-run"})
                assert r.status_code == 200 and b"event: failure" in r.content
                done.append("stream")

            async def other() -> None:
                await asyncio.sleep(0.2)  # the stream's check is under way by now
                assert (await client.get(f"{CONSOLE_API}/session")).status_code == 200
                done.append("other")
                views.release.set()

            await asyncio.wait_for(asyncio.gather(stream(), other()), timeout=10)

    asyncio.run(scenario())
    assert done == ["other", "stream"]  # before the fix: the check held the loop for 3 s
