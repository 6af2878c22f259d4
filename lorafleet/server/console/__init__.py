"""The web console (`/console`): each tenant sees its own runs, curves, checkpoints, sampler
versions and usage; an operator key also sees the fleet. Served by the API's own process and
port from the assets in `static/` (no build step), signed in with an API key exchanged for a
session cookie (sessions.py), refreshed live over server-sent events (sse.py). docs/console.md
is the user's guide and the security model."""

from __future__ import annotations

from lorafleet.server.console.routes import Console
from lorafleet.server.console.sessions import ConsoleSessions
from lorafleet.server.console.sse import EventStreams
from lorafleet.server.console.views import ConsoleViews, Sources
from lorafleet.server.state.tenants import Tenancy


def build_console(
    sources: Sources,
    tenancy: Tenancy,
    *,
    session_ttl_s: float,
    max_sessions: int,
    sessions_per_tenant: int,
    streams: int,
    streams_per_session: int,
    streams_per_tenant: int,
    refresh_s: float,
    operator_streams: int = 0,
    newcomer_streams: int = 0,
    cpu_share: float = 0.1,
) -> Console:
    sessions = ConsoleSessions(
        lambda: tenancy.current,
        ttl_s=session_ttl_s,
        max_sessions=max_sessions,
        per_tenant=sessions_per_tenant,
    )
    return Console(
        sessions,
        ConsoleViews(sources),
        EventStreams(
            sessions,
            per_session=streams_per_session,
            total=streams,
            per_tenant=streams_per_tenant,
            interval_s=refresh_s,
            operator_reserve=operator_streams,
            newcomer_reserve=newcomer_streams,
            cpu_share=cpu_share,
        ),
    )


__all__ = ["Console", "Sources", "build_console"]
