"""An operator stream open when a tenants reload takes the operator flag away: the next
snapshot is refused (a 403 `failure` event ends the stream) instead of going on sending the
fleet's data to a key that may no longer see it."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any, cast

from starlette.requests import Request

from lorafleet.server.console.routes import SharedRunViews, _snapshot
from lorafleet.server.console.sessions import ConsoleSessions
from lorafleet.server.console.sse import EventStreams
from lorafleet.server.console.views import ConsoleViews
from lorafleet.server.state.keys import hash_key
from lorafleet.server.state.tenants import Tenancy, TenantsConfig, TenantSpec

KEY = "tml-console-operator-0123456789"


def _config(operator: bool) -> TenantsConfig:
    return TenantsConfig.from_specs([TenantSpec("ops", (hash_key(KEY),), operator=operator)], "t")


def test_a_demoted_operator_stream_ends_with_a_403():
    tenancy = Tenancy(_config(operator=True))
    sessions = ConsoleSessions(lambda: tenancy.current)
    usage = SimpleNamespace(report=lambda *_: {"tenants": {}})
    views = ConsoleViews(cast(Any, SimpleNamespace(stats=dict, usage=usage, tenancy=tenancy)))
    session, _ = sessions.sign_in(KEY)
    request = Request({"type": "http", "query_string": b"view=operator", "headers": []})
    snapshot = _snapshot(views, lambda: sessions.get(session.id)[1], request, SharedRunViews())
    streams = EventStreams(sessions, interval_s=0.01)

    async def scenario() -> list[bytes]:
        stream = streams.stream(session, snapshot)
        chunks = [await anext(stream), await anext(stream)]  # retry, then the fleet
        tenancy.current = _config(operator=False)  # the reload: same key, no operator flag

        async def rest() -> list[bytes]:
            return [chunk async for chunk in stream]

        chunks.extend(await asyncio.wait_for(rest(), timeout=5))  # before the fix: never ends
        return chunks

    chunks = asyncio.run(scenario())
    assert chunks[1].startswith(b"event: snapshot") and b'"operator"' in chunks[1]
    assert [c for c in chunks[2:] if c.startswith(b"event: snapshot")] == []
    assert chunks[-1].startswith(b"event: failure")
    failure: dict[str, Any] = json.loads(chunks[-1].split(b"data: ", 1)[1])
    assert "operator keys" in failure["error"]
    assert streams.open_streams == 0
