"""The future table: every operation's promise, its result, and the long-poll waiters on it.

Results are produced on the engine worker thread and consumed by `retrieve_future` handlers on
the HTTP event loop. A poll that finds the result pending parks on an asyncio future that the
worker resolves through `call_soon_threadsafe`, so a result is delivered the moment it exists
and the client (which re-polls instantly on `try_again`) never spins. Every future is written to
SQLite when created, so after a crash the ones still pending are failed with a clear message
instead of leaving their clients polling forever.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from lorafleet.server.errors import ApiError, NotFound
from lorafleet.server.store import Store

JSON = "application/json"
PROTOBUF = "application/x-protobuf"
_KEEP_DONE_IN_MEMORY = 4096


@dataclass
class Result:
    content_type: str
    body: bytes
    failed: bool = False

    @staticmethod
    def json(obj: object) -> Result:
        # NaN/inf can appear in metrics (a diverged run); Python's json, which the SDK uses,
        # reads them back, and refusing to answer would hide the divergence instead.
        return Result(JSON, json.dumps(obj).encode())

    @staticmethod
    def proto(body: bytes) -> Result:
        return Result(PROTOBUF, body)

    @staticmethod
    def error(err: ApiError) -> Result:
        return Result(JSON, json.dumps(err.body()).encode(), failed=True)


@dataclass
class _Entry:
    tenant: str
    result: Result | None = None
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(
        default_factory=list
    )


class FutureTable:
    def __init__(self, store: Store):
        self.store = store
        self._lock = threading.Lock()
        self._pending: dict[str, _Entry] = {}
        self._done: OrderedDict[str, _Entry] = OrderedDict()
        self._closed = False

    def create(
        self,
        request_id: str,
        tenant: str,
        *,
        kind: str,
        scope: str | None = None,
        seq_id: int | None = None,
        fingerprint: str | None = None,
    ) -> None:
        """Raises sqlite3.IntegrityError when (scope, seq_id) is already taken."""
        self.store.add_future(request_id, tenant, scope, seq_id, kind, fingerprint)
        with self._lock:
            self._pending[request_id] = _Entry(tenant=tenant)

    def complete(self, request_id: str, result: Result) -> None:
        self.store.finish_future(
            request_id, "failed" if result.failed else "done", result.content_type, result.body
        )
        with self._lock:
            entry = self._pending.pop(request_id, None)
            if entry is None:
                return
            entry.result = result
            waiters, entry.waiters = entry.waiters, []
            self._done[request_id] = entry
            while len(self._done) > _KEEP_DONE_IN_MEMORY:
                self._done.popitem(last=False)
        for loop, waiter in waiters:
            loop.call_soon_threadsafe(_wake, waiter)

    def is_pending(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._pending

    def _lookup(self, request_id: str, tenant: str) -> _Entry:
        with self._lock:
            entry = self._pending.get(request_id) or self._done.get(request_id)
        if entry is None:
            row = self.store.get_future(request_id)
            if row is not None and row.state != "pending":
                assert row.content_type is not None and row.body is not None
                entry = _Entry(
                    row.tenant, Result(row.content_type, row.body, failed=row.state == "failed")
                )
        if entry is None or entry.tenant != tenant:
            raise NotFound(f"unknown request_id {request_id!r}")
        return entry

    async def wait(self, request_id: str, tenant: str, timeout: float) -> Result | None:
        """The result, or None when it is still pending after `timeout` seconds."""
        entry = self._lookup(request_id, tenant)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if entry.result is not None or self._closed:
                return entry.result
            entry.waiters.append((loop, waiter))
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                if (loop, waiter) in entry.waiters:
                    entry.waiters.remove((loop, waiter))
        return entry.result

    def close(self) -> None:
        """Releases every parked poll (they answer try_again) so that shutdown is not held up."""
        with self._lock:
            self._closed = True
            waiters = [w for entry in self._pending.values() for w in entry.waiters]
            for entry in self._pending.values():
                entry.waiters = []
        for loop, waiter in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_wake, waiter)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
