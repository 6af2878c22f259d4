"""Per-model seq ordering and cross-tenant batching, on one engine worker thread.

Each model's operations carry a `seq_id`; the SDK submits concurrent chunks of one call in any
order (the first one last, on purpose), so an operation runs only when every lower seq of its
model has run. Across models there is no order, which is what lets one round of the worker do:

1. control operations (create, save, load, failures) at the head of their model's queue;
2. ONE mixed forward/backward over every model whose head is forward/forward_backward work
   (consecutive chunks of the same model join the same batch);
3. ONE optimizer call for every model whose head is now an optim_step (the fwd/bwd just run
   usually put it there);
4. new samples join the sampler's running batch (continuous batching: requests that arrive
   while others decode share their forwards), which then advances for a time slice, or until
   other work is waiting, before the next round.

Torch work happens only on the worker thread (two cores: one busy thread is the fastest way to
run it) so the HTTP event loop stays responsive. That includes loading the model: with GNU
OpenMP, a second thread running parallel torch ops makes the runtime see more threads than
cores and stop spinning between parallel regions, and every small op then pays a wake-up.

The worker never raises out of a round: an executor failure fails that group's futures with a
server error and is logged, a full data disk fails them with DiskFull (507; checkpoint writes
are refused while it lasts, see disk.py), and anything else that escapes a round fails the
round's operations and the worker goes on. Should the thread end all the same, everything
queued fails, every later request fails at once, and `liveness()` (behind /healthz) says "dead".
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from lorafleet.server import disk
from lorafleet.server.disk import DiskGuard
from lorafleet.server.errors import ServerFault, UserError
from lorafleet.server.futures import FutureTable, Result
from lorafleet.server.redact import internal_error

log = logging.getLogger(__name__)

TRAIN_KINDS = frozenset({"forward", "forward_backward"})
OPTIM_KIND = "optim_step"
SAMPLE_KIND = "sample"
CREATE_KINDS = frozenset({"create_model", "create_from_state"})
DISK_WRITE_KINDS = frozenset({"save_weights", "save_sampler"})
ENGINE_DEAD = (
    "the server's engine stopped after an internal error and cannot run requests; "
    "the server must be restarted (see its log)"
)
MAX_SEQ_AHEAD = 10_000
"""How far past a model's next seq_id a request may be queued. The SDK's chunks of one call are
consecutive; a seq_id further ahead is a client bug or abuse, and would sit in memory until
the gap timeout."""
SKIPPED_REMEMBERED = 64
"""Skipped seq_ids remembered per model, so that one arriving late is told why it is refused."""


@dataclass(eq=False)
class Op:
    request_id: str
    kind: str
    tenant: str
    payload: Any
    model_id: str | None = None
    seq_id: int | None = None  # None: not ordered (creation, samples)
    scope: str | None = None  # what batching counts as "one client" (model or sampling session)
    submitted: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class PendingSample:
    """A sample request running in the sampler's batch; `finish` turns its outcome into a Result."""

    future: Future[Any]
    convert: Callable[[Any], Result]

    def finish(self) -> Result:
        exc = self.future.exception()
        if exc is not None:
            log.error("a sample request failed in the sampler", exc_info=exc)
            return Result.error(ServerFault(internal_error("sampling", exc)))
        return self.convert(self.future.result())


class Executor(Protocol):
    """What the scheduler drives; each method returns one Result per op, in order."""

    def run_control(self, op: Op) -> Result: ...

    def run_train(self, ops: list[Op]) -> list[Result]: ...

    def run_optim(self, ops: list[Op]) -> list[Result]: ...

    def start_sample(self, ops: list[Op]) -> list[Result | PendingSample]: ...

    def step_sampler(self) -> bool: ...


E = TypeVar("E", bound=Executor)


@dataclass
class Stats:
    rounds: int = 0
    batches: Counter[str] = field(default_factory=Counter)  # kind -> engine calls
    mixed_batches: Counter[str] = field(default_factory=Counter)  # ... with > 1 client in them
    cross_tenant_batches: Counter[str] = field(default_factory=Counter)  # ... with > 1 tenant
    requests: Counter[str] = field(default_factory=Counter)  # kind -> ops completed
    failed: Counter[str] = field(default_factory=Counter)
    round_errors: int = 0  # exceptions that escaped a round (its ops failed, the worker went on)
    max_batch_clients: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "batches": dict(self.batches),
            "mixed_batches": dict(self.mixed_batches),
            "cross_tenant_batches": dict(self.cross_tenant_batches),
            "max_batch_clients": dict(self.max_batch_clients),
            "requests": dict(self.requests),
            "failed": dict(self.failed),
            "round_errors": self.round_errors,
        }


class Scheduler:
    """The engine worker thread and the queues it drains. The executor it drives is built by
    `start`, on that thread, so the scheduler exists first and nothing is wired afterwards."""

    def __init__(
        self,
        futures: FutureTable,
        *,
        batch_window_s: float = 0.0,
        gap_timeout_s: float = 30.0,
        sample_slice_s: float = 0.5,
        disk_guard: DiskGuard | None = None,
        stall_s: float = 600.0,
    ):
        """`stall_s`: how long one round may run, or queued work wait for one, before
        `liveness()` calls the engine stalled."""
        self.futures = futures
        self.disk_guard = disk_guard
        self.stall_s = stall_s
        self._round_began: float | None = None  # monotonic; None between rounds
        self._last_round = time.monotonic()
        self._in_round: dict[str, Op] = {}  # taken from the queues, not yet finished
        self._died = False
        self.batch_window_s = batch_window_s
        self.gap_timeout_s = gap_timeout_s
        self.sample_slice_s = sample_slice_s  # sampling time per round while other work waits
        self.stats = Stats()
        self._cond = threading.Condition()
        self._next_seq: dict[str, int] = {}
        self._gone: dict[str, str] = {}  # unloaded model -> why (its late requests fail at once)
        self._queues: dict[str, dict[int, Op]] = {}
        self._gaps: dict[str, tuple[int, float]] = {}  # model -> (missing seq, first seen)
        self._skipped: dict[str, deque[int]] = {}  # model -> seq_ids given up on (newest last)
        self._unordered: list[Op] = []
        self._calls: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._sampling: list[tuple[Op, PendingSample]] = []  # worker thread only
        self._paused = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, build: Callable[[], E]) -> Future[E]:
        """`build` runs first on the worker thread (torch settings, loading the model) and makes
        the executor every round then drives; the returned future carries that executor, or
        `build`'s exception (the worker then stops)."""
        started: Future[E] = Future()
        self._thread = threading.Thread(
            target=self._worker, args=(build, started), name="lorafleet-engine", daemon=True
        )
        self._thread.start()
        return started

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def pause(self) -> None:
        """Holds every round (tests use it to line up requests from several clients)."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    # ------------------------------------------------------------------ intake
    def register_model(self, model_id: str, next_seq: int = 1) -> None:
        with self._cond:
            self._next_seq[model_id] = next_seq
            self._queues.setdefault(model_id, {})
            self._cond.notify_all()

    def forget_model(self, model_id: str, reason: str) -> None:
        """Fails whatever the model still has queued (it was unloaded)."""
        with self._cond:
            self._next_seq.pop(model_id, None)
            self._gaps.pop(model_id, None)
            self._skipped.pop(model_id, None)
            self._gone[model_id] = reason
            queued = list(self._queues.pop(model_id, {}).values())
        for op in queued:
            self._finish(op, Result.error(UserError(reason)))

    def submit(self, op: Op) -> None:
        error: UserError | ServerFault | None = None
        with self._cond:
            if self._died:
                error = ServerFault(ENGINE_DEAD)
            elif op.seq_id is None:
                self._unordered.append(op)
            else:
                assert op.model_id is not None
                expected = self._next_seq.get(op.model_id)
                if op.model_id in self._gone:
                    error = UserError(self._gone[op.model_id])
                elif expected is not None and op.seq_id in self._skipped.get(op.model_id, ()):
                    error = UserError(
                        f"seq_id {op.seq_id} of model {op.model_id!r} arrived after the server gave up waiting "
                        f"for it ({self.gap_timeout_s:g} s, the gap timeout) and ran the model's later requests "
                        "without it; submit the operation again"
                    )
                elif expected is not None and op.seq_id < expected:
                    error = UserError(
                        f"seq_id {op.seq_id} of model {op.model_id!r} was already executed (next is {expected})"
                    )
                elif expected is not None and op.seq_id > expected + MAX_SEQ_AHEAD:
                    error = UserError(
                        f"seq_id {op.seq_id} of model {op.model_id!r} is more than {MAX_SEQ_AHEAD} ahead of the next one "
                        f"to run ({expected}); seq_ids must be consecutive"
                    )
                else:
                    self._queues.setdefault(op.model_id, {})[op.seq_id] = op
            self._cond.notify_all()
        if error is not None:
            self._finish(op, Result.error(error))

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Runs `fn` on the worker thread between rounds (anything that touches the engine)."""
        future: Future[Any] = Future()
        with self._cond:
            if self._stopping:
                future.set_exception(
                    ServerFault(ENGINE_DEAD if self._died else "the server is shutting down")
                )
                return future
            self._calls.append((fn, future))
            self._cond.notify_all()
        return future

    def pending(self) -> int:
        with self._cond:
            return len(self._unordered) + sum(len(q) for q in self._queues.values())

    # ------------------------------------------------------------------ the worker
    def _ready(self) -> bool:
        return bool(self._sampling) or self._other_work_ready()

    def _other_work_ready(self) -> bool:
        """Work besides the running sample batch (caller holds the lock)."""
        if self._calls or self._unordered:
            return True
        return any(self._next_seq.get(m) in q for m, q in self._queues.items() if q)

    def _main(self, build: Callable[[], E], started: Future[E]) -> None:
        try:
            executor = build()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever started the worker
            with self._cond:
                self._stopping = True
            started.set_exception(exc)
            return
        started.set_result(executor)
        while True:
            with self._cond:
                self._expire_gaps()  # also when busy: other models' work must not hold a gap open
                while not self._stopping and (self._paused or not self._ready()):
                    self._cond.wait(timeout=1.0)
                    self._expire_gaps()
                if self._stopping:
                    return
            if self.batch_window_s > 0:
                time.sleep(self.batch_window_s)
            self._round(executor)

    def liveness(self) -> str:
        """The engine's state: "ok"; "stalled" when a round has run longer than `stall_s`, or
        work ready to run has waited that long with no round since; "dead" when the worker
        thread is gone."""
        if self._thread is None or not self._thread.is_alive() or self._died:
            return "dead"
        now = time.monotonic()
        with self._cond:
            began = self._round_began
            ready = [op.submitted for op in self._unordered] + [
                q[seq].submitted
                for m, q in self._queues.items()
                if (seq := self._next_seq.get(m)) is not None and seq in q
            ]
            waited = 0.0 if self._paused or not ready else now - min(ready)
        if began is not None and now - began > self.stall_s:
            return "stalled"
        if waited > self.stall_s and now - self._last_round > self.stall_s:
            return "stalled"
        return "ok"

    def _worker(self, build: Callable[[], E], started: Future[E]) -> None:
        """The thread's body: `_main`, and if that ever ends other than by `stop`, nothing is
        left waiting on it."""
        try:
            self._main(build, started)
        finally:
            if not self._stopping:
                log.critical(
                    "the engine worker thread stopped unexpectedly; failing all queued work"
                )
                self._abandon()

    def _abandon(self) -> None:
        """The worker is gone: fails whatever is queued or running and refuses new work."""
        with self._cond:
            self._died = True
            self._stopping = True
            ops = [op for q in self._queues.values() for op in q.values()] + self._unordered
            ops += list(self._in_round.values()) + [op for op, _ in self._sampling]
            self._queues = {m: {} for m in self._queues}
            self._unordered, self._sampling, self._in_round = [], [], {}
            calls, self._calls = self._calls, []
        fault = ServerFault(ENGINE_DEAD)
        for op in ops:
            self._finish(op, Result.error(fault))
        for _fn, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(fault)

    def _round(self, executor: Executor) -> None:
        """One round, guarded: whatever escapes it is logged and fails the operations the round
        had taken (the sampler's running batch included), and the worker goes on."""
        self._round_began = time.monotonic()
        try:
            self._run_round(executor)
        except Exception as exc:  # the worker must survive; the ops get the error
            log.exception("an error escaped an engine round; failing its operations")
            self.stats.round_errors += 1
            with self._cond:
                ops = list(self._in_round.values()) + [op for op, _ in self._sampling]
                self._in_round, self._sampling = {}, []
            error = self._failure("running the request", exc)
            for op in ops:
                self._finish(op, error)
        finally:
            self._round_began = None
            self._last_round = time.monotonic()

    def _failure(self, doing: str, exc: BaseException) -> Result:
        """The error an op gets for `exc`: DiskFull for any out-of-space error, else a server
        error naming only the exception's type (neither names a server path)."""
        if disk.is_disk_full(exc):
            if self.disk_guard is not None:
                self.disk_guard.release()
            return Result.error(disk.disk_full_error())
        return Result.error(ServerFault(internal_error(doing, exc)))

    def _run_control(self, executor: Executor, op: Op) -> Result:
        """A control op; a checkpoint write is refused at once while the data disk is full."""
        if self.disk_guard is not None and op.kind in DISK_WRITE_KINDS:
            self.disk_guard.check_room()
        return executor.run_control(op)

    def _run_round(self, executor: Executor) -> None:
        self.stats.rounds += 1
        with self._cond:
            calls, self._calls = self._calls, []
        for fn, future in calls:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:  # noqa: BLE001 - handed to the caller, who re-raises it
                    future.set_exception(exc)

        for op in self._take_control():
            self._run_group("control", [op], lambda ops: [self._run_control(executor, ops[0])])
        train = self._take_heads(lambda kind: kind in TRAIN_KINDS, consecutive=True)
        if train:
            self._run_group("forward_backward", train, executor.run_train)
        optim = self._take_heads(lambda kind: kind == OPTIM_KIND, consecutive=False)
        if optim:
            self._run_group("optim_step", optim, executor.run_optim)
        with self._cond:
            samples = [op for op in self._unordered if op.kind == SAMPLE_KIND]
            self._unordered = [op for op in self._unordered if op.kind != SAMPLE_KIND]
            self._in_round.update((op.request_id, op) for op in samples)
        if samples:
            self._start_samples(executor, samples)
        if self._sampling:
            self._step_sampler(executor)

    def _start_samples(self, executor: Executor, ops: list[Op]) -> None:
        try:
            started = executor.start_sample(ops)
            if len(started) != len(ops):
                raise RuntimeError(
                    f"sample: executor returned {len(started)} results for {len(ops)} ops"
                )
        except Exception as exc:
            log.exception("engine failure while queueing %d sample request(s)", len(ops))
            error = Result.error(ServerFault(internal_error("queueing samples", exc)))
            started = [error] * len(ops)
        self._count_batch("sample", [op for op, _ in self._sampling] + ops)
        for op, item in zip(ops, started, strict=True):
            if isinstance(item, PendingSample):
                with self._cond:
                    self._in_round.pop(op.request_id, None)
                self._sampling.append((op, item))
            else:
                self._finish(op, item)

    def _step_sampler(self, executor: Executor) -> None:
        """Advances the running sample batch for up to `sample_slice_s` while other work waits
        (as long as it likes when nothing else does), finishing requests as they complete.
        New sample requests end the slice at once, so that they join the batch quickly."""
        deadline = time.monotonic() + self.sample_slice_s
        while self._sampling:
            try:
                progressed = executor.step_sampler()
            except Exception:
                log.exception(
                    "engine failure in a sampling step (%d request(s) running)", len(self._sampling)
                )
                progressed = True  # the engine failed the running requests' futures
            still: list[tuple[Op, PendingSample]] = []
            for op, pending in self._sampling:
                if pending.future.done():
                    self._finish(op, pending.finish())
                else:
                    still.append((op, pending))
            self._sampling = still
            if not progressed and still:
                for op, _ in still:
                    self._finish(
                        op,
                        Result.error(
                            ServerFault("the sampler dropped this request without a result")
                        ),
                    )
                self._sampling = []
            with self._cond:
                new_samples = any(op.kind == SAMPLE_KIND for op in self._unordered)
                other = self._other_work_ready()
            if new_samples or self._stopping or (other and time.monotonic() >= deadline):
                return

    def _take_control(self) -> list[Op]:
        with self._cond:
            ops = [op for op in self._unordered if op.kind != SAMPLE_KIND]
            self._unordered = [op for op in self._unordered if op.kind == SAMPLE_KIND]
            self._in_round.update((op.request_id, op) for op in ops)
        ops += self._take_heads(
            lambda kind: kind not in TRAIN_KINDS and kind != OPTIM_KIND, consecutive=False
        )
        return ops

    def _take_heads(self, wanted: Callable[[str], bool], *, consecutive: bool) -> list[Op]:
        """Pops each model's head op if `wanted` (and the wanted ops right after it, if
        `consecutive`), advancing the model's next seq past them."""
        taken: list[Op] = []
        with self._cond:
            for model_id, queue in self._queues.items():
                seq = self._next_seq.get(model_id)
                while seq is not None and seq in queue and wanted(queue[seq].kind):
                    taken.append(queue.pop(seq))
                    self._in_round[taken[-1].request_id] = taken[-1]
                    seq += 1
                    self._next_seq[model_id] = seq
                    if not consecutive:
                        break
        return taken

    def _run_group(self, name: str, ops: list[Op], run: Callable[[list[Op]], list[Result]]) -> None:
        try:
            results = run(ops)
            if len(results) != len(ops):
                raise RuntimeError(
                    f"{name}: executor returned {len(results)} results for {len(ops)} ops"
                )
        except Exception as exc:
            if disk.is_disk_full(exc):
                log.warning("%s of %d request(s): the data disk is full (%s)", name, len(ops), exc)
            else:
                log.exception("engine failure in %s batch of %d request(s)", name, len(ops))
            results = [self._failure(f"running {name}", exc)] * len(ops)
        if name != "control":
            self._count_batch(name, ops)
        for op, result in zip(ops, results, strict=True):
            if op.kind in CREATE_KINDS and not result.failed and op.model_id is not None:
                self.register_model(op.model_id)
            self._finish(op, result)

    def _count_batch(self, name: str, ops: list[Op]) -> None:
        clients = {op.scope or op.model_id or op.request_id for op in ops}
        self.stats.batches[name] += 1
        self.stats.max_batch_clients[name] = max(self.stats.max_batch_clients[name], len(clients))
        if len(clients) > 1:
            self.stats.mixed_batches[name] += 1
        if len({op.tenant for op in ops}) > 1:
            self.stats.cross_tenant_batches[name] += 1

    def _finish(self, op: Op, result: Result) -> None:
        """Hands `result` to the op's future. Never raises: should recording it fail in a way
        the table did not handle, the client still gets an error from memory."""
        try:
            self.stats.requests[op.kind] += 1
            if result.failed:
                self.stats.failed[op.kind] += 1
            self.futures.complete(op.request_id, result)
        except Exception as exc:  # the waiting client gets an error instead
            log.exception("could not record the result of %s", op.request_id)
            self.futures.deliver(
                op.request_id, self._failure("recording the result", exc), stored=False
            )
        finally:
            with self._cond:
                self._in_round.pop(op.request_id, None)

    def _expire_gaps(self) -> None:
        """Skips a seq_id that has not arrived `gap_timeout_s` after the model's queue began
        waiting for it (caller holds the lock).

        A request can be lost for good: the SDK numbers a call before sending it, so a call
        that never reaches a route (a proxy drop, a body refused before parsing, a client that
        died mid-send) leaves a hole that every later request of the model would wait on
        forever. After the timeout the model's next seq moves to the lowest queued one, so the
        requests behind the hole run and later calls work; the missing request, if it arrives
        after all, is refused with the reason (`submit`)."""
        now = time.monotonic()
        for model_id, queue in self._queues.items():
            expected = self._next_seq.get(model_id)
            if not queue or expected is None or expected in queue:
                self._gaps.pop(model_id, None)
                continue
            missing, since = self._gaps.get(model_id, (expected, now))
            if missing != expected:
                missing, since = expected, now
            self._gaps[model_id] = (missing, since)
            if now - since < self.gap_timeout_s:
                continue
            resume = min(queue)
            skipped = self._skipped.setdefault(model_id, deque(maxlen=SKIPPED_REMEMBERED))
            skipped.extend(range(expected, min(resume, expected + SKIPPED_REMEMBERED)))
            self._next_seq[model_id] = resume
            del self._gaps[model_id]
            log.warning(
                "model %r: seq_id %s never arrived within %g s (gap timeout); skipped, running seq_id %d onwards",
                model_id,
                str(expected) if resume == expected + 1 else f"{expected}..{resume - 1}",
                self.gap_timeout_s,
                resume,
            )
