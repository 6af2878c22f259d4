"""Server-sent events for the console: each open page gets its view again whenever it changes.

A stream builds its snapshot on a worker thread (`anyio.to_thread`), never on the event loop
and never on the engine worker, once per `interval_s`, and sends it only when it differs from
the last one sent; a comment line goes out every `heartbeat_s` otherwise, so proxies keep the
connection and a closed tab is noticed. Streams are bounded per session, per tenant and in
total (a 429 past any), with two reserves in the total: the last `operator_reserve` places are
for operators, and the `newcomer_reserve` before them for tenants that hold no stream yet, so
tenants that fill their own bounds never lock out the operator or a tenant arriving later. A
stream ends when its session does (sign-out, expiry, a key removed by a reload), so a revoked
key stops receiving data within one interval.

What streams cost is bounded in all, not per stream: snapshots are built one at a time, and
after a build that took `t` the next (any stream's) waits `t * (1 / cpu_share - 1)`, so the
console's snapshot work takes at most `cpu_share` of the wall time (of one core; less of the
GIL the engine needs) however many streams are open; with many streams each one's cadence
stretches instead. A run's curves go out as deltas (the points after those sent, see
routes.RunSnapshot), not as the whole curves every time."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from lorafleet.server.console.sessions import ConsoleSession, ConsoleSessions
from lorafleet.server.errors import ApiError, UserError

log = logging.getLogger(__name__)


MAX_PAUSE_S = 5.0  # the longest idle time one build imposes on the next


class TooManyStreams(UserError):
    status = 429


class EventStreams:
    def __init__(
        self,
        sessions: ConsoleSessions,
        *,
        per_session: int = 4,
        total: int = 64,
        per_tenant: int = 16,
        interval_s: float = 1.0,
        heartbeat_s: float = 15.0,
        operator_reserve: int = 0,
        newcomer_reserve: int = 0,
        cpu_share: float = 0.1,
    ):
        if per_session < 1 or total < 1 or per_tenant < 1 or interval_s <= 0 or heartbeat_s <= 0:
            raise ValueError(
                "console event streams need per_session, total, per_tenant >= 1 and positive "
                f"intervals, got {per_session!r}, {total!r}, {per_tenant!r}, {interval_s!r}, "
                f"{heartbeat_s!r}"
            )
        if (
            operator_reserve < 0
            or newcomer_reserve < 0
            or operator_reserve + newcomer_reserve >= total
        ):
            raise ValueError(
                "console stream reserves must be >= 0 and leave places besides them: "
                f"operator_reserve {operator_reserve!r} + newcomer_reserve {newcomer_reserve!r} "
                f"must be below total {total!r}"
            )
        if not 0 < cpu_share <= 1:
            raise ValueError(f"console cpu_share must be in (0, 1], got {cpu_share!r}")
        self.operator_reserve = operator_reserve
        self.newcomer_reserve = newcomer_reserve
        self.cpu_share = cpu_share
        self._build_lock: asyncio.Lock | None = None  # made on the event loop, on first use
        self._next_build = 0.0  # monotonic time before which no snapshot is built
        self.builds = 0
        self.build_seconds = 0.0
        self.sessions = sessions
        self.per_session = per_session
        self.total = total
        # one tenant's sessions together: without it one key, signed in a few times, could
        # hold every stream and leave the other tenants (and the operator) none
        self.per_tenant = per_tenant
        self._tenant_streams: dict[str, int] = {}
        self.interval_s = interval_s
        self.heartbeat_s = heartbeat_s
        self._lock = threading.Lock()
        self.open_streams = 0
        self.failures = 0

    def check(self, session: ConsoleSession, operator: bool = False) -> None:
        """Refuses (429) a stream past the bounds, before its response starts."""
        with self._lock:
            self._check(session, operator)

    def _check(self, session: ConsoleSession, operator: bool = False) -> None:
        free = self.total - self.open_streams
        held = self._tenant_streams.get(session.tenant_id, 0)
        # operators may take every place; a tenant without a stream all but the operators'
        # reserve; a tenant already streaming all but both reserves
        keep = 0 if operator else self.operator_reserve + (self.newcomer_reserve if held else 0)
        if free <= keep:
            raise TooManyStreams(
                f"the console has {self.open_streams} of {self.total} event streams open and "
                f"keeps the last {keep} for "
                + ("operators and tenants without a stream" if held else "operators")
                + "; close another page and retry"
                if keep
                else f"the console has {self.open_streams} event streams open, its limit; "
                "close another page and retry"
            )
        if self._tenant_streams.get(session.tenant_id, 0) >= self.per_tenant:
            raise TooManyStreams(
                f"tenant {session.tenant_id} has {self.per_tenant} console event streams open, "
                "its limit; close another page of the console"
            )
        if session.streams >= self.per_session:
            raise TooManyStreams(
                f"this console session has {session.streams} event streams open, the limit "
                f"of {self.per_session}; close another tab of the console"
            )

    def _acquire(self, session: ConsoleSession, operator: bool) -> None:
        with self._lock:
            self._check(session, operator)  # again: another stream may have opened since
            self.open_streams += 1
            session.streams += 1
            tenant = session.tenant_id
            self._tenant_streams[tenant] = self._tenant_streams.get(tenant, 0) + 1

    def _release(self, session: ConsoleSession) -> None:
        with self._lock:
            self.open_streams -= 1
            session.streams -= 1
            left = self._tenant_streams.pop(session.tenant_id) - 1
            if left:
                self._tenant_streams[session.tenant_id] = left

    async def _build(self, snapshot: Callable[[], dict[str, Any]]) -> str:
        """The snapshot, encoded, built on a worker thread under the shared budget (see the
        module docstring): one build at a time, each followed by its share of idle time."""
        if self._build_lock is None:
            self._build_lock = asyncio.Lock()
        async with self._build_lock:  # FIFO: every stream gets its turn
            wait = self._next_build - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            started = time.monotonic()
            try:
                return await anyio.to_thread.run_sync(_encoded, snapshot)
            finally:
                took = time.monotonic() - started
                self.builds += 1
                self.build_seconds += took
                # at most MAX_PAUSE_S: one build slowed by a busy machine must not stall
                # every stream for minutes
                pause = min(took * (1 / self.cpu_share - 1), MAX_PAUSE_S)
                self._next_build = time.monotonic() + pause

    async def stream(
        self,
        session: ConsoleSession,
        snapshot: Callable[[], dict[str, Any]],
        operator: bool = False,
    ) -> AsyncIterator[bytes]:
        """`snapshot` runs on a worker thread. An ApiError from it (the run was deleted, say)
        is sent as a `failure` event (not `error`: EventSource keeps that name for its own
        connection errors) and ends the stream; anything else is logged, counted and sent
        the same way (the page reconnects)."""
        try:
            self._acquire(session, operator)  # in the generator: a closed tab's stream releases it
        except TooManyStreams as exc:
            yield _event("failure", json.dumps(exc.body()))
            return
        try:
            yield b"retry: 3000\n\n"
            last: str | None = None
            sent_at = time.monotonic()
            while self.sessions.alive(session.id):
                try:
                    encoded = await self._build(snapshot)
                except ApiError as exc:
                    yield _event("failure", json.dumps(exc.body()))
                    return
                except Exception:
                    self.failures += 1
                    log.exception("a console event stream's snapshot failed; the stream ends")
                    yield _event(
                        "failure", json.dumps({"error": "internal error", "category": "server"})
                    )
                    return
                if encoded != last:
                    last = encoded
                    sent_at = time.monotonic()
                    yield _event("snapshot", encoded)
                elif time.monotonic() - sent_at >= self.heartbeat_s:
                    sent_at = time.monotonic()
                    yield b": heartbeat\n\n"
                await asyncio.sleep(self.interval_s)
            yield _event("signed_out", "{}")
        finally:
            self._release(session)


def _encoded(snapshot: Callable[[], dict[str, Any]]) -> str:
    return json.dumps(snapshot(), sort_keys=True)


def _event(name: str, data: str) -> bytes:
    return f"event: {name}\ndata: {data}\n\n".encode()
