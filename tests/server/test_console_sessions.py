"""Console sessions and event streams without a server: expiry, the bound on sessions, a key
removed by a tenants reload losing its sessions, and the bounds on event streams."""

from __future__ import annotations

import asyncio
import json

import pytest

from lorafleet.server.console.sessions import ConsoleSessions
from lorafleet.server.console.sse import EventStreams, TooManyStreams
from lorafleet.server.errors import Unauthorized
from lorafleet.server.state.keys import hash_key
from lorafleet.server.state.tenants import Tenancy, TenantsConfig, TenantSpec

KEY = "tml-console-key-0123456789"
OTHER = "tml-console-other-012345678"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tenancy(*keys: str, operator: bool = False) -> Tenancy:
    return Tenancy(
        TenantsConfig.from_specs(
            [TenantSpec(f"t{i}", (hash_key(k),), operator=operator) for i, k in enumerate(keys)],
            "test",
        )
    )


def test_sign_in_get_expire_and_sign_out():
    clock = Clock()
    t = tenancy(KEY, OTHER)
    sessions = ConsoleSessions(lambda: t.current, ttl_s=60, clock=clock)
    with pytest.raises(Unauthorized) as refused:
        sessions.sign_in(KEY + "x")
    assert KEY not in str(refused.value)
    session, tenant = sessions.sign_in(KEY)
    assert tenant.id == "t0" and session.id != session.csrf and KEY not in repr(session)
    assert sessions.get(session.id)[1].id == "t0"
    clock.now += 61
    with pytest.raises(Unauthorized, match="expired"):
        sessions.get(session.id)
    session, _ = sessions.sign_in(KEY)
    sessions.sign_out(session.id)
    with pytest.raises(Unauthorized):
        sessions.get(session.id)
    with pytest.raises(Unauthorized, match="not signed in"):
        sessions.get(None)


def test_sessions_are_bounded_least_recently_used_first():
    t = tenancy(KEY)
    sessions = ConsoleSessions(lambda: t.current, max_sessions=3)
    first = sessions.sign_in(KEY)[0]
    second = sessions.sign_in(KEY)[0]
    sessions.sign_in(KEY)
    sessions.get(first.id)  # used: the second is now the oldest
    sessions.sign_in(KEY)
    assert len(sessions) == 3
    assert sessions.alive(first.id) and not sessions.alive(second.id)


def test_a_key_removed_by_a_reload_loses_its_sessions():
    t = tenancy(KEY, OTHER)
    sessions = ConsoleSessions(lambda: t.current)
    mine = sessions.sign_in(KEY)[0]
    theirs = sessions.sign_in(OTHER)[0]
    # the reload keeps tenant t1's key and makes it an operator; t0's key is gone
    t.current = TenantsConfig.from_specs(
        [TenantSpec("t1", (hash_key(OTHER),), operator=True)], "reloaded"
    )
    with pytest.raises(Unauthorized, match="no longer valid"):
        sessions.get(mine.id)
    assert sessions.get(theirs.id)[1].operator  # the new flag, at once
    # a key moved to another tenant's table does not carry the old session over
    t.current = TenantsConfig.from_specs([TenantSpec("t9", (hash_key(OTHER),))], "moved")
    assert not sessions.alive(theirs.id)


def test_event_streams_are_bounded_and_end_with_the_session():
    t = tenancy(KEY)
    sessions = ConsoleSessions(lambda: t.current)
    streams = EventStreams(sessions, per_session=2, total=3, interval_s=0.01, heartbeat_s=0.03)
    a = sessions.sign_in(KEY)[0]
    b = sessions.sign_in(KEY)[0]
    calls = {"n": 0}

    def snapshot() -> dict[str, int]:
        calls["n"] += 1
        return {"v": calls["n"] // 5}  # changes every fifth look

    async def scenario() -> list[bytes]:
        first = streams.stream(a, snapshot)
        second = streams.stream(a, snapshot)
        assert (await anext(first)).startswith(b"retry:")
        assert (await anext(second)).startswith(b"retry:")
        with pytest.raises(TooManyStreams, match="this console session"):
            streams.check(a)
        third = streams.stream(b, snapshot)
        await anext(third)
        with pytest.raises(TooManyStreams, match="event streams open, its limit"):
            streams.check(b)
        await second.aclose()  # a closed tab frees its place
        streams.check(a)
        events = [await anext(first) for _ in range(6)]
        sessions.sign_out(a.id)
        rest = [chunk async for chunk in first]
        await third.aclose()
        assert streams.open_streams == 0
        return events + rest

    chunks = asyncio.run(scenario())
    snapshots = [c for c in chunks if c.startswith(b"event: snapshot")]
    assert len(snapshots) >= 2  # sent again when the view changed, not on every look
    assert len(snapshots) < calls["n"]
    assert any(c.startswith(b": heartbeat") for c in chunks)
    assert chunks[-1].startswith(b"event: signed_out")
    data = json.loads(snapshots[0].split(b"data: ", 1)[1])
    assert data == {"v": 0}
