"""Server-sent events for the console: each open page gets its view again whenever it changes.

A stream builds its snapshot on a worker thread (`anyio.to_thread`), never on the event loop
and never on the engine worker, once per `interval_s`, and sends it only when it differs from
the last one sent; a comment line goes out every `heartbeat_s` otherwise, so proxies keep the
connection and a closed tab is noticed. Streams are bounded per session and in total (a 429
past either), and a stream ends when its session does (sign-out, expiry, a key removed by a
reload), so a revoked key stops receiving data within one interval."""

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
    ):
        if per_session < 1 or total < 1 or per_tenant < 1 or interval_s <= 0 or heartbeat_s <= 0:
            raise ValueError(
                "console event streams need per_session, total, per_tenant >= 1 and positive "
                f"intervals, got {per_session!r}, {total!r}, {per_tenant!r}, {interval_s!r}, "
                f"{heartbeat_s!r}"
            )
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

    def check(self, session: ConsoleSession) -> None:
        """Refuses (429) a stream past the bounds, before its response starts."""
        with self._lock:
            self._check(session)

    def _check(self, session: ConsoleSession) -> None:
        if self.open_streams >= self.total:
            raise TooManyStreams(
                f"the console has {self.open_streams} event streams open, its limit; "
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

    def _acquire(self, session: ConsoleSession) -> None:
        with self._lock:
            self._check(session)  # again: another stream may have opened since `check`
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

    async def stream(
        self, session: ConsoleSession, snapshot: Callable[[], dict[str, Any]]
    ) -> AsyncIterator[bytes]:
        """`snapshot` runs on a worker thread. An ApiError from it (the run was deleted, say)
        is sent as a `failure` event (not `error`: EventSource keeps that name for its own
        connection errors) and ends the stream; anything else is logged, counted and sent
        the same way (the page reconnects)."""
        try:
            self._acquire(session)  # in the generator: a closed tab's stream releases it
        except TooManyStreams as exc:
            yield _event("failure", json.dumps(exc.body()))
            return
        try:
            yield b"retry: 3000\n\n"
            last: str | None = None
            sent_at = time.monotonic()
            while self.sessions.alive(session.id):
                try:
                    data = await anyio.to_thread.run_sync(snapshot)
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
                encoded = json.dumps(data, sort_keys=True)
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


def _event(name: str, data: str) -> bytes:
    return f"event: {name}\ndata: {data}\n\n".encode()
