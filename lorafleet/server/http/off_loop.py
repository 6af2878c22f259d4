"""Every route's blocking work runs here, off the event loop: body decoding (zstd, JSON and
protobuf parsing), fingerprint hashing, SQLite, intake. One event loop answers every tenant, so
a 4 MB forward_backward decoded on it stalls every other request for as long as that takes
(issue 31); here it holds one worker thread of a bounded pool instead.

Two guarantees, both needed by the Tinker SDK and by fairness:

- **Per-tenant order.** Each tenant's work forms one lane (a FIFO): a lane runs one job at a
  time, in the order the routes handed them over (the order their bodies finished arriving), so
  a tenant's forward_backward is in intake before the optim_step it sent after it. Without that,
  a small request could overtake a big one of the same model and wait at the scheduler for the
  missing seq_id, and a flood of big bodies could hold a seq_id past the gap timeout.
- **A flooder holds at most one worker, and big bodies at most `large_workers`.** Lanes with
  work take turns (round-robin), and a lane's job runs only while no other job of that lane
  does, so one tenant sending sixteen 4 MB bodies occupies one worker, not the pool. A job
  for a body of `large_bytes` or more runs only while fewer than `large_workers` large jobs
  run, so several flooding tenants together still leave `workers - large_workers` workers
  to everyone else's small requests (a lane whose next job is large waits without holding up
  the lanes behind it).

Work handed over always runs, even when the client disconnects while it waits: the body has
arrived, and (as when the work ran on the loop) the request then counts, so a retry finds it.
An exception raised by the work is re-raised in the route, so errors answer the same 4xx/5xx as
when the work ran on the loop.

Threads start on demand (a server that answers nothing starts none) and end at `close`, which
fails what is still queued with a server error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from fastapi import Request

from lorafleet.server.errors import ServerFault
from lorafleet.server.http import parse, schemas
from lorafleet.server.http.bodies import BodyReader, tenant
from lorafleet.server.state.keys import Tenant

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_WORKERS = 4
DEFAULT_LARGE_BYTES = 1 << 20
SHUTTING_DOWN = "the server is shutting down; send the request again"


@dataclass
class _Job(Generic[T]):
    work: Callable[[], T]
    large: bool
    deliver: Callable[[T | None, BaseException | None], None]


@dataclass
class _Lane:
    jobs: deque[_Job[Any]] = field(default_factory=deque)
    running: bool = False


@dataclass(frozen=True)
class LaneStats:
    """What `stats()` reports: jobs queued and running, of them large, and lanes with work."""

    queued: int
    running: int
    large_running: int
    lanes: int
    workers: int

    def as_dict(self) -> dict[str, int]:
        return {
            "queued": self.queued,
            "running": self.running,
            "large_running": self.large_running,
            "lanes": self.lanes,
            "workers": self.workers,
        }


class Lanes:
    """A bounded pool of worker threads serving per-tenant FIFO lanes in turns (see the module
    docstring). `submit` never blocks; `run` awaits the result on the caller's event loop."""

    def __init__(
        self,
        workers: int = DEFAULT_WORKERS,
        *,
        large_bytes: int = DEFAULT_LARGE_BYTES,
        large_workers: int | None = None,
        name: str = "lorafleet-request",
    ):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        large = max(1, workers // 2) if large_workers is None else large_workers
        if not 1 <= large <= workers:
            raise ValueError(f"large_workers must be in [1, {workers}], got {large_workers}")
        if large_bytes < 0:
            raise ValueError(f"large_bytes must be >= 0, got {large_bytes}")
        self.workers = workers
        self.large_bytes = large_bytes
        self.large_workers = large
        self._name = name
        self._cond = threading.Condition()
        self._lanes: dict[str, _Lane] = {}
        self._ready: deque[str] = deque()  # lanes with queued work and none running, in turn
        self._threads: list[threading.Thread] = []
        self._idle = 0  # workers waiting for work
        self._running = 0
        self._large_running = 0
        self._closed = False

    # ------------------------------------------------------------------ handing work over
    def submit(
        self,
        lane: str,
        work: Callable[[], T],
        deliver: Callable[[T | None, BaseException | None], None],
        *,
        size: int = 0,
    ) -> None:
        """Queues `work` at the end of `lane`; `deliver(result, None)` or `deliver(None, error)`
        is called on the worker thread once it ran. `size`: the body's bytes (large ones take a
        large slot)."""
        job = _Job(work, size >= self.large_bytes, deliver)
        with self._cond:
            if self._closed:
                raise ServerFault(SHUTTING_DOWN)
            entry = self._lanes.get(lane)
            if entry is None:
                entry = self._lanes[lane] = _Lane()
            entry.jobs.append(job)
            if not entry.running and len(entry.jobs) == 1:
                self._ready.append(lane)
            if self._idle == 0 and len(self._threads) < self.workers:
                self._start_worker()
            self._cond.notify()

    async def run(self, lane: str, work: Callable[[], T], *, size: int = 0) -> T:
        """`work()`'s result, computed on a worker in `lane`'s order; its exception re-raised
        here. Cancelling the caller does not cancel the work (see the module docstring)."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, error: BaseException | None) -> None:
            if answer.done():  # the caller was cancelled: nobody to tell
                return
            if error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(result)  # type: ignore[arg-type]  # T when error is None

        def deliver(result: T | None, error: BaseException | None) -> None:
            # RuntimeError: the loop closed (shutdown), the caller is gone
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, result, error)

        self.submit(lane, work, deliver, size=size)
        return await answer

    # ------------------------------------------------------------------ the workers
    def _start_worker(self) -> None:
        """(caller holds the lock)"""
        thread = threading.Thread(
            target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _next(self) -> tuple[str, _Job[Any]] | None:
        """The first lane in turn whose head may run now, taken off the turn order (caller
        holds the lock); None when every waiting lane's head is large and the large slots are
        taken, or nothing waits."""
        for position, lane in enumerate(self._ready):
            entry = self._lanes[lane]
            head = entry.jobs[0]
            if head.large and self._large_running >= self.large_workers:
                continue
            del self._ready[position]
            entry.jobs.popleft()
            entry.running = True
            self._running += 1
            self._large_running += head.large
            return lane, head
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                taken = self._next()
                while taken is None:
                    if self._closed:
                        return
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                    taken = self._next()
            lane, job = taken
            result: Any = None
            error: BaseException | None = None
            try:
                result = job.work()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the route, which answers it
                error = exc
            try:
                job.deliver(result, error)
            except Exception:  # a broken callback must not end the worker
                log.exception("delivering the result of a request's work failed")
            with self._cond:
                entry = self._lanes[lane]
                entry.running = False
                self._running -= 1
                self._large_running -= job.large
                if entry.jobs:
                    self._ready.append(lane)  # to the back: the other lanes' turn first
                else:
                    del self._lanes[lane]
                self._cond.notify_all()  # a large slot may be free again

    # ------------------------------------------------------------------ state, shutdown
    def stats(self) -> LaneStats:
        with self._cond:
            return LaneStats(
                queued=sum(len(entry.jobs) for entry in self._lanes.values()),
                running=self._running,
                large_running=self._large_running,
                lanes=len(self._lanes),
                workers=len(self._threads),
            )

    def close(self) -> None:
        """Fails what is queued (a server error: the request may be sent again), lets running
        work finish and joins the workers."""
        with self._cond:
            self._closed = True
            dropped = [job for entry in self._lanes.values() for job in entry.jobs]
            for entry in self._lanes.values():
                entry.jobs.clear()
            self._ready.clear()
            threads = list(self._threads)
            self._cond.notify_all()
        for job in dropped:
            job.deliver(None, ServerFault(SHUTTING_DOWN))
        for thread in threads:
            thread.join()


class OffLoop:
    """What every route calls: its caller and body read on the loop (I/O), its work (body
    parsing included) run in the caller's lane. `public` lanes are for the routes without a
    key (signed links), named by what they serve."""

    def __init__(self, bodies: BodyReader, lanes: Lanes):
        self.bodies = bodies
        self.lanes = lanes

    async def call(self, request: Request, work: Callable[[Tenant], T]) -> T:
        """A route without a body: `work(caller)`."""
        who = tenant(request)
        return await self.lanes.run(who.id, lambda: work(who))

    async def json(self, request: Request, work: Callable[[Tenant, Any], T]) -> T:
        """A JSON route: `work(caller, parsed body)`, the parsing in the lane too."""
        who = tenant(request)
        raw = await self.bodies.raw(request, self.bodies.max_json_bytes)
        return await self.lanes.run(
            who.id, lambda: work(who, schemas.parse_json(raw)), size=len(raw)
        )

    async def raw_json(self, request: Request, work: Callable[[Tenant, bytes], T]) -> T:
        """A JSON route that needs the bytes as sent (a fingerprint of them): `work(caller,
        raw)`, parsing left to `work`."""
        who = tenant(request)
        raw = await self.bodies.raw(request, self.bodies.max_json_bytes)
        return await self.lanes.run(who.id, lambda: work(who, raw), size=len(raw))

    async def protobuf(self, request: Request, work: Callable[[Tenant, bytes], T]) -> T:
        """A protobuf route (forward_backward): `work(caller, raw body)` under the larger
        protobuf limit, sized by what the body decompresses to (its zstd frame's header)."""
        who = tenant(request)
        raw = await self.bodies.protobuf(request)
        size = parse.decoded_size(raw, request.headers.get("content-encoding"))
        return await self.lanes.run(who.id, lambda: work(who, raw), size=size)

    async def public(self, lane: str, work: Callable[[], T]) -> T:
        """Work of a route without a key (a signed link's check and reads), in a lane of its
        own named by the route and the tenant the link claims (checked by `work`)."""
        return await self.lanes.run(f"public:{lane}", work)
