"""One tenant cannot crowd the others out of the console: signed in many times it reaches its
own bound on event streams (`console_streams_per_tenant`) and pushes out only its own oldest
sessions (`console_sessions_per_tenant`), never another tenant's."""

from __future__ import annotations

import asyncio

import pytest

from lorafleet.server.console.sessions import ConsoleSessions
from lorafleet.server.console.sse import EventStreams, TooManyStreams
from lorafleet.server.state.keys import hash_key
from lorafleet.server.state.tenants import Tenancy, TenantsConfig, TenantSpec

GREEDY = "tml-console-greedy-0123456789"
OTHER = "tml-console-other-0123456789"


def test_a_tenant_signed_in_many_times_leaves_streams_for_others():
    tenancy = Tenancy(
        TenantsConfig.from_specs(
            [TenantSpec("greedy", (hash_key(GREEDY),)), TenantSpec("other", (hash_key(OTHER),))],
            "t",
        )
    )
    sessions = ConsoleSessions(lambda: tenancy.current)
    streams = EventStreams(sessions, per_session=2, total=6, per_tenant=4, interval_s=0.01)
    greedy = [sessions.sign_in(GREEDY)[0] for _ in range(3)]

    async def scenario() -> None:
        opened = [streams.stream(s, dict) for s in greedy[:2] for _ in range(2)]
        for stream in opened:
            assert (await anext(stream)).startswith(b"retry:")
        with pytest.raises(TooManyStreams, match="tenant greedy has 4"):
            streams.check(greedy[2])  # a third session of the same tenant: still its bound
        other = sessions.sign_in(OTHER)[0]
        streams.check(other)
        theirs = streams.stream(other, dict)
        assert (await anext(theirs)).startswith(b"retry:")
        await opened[0].aclose()  # a closed tab gives the tenant its place back
        streams.check(greedy[2])
        for stream in [*opened[1:], theirs]:
            await stream.aclose()
        assert streams.open_streams == 0

    asyncio.run(scenario())


def test_a_tenant_signing_in_over_and_over_pushes_out_only_its_own_sessions():
    tenancy = Tenancy(
        TenantsConfig.from_specs(
            [TenantSpec("greedy", (hash_key(GREEDY),)), TenantSpec("other", (hash_key(OTHER),))],
            "t",
        )
    )
    sessions = ConsoleSessions(lambda: tenancy.current, max_sessions=5, per_tenant=2)
    theirs = sessions.sign_in(OTHER)[0]
    mine = [sessions.sign_in(GREEDY)[0] for _ in range(10)]
    assert sessions.alive(theirs.id)
    assert [sessions.alive(s.id) for s in mine] == [False] * 8 + [True] * 2
    assert len(sessions) == 3
