"""The future table: every operation's promise, its result, and the long-poll waiters on it.

Results are produced on the engine worker thread and consumed by `retrieve_future` handlers on
the HTTP event loop. A poll that finds the result pending parks on an asyncio future that the
worker resolves through `call_soon_threadsafe`, so a result is delivered the moment it exists
and the client (which re-polls instantly on `try_again`) never spins. Every future is written to
SQLite when created, so after a crash the ones still pending are failed with a clear message
instead of leaving their clients polling forever.

Finished results are bounded by bytes, not by count: one sample result can be megabytes. In
memory the newest are kept up to `memory_bytes` (big ones, over `memory_entry_bytes`, are read
back from SQLite instead); in SQLite the oldest are deleted once their total passes
`stored_bytes`, besides the TTL. A result whose row could not be written (a full disk) is still
delivered from memory; should it have to leave memory unstored, a late poll gets an error that
says so rather than a 404. While the disk is known to be full, results over
`FULL_DISK_STORE_BYTES` are not even tried in SQLite: a few sample results would otherwise eat
the reserve that keeps deletions (the way out of a full disk) writable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from lorafleet.server.errors import ApiError, NotFound, ServerFault
from lorafleet.server.state.store import Store

log = logging.getLogger(__name__)

JSON = "application/json"
PROTOBUF = "application/x-protobuf"
PROBLEM_LOST = (
    "the result of this request could not be stored (the server's data disk was full when it "
    "finished) and was dropped from memory before it was collected; submit the request again"
)
_ENTRY_OVERHEAD = 256  # bytes an in-memory entry costs besides its body (ids, objects)
_KEEP_LOST = 65536  # unstored results that left memory: their ids, so a late poll is told why
FULL_DISK_STORE_BYTES = 4096  # results still written to SQLite while the disk is full


@dataclass
class Result:
    content_type: str
    body: bytes
    failed: bool = False
    # A forward(_backward)'s merged metrics beside its body, for the work hook (the console's
    # loss points) to read without parsing the body again; never stored or sent.
    metrics: Mapping[str, float] | None = field(default=None, compare=False, repr=False)
    # A sample's tokens generated, for metering (never parsed back out of the body).
    sampled_tokens: int = field(default=0, compare=False, repr=False)
    # prompt tokens a sample's prefill took from the prefix cache (metered apart from the rest)
    cached_prompt_tokens: int = field(default=0, compare=False, repr=False)
    prefill_tokens: int = field(default=0, compare=False, repr=False)  # (samples, for metering)

    @staticmethod
    def json(obj: object) -> Result:
        # NaN/inf can appear in metrics (a diverged run); Python's json, which the SDK uses,
        # reads them back, and refusing to answer would hide the divergence instead.
        return Result(JSON, json.dumps(obj).encode())

    @staticmethod
    def proto(
        body: bytes,
        metrics: Mapping[str, float] | None = None,
        sampled_tokens: int = 0,
        cached_prompt_tokens: int = 0,
        prefill_tokens: int = 0,
    ) -> Result:
        return Result(
            PROTOBUF,
            body,
            metrics=metrics,
            sampled_tokens=sampled_tokens,
            cached_prompt_tokens=cached_prompt_tokens,
            prefill_tokens=prefill_tokens,
        )

    @staticmethod
    def error(err: ApiError) -> Result:
        return Result(JSON, json.dumps(err.body()).encode(), failed=True)


@dataclass
class _Entry:
    tenant: str
    result: Result | None = None
    stored: bool = False  # the result is in SQLite too (it may leave memory)
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(
        default_factory=list
    )

    def cost(self) -> int:
        return _ENTRY_OVERHEAD + (0 if self.result is None else len(self.result.body))


class FutureTable:
    def __init__(
        self,
        store: Store,
        *,
        memory_bytes: int = 64 << 20,
        memory_entry_bytes: int = 1 << 20,
        stored_bytes: int = 1 << 30,
        ttl_s: float = 24 * 3600.0,
        disk_full: Callable[[], bool] | None = None,
    ):
        """`disk_full` (DiskGuard.full): whether the data disk is known to be full now."""
        self.store = store
        self.disk_full = disk_full
        self.memory_bytes = memory_bytes
        self.memory_entry_bytes = memory_entry_bytes
        self.stored_bytes = stored_bytes
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._pending: dict[str, _Entry] = {}
        self._done: OrderedDict[str, _Entry] = OrderedDict()
        self._done_bytes = 0
        self._lost: OrderedDict[str, str] = OrderedDict()  # request_id -> tenant
        self._stored_since_prune = 0
        self.unstored = 0  # results whose row could not be written
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
        """Raises sqlite3.IntegrityError when (scope, seq_id) is already taken, DiskFull when
        the row cannot be written."""
        self.store.futures.add(request_id, tenant, scope, seq_id, kind, fingerprint)
        with self._lock:
            self._pending[request_id] = _Entry(tenant=tenant)

    def complete(self, request_id: str, result: Result) -> None:
        """Records the result, then hands it to its waiters; a failed write (a full disk) still
        delivers it, from memory. Never raises: the worker calls it for every op."""
        self.deliver(request_id, result, stored=self._record(request_id, result))

    def _record(self, request_id: str, result: Result) -> bool:
        if (
            len(result.body) > FULL_DISK_STORE_BYTES
            and self.disk_full is not None
            and self.disk_full()
        ):
            with self._lock:
                self.unstored += 1
            return False
        try:
            self.store.futures.finish(
                request_id, "failed" if result.failed else "done", result.content_type, result.body
            )
        except Exception:  # delivered from memory instead; logged, counted
            log.exception("could not store the result of %s; it is kept in memory", request_id)
            with self._lock:
                self.unstored += 1
            return False
        with self._lock:  # the worker and the HTTP thread (failed submissions) both get here
            self._stored_since_prune += len(result.body)
            due = self._stored_since_prune > self.stored_bytes // 4
        if due:
            self.prune_stored()
        return True

    def prune_stored(self) -> int:
        """Deletes the oldest finished results past `stored_bytes` (a failure is logged: the
        bound is then enforced at the next call). Between calls the stored results may pass the
        bound by a quarter of it."""
        with self._lock:
            self._stored_since_prune = 0
        try:
            return self.store.futures.prune_to_bytes(self.stored_bytes)
        except Exception:  # retried at the next prune; logged
            log.exception("could not prune stored results to %d bytes", self.stored_bytes)
            return 0

    def deliver(self, request_id: str, result: Result, *, stored: bool) -> None:
        """The in-memory half of `complete`: wakes the waiters and keeps the result within the
        memory bound."""
        with self._lock:
            entry = self._pending.pop(request_id, None)
            if entry is None:
                return
            entry.result = result
            entry.stored = stored
            waiters, entry.waiters = entry.waiters, []
            if not stored or entry.cost() <= self.memory_entry_bytes:
                self._done[request_id] = entry
                self._done_bytes += entry.cost()
            while self._done_bytes > self.memory_bytes and self._done:
                old_id, old = self._done.popitem(last=False)
                self._done_bytes -= old.cost()
                if not old.stored:
                    self._lost[old_id] = old.tenant
                    while len(self._lost) > _KEEP_LOST:
                        self._lost.popitem(last=False)
        for loop, waiter in waiters:
            loop.call_soon_threadsafe(_wake, waiter)

    def is_pending(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._pending

    def memory(self) -> dict[str, int]:
        with self._lock:
            return {
                "results_in_memory": len(self._done),
                "results_in_memory_bytes": self._done_bytes,
                "results_unstored": self.unstored,
            }

    def _lookup(self, request_id: str, tenant: str) -> _Entry:
        with self._lock:
            entry = self._pending.get(request_id) or self._done.get(request_id)
            lost = self._lost.get(request_id)
        if entry is None and lost is not None:
            entry = _Entry(lost, Result.error(ServerFault(PROBLEM_LOST)))
        if entry is None:
            row = self.store.futures.get(request_id)
            if row is not None and row.state != "pending":
                assert row.content_type is not None and row.body is not None
                entry = _Entry(
                    row.tenant, Result(row.content_type, row.body, failed=row.state == "failed")
                )
        if entry is None or entry.tenant != tenant:
            raise NotFound(
                f"unknown request_id {request_id!r}: not one of yours, or its result was dropped "
                f"(results are kept for {self.ttl_s / 3600:g} h and up to "
                f"{self.stored_bytes / 2**20:g} MiB in all, the oldest dropped first)"
            )
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
