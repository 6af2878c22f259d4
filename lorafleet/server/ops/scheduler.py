"""Per-model seq ordering and cross-tenant batching, on one engine worker thread.

Each model's operations carry a `seq_id`; the SDK submits concurrent chunks of one call in any
order (the first one last, on purpose), so an operation runs only when every lower seq of its
model has run. Across models there is no order, which is what lets one round of the worker do:

1. control operations (create, save, load, failures) at the head of their model's queue;
2. ONE mixed forward/backward over the forward/forward_backward work that fair share picks
   (fair_share.py): at most `round_token_budget` tokens, tenants taking turns by weighted deficit
   round-robin, a call too large for its tenant's turn running in chunks of its datums over
   several rounds (its gradients accumulate in the slot, as Tinker's calls do until optim_step;
   its result is combined once the last chunk ran, and the model's later seq_ids wait for that);
   a tenant alone on the server gets rounds of `solo_round_token_budget` instead (`_alone`), since
   the small budget only bounds other tenants' wait and each cut cost it the shared history of
   its multi-turn datums;
3. ONE optimizer call for every model whose head is now an optim_step (the fwd/bwd just run
   usually put it there);
4. new samples join the sampler's running batch (continuous batching: requests that arrive
   while others decode share their forwards), which then advances for a time slice, or until
   other work is waiting, before the next round.

Torch work happens only on the worker thread (two cores: one busy thread is the fastest way to
run it) so the HTTP event loop stays responsive. That includes loading the model: with GNU
OpenMP, a second thread running parallel torch jobs makes the runtime see more threads than
cores and stop spinning between parallel regions, and every small job then pays a wake-up.

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

from lorafleet.sample.types import SampleResult
from lorafleet.server.errors import ServerFault, UserError, internal_error
from lorafleet.server.ops.fair_share import DeficitRoundRobin, Work
from lorafleet.server.ops.futures import FutureTable, Result
from lorafleet.server.ops.types import (
    CreateFromState,
    CreateModel,
    Forward,
    ForwardBackward,
    Job,
    Sample,
    Stage,
    TrainOp,
    train_op,
)
from lorafleet.server.state import disk
from lorafleet.server.state.disk import DiskGuard

log = logging.getLogger(__name__)

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
DEFAULT_ROUND_TOKENS = 512
"""Tokens of forward(_backward) work one round runs (ServerConfig.round_token_budget,
`--round-token-budget`). A round is what another tenant's step may wait behind, so it bounds
that wait; fewer tokens cost more rounds' fixed overhead. 512 suits the tiny CPU models; an
accelerator running a real model wants many times more."""
DEFAULT_SOLO_ROUND_TOKENS = 16384
"""Tokens of forward(_backward) work a round may run while one tenant is alone on the server
(ServerConfig.solo_round_token_budget, `--solo-round-token-budget`). The small budget exists to
bound other tenants' wait; with no one else to wait, it only cost the lone tenant: a
guess_number step (160 turn-datums, 8.1k tokens counted after sharing) ran in 17 rounds, and
each cut between an episode's turns recomputed the history the trainer shares among them (23.5k
tokens forwarded against 10.4k in one round; docs/performance.md, "What the server costs over
the engine")."""
SOLO_AFTER_S = 10.0
"""A tenant counts as alone once no other tenant has had an operation queued, running or
finished for this long: tenants stepping in a loop (sample, train, step) stay present between
their requests, so a lone round never lands between two steps of a neighbour."""
STEPPING_S = 1.0
"""A tenant counts as stepping for this long after one of its training ops finished, until it
submits anything else (a sample, a save): its next call is on its way (a training loop sends
forward_backward, optim_step, forward_backward, ... each as the previous one's result arrives). While another tenant is stepping, a round that
would hold one tenant's training work alone runs one fair-share quantum of it, not the whole
budget: the stepping tenant's next call then waits behind a short round instead of a full one
(bench/tenancy.py's flood phase; docs/tenancy.md)."""
STATS_WINDOW_S = 10.0  # rounds per second and tokens per round are over this much recent time


@dataclass(frozen=True)
class PendingSample:
    """A sample request running in the sampler's batch; `finish` turns its outcome into a Result."""

    future: Future[SampleResult]
    convert: Callable[[SampleResult], Result]

    def finish(self) -> Result:
        exc = self.future.exception()
        if exc is not None:
            log.error("a sample request failed in the sampler", exc_info=exc)
            return Result.error(ServerFault(internal_error("sampling", exc)))
        return self.convert(self.future.result())


@dataclass(frozen=True)
class TrainChunk:
    """Datums [start, stop) of a forward(_backward) job with `total` datums. `earlier` holds
    what the executor returned (`Partial.value`) for the job's chunks before this one; the last
    chunk's Result combines them with its own."""

    job: Job
    start: int
    stop: int
    total: int
    tokens: int = 0  # of datums [start, stop)
    earlier: tuple[object, ...] = ()

    @property
    def last(self) -> bool:
        return self.stop >= self.total

    @property
    def call(self) -> TrainOp:
        return train_op(self.job)


@dataclass(frozen=True)
class Partial:
    """A chunk that ran, not the job's last one: its output, kept until the last chunk."""

    value: object


@dataclass
class _TrainProgress:
    sizes: tuple[int, ...]  # tokens of each datum (metered)
    costs: tuple[int, ...]  # what fair share counts per datum
    queued_round: int  # rounds begun when it was submitted
    done: int = 0  # datums already taken
    outputs: list[object] = field(default_factory=list)  # Partial values of the chunks run


class Executor(Protocol):
    """What the scheduler drives; each method returns one Result per job (or chunk), in order."""

    def run_control(self, job: Job) -> Result: ...

    def run_train(self, chunks: list[TrainChunk]) -> list[Result | Partial]: ...

    def run_optim(self, jobs: list[Job]) -> list[Result]: ...

    def start_sample(self, jobs: list[Job]) -> list[Result | PendingSample]: ...

    def step_sampler(self) -> bool: ...


E = TypeVar("E", bound=Executor)
WorkHook = Callable[[Stage, list[tuple[Job, int]], float, list[tuple[Job, Result]]], None]
"""(batch stage, each job in the batch with the tokens it ran there (0: not a token measure), the
batch's wall seconds, the jobs it finished with their results): called on the worker after each
engine batch, before the results are handed out."""


@dataclass
class Stats:
    rounds: int = 0
    batches: Counter[str] = field(default_factory=Counter)  # kind -> engine calls
    mixed_batches: Counter[str] = field(default_factory=Counter)  # ... with > 1 client in them
    cross_tenant_batches: Counter[str] = field(default_factory=Counter)  # ... with > 1 tenant
    requests: Counter[str] = field(default_factory=Counter)  # kind -> jobs completed
    failed: Counter[str] = field(default_factory=Counter)
    round_errors: int = 0  # exceptions that escaped a round (its jobs failed, the worker went on)
    max_batch_clients: Counter[str] = field(default_factory=Counter)
    train_tokens: int = 0  # datum tokens run in forward(_backward) batches
    split_ops: int = 0  # forward(_backward) calls run in more than one chunk
    solo_rounds: int = 0  # rounds that ran training work under the solo budget
    short_rounds: int = 0  # one tenant's training work held to a quantum: another was stepping
    chunks: int = 0  # their chunks
    # tenant -> the most rounds one of its forward(_backward) calls waited, submission to result
    train_wait_rounds: dict[str, int] = field(default_factory=dict)

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
            "train_tokens": self.train_tokens,
            "split_ops": self.split_ops,
            "solo_rounds": self.solo_rounds,
            "short_rounds": self.short_rounds,
            "chunks": self.chunks,
            "train_wait_rounds": dict(self.train_wait_rounds),
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
        round_token_budget: int = DEFAULT_ROUND_TOKENS,
        solo_round_token_budget: int | None = None,
        solo_after_s: float = SOLO_AFTER_S,
        stepping_s: float = STEPPING_S,
        quantum: int | None = None,
        weight_of: Callable[[str], float] = lambda tenant: 1.0,
        max_round_models: int | None = None,
        on_work: WorkHook | None = None,
    ):
        """`stall_s`: how long one round may run, or queued work wait for one, before
        `liveness()` calls the engine stalled. Fair share (fair_share.py): a round runs at most
        `round_token_budget` tokens of forward(_backward) work, a tenant's turn adds `quantum`
        (default a quarter of the budget) times its `weight_of` relative to the heaviest waiting
        tenant, and a round touches at most `max_round_models` models. A training call counts
        what its op measured when it was parsed (`TrainCall.datum_costs`: a datum's tokens past
        what the call's earlier datums share with it, so that the turns of an episode run in
        one round and share their prefixes; fair_share.datum_costs).

        `solo_round_token_budget` (None or 0: off): the budget of a round whose training work
        is one tenant's while no other tenant has had an operation queued, running or finished
        for `solo_after_s` seconds (`_alone`); never below `round_token_budget`. A round whose
        training work is one tenant's while another finished training work within `stepping_s`
        seconds runs one quantum of it (`STEPPING_S`)."""
        if not isinstance(round_token_budget, int) or round_token_budget < 1:
            raise ValueError(
                f"round_token_budget must be a positive number of tokens, got {round_token_budget!r}"
            )
        if solo_round_token_budget is not None and (
            not isinstance(solo_round_token_budget, int) or solo_round_token_budget < 0
        ):
            raise ValueError(
                "solo_round_token_budget must be a number of tokens >= 0 (0: off), got "
                f"{solo_round_token_budget!r}"
            )
        if not solo_after_s >= 0:
            raise ValueError(f"solo_after_s must be >= 0 seconds, got {solo_after_s!r}")
        self.solo_round_token_budget = max(solo_round_token_budget or 0, round_token_budget)
        self.solo_after_s = solo_after_s
        if not stepping_s >= 0:
            raise ValueError(f"stepping_s must be >= 0 seconds, got {stepping_s!r}")
        self.stepping_s = stepping_s
        self._seen: dict[str, float] = {}  # tenant -> when it last submitted or finished an op
        self._stepped: dict[str, float] = {}  # tenant -> when a training op of its last finished
        if max_round_models is not None and max_round_models < 1:
            raise ValueError(f"max_round_models must be >= 1, got {max_round_models!r}")
        self.round_token_budget = round_token_budget
        self.max_round_models = max_round_models
        self.weight_of = weight_of
        self.fair = DeficitRoundRobin(
            max(1, round_token_budget // 4) if quantum is None else quantum, weight_of
        )
        # request id -> the progress of its queued training job
        self._train: dict[str, _TrainProgress] = {}
        self._recent: deque[tuple[float, int]] = deque()  # (round end, its training tokens)
        self.futures = futures
        self.on_work = on_work  # metering.Metering.on_work: told of every engine batch
        self.disk_guard = disk_guard
        self.stall_s = stall_s
        self._round_began: float | None = None  # monotonic; None between rounds
        self._last_round = time.monotonic()
        self._in_round: dict[str, Job] = {}  # taken from the queues, not yet finished
        self._died = False
        self.batch_window_s = batch_window_s
        self.gap_timeout_s = gap_timeout_s
        self.sample_slice_s = sample_slice_s  # sampling time per round while other work waits
        self.stats = Stats()
        self._cond = threading.Condition()
        self._next_seq: dict[str, int] = {}
        self._gone: dict[str, str] = {}  # unloaded model -> why (its late requests fail at once)
        self._queues: dict[str, dict[int, Job]] = {}
        self._gaps: dict[str, tuple[int, float]] = {}  # model -> (missing seq, first seen)
        self._skipped: dict[str, deque[int]] = {}  # model -> seq_ids given up on (newest last)
        self._unordered: list[Job] = []
        self._calls: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._sampling: list[tuple[Job, PendingSample]] = []  # worker thread only
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
        for job in queued:
            self._finish(job, Result.error(UserError(reason)))

    def submit(self, job: Job) -> None:
        error: UserError | ServerFault | None = None
        progress: _TrainProgress | None = None
        if isinstance(job.op, Forward | ForwardBackward):
            # A call without datums still takes a turn (one token), to fail in its order.
            sizes = tuple(max(1, n) for n in job.op.datum_tokens) or (1,)
            costs = tuple(max(1, n) for n in job.op.datum_costs) or (1,)
            progress = _TrainProgress(sizes, costs, self.stats.rounds)
        with self._cond:
            self._seen[job.tenant] = time.monotonic()
            if job.op.stage not in (Stage.TRAIN, Stage.OPTIM):
                # on to sampling or saving (an RL loop after its optim_step): its next training
                # call is seconds away, so it stops counting as stepping
                self._stepped.pop(job.tenant, None)
            if self._died:
                error = ServerFault(ENGINE_DEAD)
            elif job.seq_id is None:
                if job.op.stage in (Stage.TRAIN, Stage.OPTIM):
                    error = ServerFault(
                        internal_error(f"queueing {job.kind}", ValueError("not in a model's order"))
                    )
                else:
                    self._unordered.append(job)
            else:
                assert job.model_id is not None
                expected = self._next_seq.get(job.model_id)
                if job.model_id in self._gone:
                    error = UserError(self._gone[job.model_id])
                elif expected is not None and job.seq_id in self._skipped.get(job.model_id, ()):
                    error = UserError(
                        f"seq_id {job.seq_id} of model {job.model_id!r} arrived after the server gave up waiting "
                        f"for it ({self.gap_timeout_s:g} s, the gap timeout) and ran the model's later requests "
                        "without it; submit the operation again"
                    )
                elif expected is not None and job.seq_id < expected:
                    error = UserError(
                        f"seq_id {job.seq_id} of model {job.model_id!r} was already executed (next is {expected})"
                    )
                elif expected is not None and job.seq_id > expected + MAX_SEQ_AHEAD:
                    error = UserError(
                        f"seq_id {job.seq_id} of model {job.model_id!r} is more than {MAX_SEQ_AHEAD} ahead of the next one "
                        f"to run ({expected}); seq_ids must be consecutive"
                    )
                else:
                    self._queues.setdefault(job.model_id, {})[job.seq_id] = job
                    if progress is not None:
                        self._train[job.request_id] = progress
            self._cond.notify_all()
        if error is not None:
            self._finish(job, Result.error(error))

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

    def model_ops(self, tenant: str) -> dict[str, dict[str, int]]:
        """Per run of `tenant`: its queued jobs and those in the running round (the console's
        run list). One short hold of the lock, no engine work."""
        out: dict[str, dict[str, int]] = {}
        with self._cond:
            queued = [job for q in self._queues.values() for job in q.values()] + self._unordered
            running = list(self._in_round.values())
        for jobs, key in ((queued, "queued"), (running, "in_flight")):
            for job in jobs:
                if job.tenant == tenant and job.model_id is not None:
                    entry = out.setdefault(job.model_id, {"queued": 0, "in_flight": 0})
                    entry[key] += 1
        return out

    def has_work(self, model_id: str) -> bool:
        """Whether `model_id` has an job queued (in order or behind a gap) or taken into the
        running round: the paging policy (live_models.py) evicts such a run last."""
        with self._cond:
            if self._queues.get(model_id):
                return True
            return any(job.model_id == model_id for job in self._in_round.values()) or any(
                job.model_id == model_id for job in self._unordered
            )

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
            ready = [job.submitted for job in self._unordered] + [
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
            jobs = [job for q in self._queues.values() for job in q.values()] + self._unordered
            jobs += list(self._in_round.values()) + [job for job, _ in self._sampling]
            jobs = list({job.request_id: job for job in jobs}.values())  # a split job is in both
            self._queues = {m: {} for m in self._queues}
            self._unordered, self._sampling, self._in_round = [], [], {}
            calls, self._calls = self._calls, []
        fault = ServerFault(ENGINE_DEAD)
        for job in jobs:
            self._finish(job, Result.error(fault))
        for _fn, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(fault)

    def _round(self, executor: Executor) -> None:
        """One round, guarded: whatever escapes it is logged and fails the operations the round
        had taken (the sampler's running batch included), and the worker goes on."""
        self._round_began = time.monotonic()
        try:
            self._run_round(executor)
        except Exception as exc:  # the worker must survive; the jobs get the error
            log.exception("an error escaped an engine round; failing its operations")
            self.stats.round_errors += 1
            with self._cond:
                jobs = list(self._in_round.values()) + [job for job, _ in self._sampling]
                self._in_round, self._sampling = {}, []
                for job in jobs:
                    self._dequeue(job)  # a split call's chunk: the call fails as a whole
            error = self._failure("running the request", exc)
            for job in jobs:
                if isinstance(job.op, Sample) and job.op.cancel is not None:
                    job.op.cancel.set()  # its rows, if still in the sampler, leave at its next step
                self._finish(job, error)
        finally:
            self._round_began = None
            self._last_round = time.monotonic()

    def _failure(self, doing: str, exc: BaseException) -> Result:
        """The error an job gets for `exc`: DiskFull for any out-of-space error, else a server
        error naming only the exception's type (neither names a server path)."""
        if disk.is_disk_full(exc):
            if self.disk_guard is not None:
                self.disk_guard.release()
            return Result.error(disk.disk_full_error())
        return Result.error(ServerFault(internal_error(doing, exc)))

    def _run_control(self, executor: Executor, job: Job) -> Result:
        """A control job; a checkpoint write is refused at once while the data disk is full."""
        if self.disk_guard is not None and job.op.writes_disk:
            self.disk_guard.check_room()
        return executor.run_control(job)

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

        for job in self._take_control():
            self._run_group(
                Stage.CONTROL, [job], lambda jobs: [self._run_control(executor, jobs[0])]
            )
        train = self._take_train()
        if train:
            self._run_train(executor, train)
        self._note_round(sum(c.tokens for c in train))
        optim = self._take_heads(
            lambda stage: stage is Stage.OPTIM, consecutive=False, models=self.max_round_models
        )
        if optim:
            self._run_group(Stage.OPTIM, optim, executor.run_optim)
        with self._cond:
            samples = [job for job in self._unordered if job.op.stage is Stage.SAMPLE]
            self._unordered = [job for job in self._unordered if job.op.stage is not Stage.SAMPLE]
            self._in_round.update((job.request_id, job) for job in samples)
        if samples:
            self._start_samples(executor, samples)
        if self._sampling:
            self._step_sampler(executor)

    def _start_samples(self, executor: Executor, jobs: list[Job]) -> None:
        try:
            started = executor.start_sample(jobs)
            if len(started) != len(jobs):
                raise RuntimeError(
                    f"sample: executor returned {len(started)} results for {len(jobs)} jobs"
                )
        except Exception as exc:
            log.exception("engine failure while queueing %d sample request(s)", len(jobs))
            error = Result.error(ServerFault(internal_error("queueing samples", exc)))
            started = [error] * len(jobs)
        self._count_batch(Stage.SAMPLE, [job for job, _ in self._sampling] + jobs)
        for job, item in zip(jobs, started, strict=True):
            if isinstance(item, PendingSample):
                with self._cond:
                    self._in_round.pop(job.request_id, None)
                self._sampling.append((job, item))
            else:
                self._finish(job, item)

    def _step_sampler(self, executor: Executor) -> None:
        """Advances the running sample batch for up to `sample_slice_s` while other work waits
        (as long as it likes when nothing else does), finishing requests as they complete.
        New sample requests end the slice at once, so that they join the batch quickly."""
        deadline = time.monotonic() + self.sample_slice_s
        while self._sampling:
            began = time.monotonic()
            running = [(job, 0) for job, _ in self._sampling]
            try:
                progressed = executor.step_sampler()
            except Exception:
                log.exception(
                    "engine failure in a sampling step (%d request(s) running)", len(self._sampling)
                )
                progressed = True  # the engine failed the running requests' futures
            still: list[tuple[Job, PendingSample]] = []
            done: list[tuple[Job, Result]] = []
            for job, pending in self._sampling:
                if pending.future.done():
                    done.append((job, pending.finish()))
                else:
                    still.append((job, pending))
            self._report_work(Stage.SAMPLE, running, time.monotonic() - began, done)
            for job, result in done:
                self._finish(job, result)
            self._sampling = still
            if not progressed and still:
                for job, _ in still:
                    self._finish(
                        job,
                        Result.error(
                            ServerFault("the sampler dropped this request without a result")
                        ),
                    )
                self._sampling = []
            with self._cond:
                new_samples = any(job.op.stage is Stage.SAMPLE for job in self._unordered)
                other = self._other_work_ready()
            if new_samples or self._stopping or (other and time.monotonic() >= deadline):
                return

    def _take_control(self) -> list[Job]:
        with self._cond:
            jobs = [job for job in self._unordered if job.op.stage is not Stage.SAMPLE]
            self._unordered = [job for job in self._unordered if job.op.stage is Stage.SAMPLE]
            self._in_round.update((job.request_id, job) for job in jobs)
        jobs += self._take_heads(lambda stage: stage is Stage.CONTROL, consecutive=False)
        return jobs

    def _take_heads(
        self, wanted: Callable[[Stage], bool], *, consecutive: bool, models: int | None = None
    ) -> list[Job]:
        """Pops each model's head job if `wanted` (and the wanted jobs right after it, if
        `consecutive`), advancing the model's next seq past them; from at most `models` models."""
        taken: list[Job] = []
        with self._cond:
            for model_id, queue in self._queues.items():
                if models is not None and len({job.model_id for job in taken}) >= models:
                    break
                seq = self._next_seq.get(model_id)
                while seq is not None and seq in queue and wanted(queue[seq].op.stage):
                    taken.append(queue.pop(seq))
                    self._in_round[taken[-1].request_id] = taken[-1]
                    seq += 1
                    self._next_seq[model_id] = seq
                    if not consecutive:
                        break
        return taken

    def _take_train(self) -> list[TrainChunk]:
        """The forward(_backward) work fair share picks for this round: each model's ready
        training jobs (its head and the training jobs right after it), oldest head first within a
        tenant. An job whose last datum is taken leaves its queue and advances the model's next
        seq; one taken in part stays at the head, so nothing after it runs before it is done."""
        with self._cond:
            runs: list[tuple[float, str, list[Job]]] = []
            for model_id, queue in self._queues.items():
                seq = self._next_seq.get(model_id)
                run: list[Job] = []
                while seq is not None and seq in queue and queue[seq].op.stage is Stage.TRAIN:
                    run.append(queue[seq])
                    seq += 1
                if run:
                    runs.append((run[0].submitted, model_id, run))
            runs.sort(key=lambda r: (r[0], r[1]))
            ready: dict[str, list[Work]] = {}
            jobs: dict[str, Job] = {}
            for _, model_id, run in runs:
                for job in run:
                    progress = self._train[job.request_id]
                    ready.setdefault(job.tenant, []).append(
                        Work(
                            job.request_id,
                            model_id,
                            progress.done,
                            progress.costs or progress.sizes,
                        )
                    )
                    jobs[job.request_id] = job
            budget = self.round_token_budget
            if len(ready) == 1:
                [tenant] = ready
                if budget < self.solo_round_token_budget and self._alone(tenant):
                    budget = self.solo_round_token_budget
                    self.stats.solo_rounds += 1
                elif self._another_stepping(tenant):
                    short = min(budget, self.fair.quantum)
                    # counted only where the cut holds work back: a lone call that fits in a
                    # quantum anyway would make the count track how often anyone steps
                    if sum(sum(w.sizes[w.start :]) for w in ready[tenant]) > short:
                        self.stats.short_rounds += 1
                    budget = short
            chunks: list[TrainChunk] = []
            for take in self.fair.plan(ready, budget, self.max_round_models):
                job = jobs[take.key]
                progress = self._train[take.key]
                chunks.append(
                    TrainChunk(
                        job,
                        take.start,
                        take.stop,
                        len(progress.sizes),
                        sum(progress.sizes[take.start : take.stop]),  # metered: every token
                        tuple(progress.outputs),
                    )
                )
                progress.done = take.stop
                self._in_round[job.request_id] = job
                if take.stop >= len(progress.sizes):
                    self._dequeue(job)
        return chunks

    def _another_stepping(self, tenant: str) -> bool:
        """Whether a tenant other than `tenant` finished training work within `stepping_s`
        (caller holds the lock). Forgets tenants not stepping any more."""
        now = time.monotonic()
        for other, when in list(self._stepped.items()):
            if now - when >= self.stepping_s:
                del self._stepped[other]
        return any(other != tenant for other in self._stepped)

    def _alone(self, tenant: str) -> bool:
        """Whether `tenant` is the only tenant present (caller holds the lock, on the worker):
        no other tenant has an operation queued, in the sampler's batch, or submitted or
        finished within `solo_after_s`. Forgets tenants not seen for that long."""
        now = time.monotonic()
        for other, seen in list(self._seen.items()):
            if now - seen >= self.solo_after_s:
                del self._seen[other]
        if any(other != tenant for other in self._seen):
            return False
        queued = [job for q in self._queues.values() for job in q.values()] + self._unordered
        running = [job for job, _ in self._sampling] + list(self._in_round.values())
        return all(job.tenant == tenant for job in queued + running)

    def _dequeue(self, job: Job) -> None:
        """Takes `job` out of its model's queue, if there, past it the model's next seq (caller
        holds the lock)."""
        if job.model_id is None or job.seq_id is None:
            return
        queue = self._queues.get(job.model_id)
        if queue is None or queue.get(job.seq_id) is not job:
            return
        del queue[job.seq_id]
        if self._next_seq.get(job.model_id) == job.seq_id:
            self._next_seq[job.model_id] = job.seq_id + 1

    def _run_train(self, executor: Executor, chunks: list[TrainChunk]) -> None:
        """Runs one round's chunks; a chunk that is not its job's last keeps its output for the
        job's later chunks, and any chunk that fails fails its whole job (the rest never runs)."""
        items: list[Result | Partial]
        began = time.monotonic()
        try:
            items = executor.run_train(chunks)
            if len(items) != len(chunks):
                raise RuntimeError(
                    f"forward_backward: executor returned {len(items)} results for {len(chunks)} chunks"
                )
        except Exception as exc:  # noqa: BLE001 - logged by _batch_failure, each job gets it
            items = [self._batch_failure(Stage.TRAIN, len(chunks), exc)] * len(chunks)
        self._count_batch(Stage.TRAIN, [c.job for c in chunks])
        self._report_work(
            Stage.TRAIN,
            [(c.job, c.tokens) for c in chunks],
            time.monotonic() - began,
            [
                (c.job, item)
                for c, item in zip(chunks, items, strict=True)
                if isinstance(item, Result) and (item.failed or c.last)
            ],
        )
        self.stats.train_tokens += sum(c.tokens for c in chunks)
        for chunk, item in zip(chunks, items, strict=True):
            job = chunk.job
            if chunk.start > 0 or not chunk.last:
                self.stats.chunks += 1
                self.stats.split_ops += chunk.start == 0
            if isinstance(item, Partial) and not chunk.last:
                with self._cond:
                    progress = self._train.get(job.request_id)
                    if progress is not None:
                        progress.outputs.append(item.value)
                    self._in_round.pop(job.request_id, None)
                continue
            if not isinstance(item, Result) or not (item.failed or chunk.last):
                log.error(
                    "the executor returned %s for chunk %d:%d of %s's %d datums",
                    type(item).__name__,
                    chunk.start,
                    chunk.stop,
                    job.request_id,
                    chunk.total,
                )
                item = Result.error(ServerFault(internal_error("combining chunks", TypeError())))
            if not chunk.last:
                with self._cond:
                    self._dequeue(job)
            self._finish(job, item)

    def _note_round(self, tokens: int) -> None:
        now = time.monotonic()
        with self._cond:
            self._recent.append((now, tokens))
            while self._recent and self._recent[0][0] < now - STATS_WINDOW_S:
                self._recent.popleft()

    def state(self) -> dict[str, Any]:
        """What the operator sees of fair share: per tenant its queued operations, the tokens
        of its queued training work, its weight and deficit, and its rows in the sampler's
        batch; rounds per second and training tokens per round over the last
        STATS_WINDOW_S seconds."""
        now = time.monotonic()
        with self._cond:
            queued = [job for q in self._queues.values() for job in q.values()] + self._unordered
            tenants: dict[str, dict[str, Any]] = {}
            for job in queued:
                entry = tenants.setdefault(job.tenant, {"queued_ops": 0, "queued_train_tokens": 0})
                entry["queued_ops"] += 1
                progress = self._train.get(job.request_id)
                if progress is not None:
                    entry["queued_train_tokens"] += sum(progress.sizes[progress.done :])
            deficits = dict(self.fair.deficits)
            order = self.fair.order()
            recent = [(t, n) for t, n in self._recent if t >= now - STATS_WINDOW_S]
        for job, _ in list(self._sampling):
            entry = tenants.setdefault(job.tenant, {"queued_ops": 0, "queued_train_tokens": 0})
            entry["sampling"] = entry.get("sampling", 0) + 1
        for tenant, entry in tenants.items():
            entry["weight"] = self.weight_of(tenant)
            entry["deficit"] = deficits.get(tenant, 0.0)
        trained = [n for _, n in recent if n > 0]
        return {
            "round_token_budget": self.round_token_budget,
            "solo_round_token_budget": self.solo_round_token_budget,
            "quantum": self.fair.quantum,
            "max_round_models": self.max_round_models,
            "turn_order": order,
            "tenants": tenants,
            "rounds_per_s": len(recent) / STATS_WINDOW_S,
            "train_tokens_per_round": {
                "mean": sum(trained) / len(trained) if trained else 0.0,
                "max": max(trained, default=0),
            },
        }

    def _report_work(
        self,
        stage: Stage,
        work: list[tuple[Job, int]],
        seconds: float,
        finished: list[tuple[Job, Result]],
    ) -> None:
        """Metering; a failure there is logged and never fails the jobs."""
        if self.on_work is None:
            return
        try:
            self.on_work(stage, work, seconds, finished)
        except Exception:
            log.exception(
                "the work hook failed for a %s batch of %d job(s)", stage.value, len(work)
            )

    def _batch_failure(self, stage: Stage, count: int, exc: Exception) -> Result:
        """Logs a failed engine batch (called in its `except`) and returns the error each of its
        jobs gets. A full disk is logged as a warning: it is the host's state, not a bug."""
        if disk.is_disk_full(exc):
            log.warning("%s of %d request(s): the data disk is full (%s)", stage.value, count, exc)
        else:
            log.exception("engine failure in %s batch of %d request(s)", stage.value, count)
        return self._failure(f"running {stage.value}", exc)

    def _run_group(
        self, stage: Stage, jobs: list[Job], run: Callable[[list[Job]], list[Result]]
    ) -> None:
        began = time.monotonic()
        try:
            results = run(jobs)
            if len(results) != len(jobs):
                raise RuntimeError(
                    f"{stage.value}: executor returned {len(results)} results for {len(jobs)} jobs"
                )
        except Exception as exc:  # noqa: BLE001 - logged by _batch_failure, each job gets it
            results = [self._batch_failure(stage, len(jobs), exc)] * len(jobs)
        if stage is not Stage.CONTROL:
            self._count_batch(stage, jobs)
        finished = list(zip(jobs, results, strict=True))
        self._report_work(stage, [(job, 0) for job in jobs], time.monotonic() - began, finished)
        for job, result in finished:
            if (
                isinstance(job.op, CreateModel | CreateFromState)
                and not result.failed
                and job.model_id is not None
            ):
                self.register_model(job.model_id)
            self._finish(job, result)

    def _count_batch(self, stage: Stage, jobs: list[Job]) -> None:
        name = stage.value
        clients = {job.scope or job.model_id or job.request_id for job in jobs}
        self.stats.batches[name] += 1
        self.stats.max_batch_clients[name] = max(self.stats.max_batch_clients[name], len(clients))
        if len(clients) > 1:
            self.stats.mixed_batches[name] += 1
        if len({job.tenant for job in jobs}) > 1:
            self.stats.cross_tenant_batches[name] += 1

    def _finish(self, job: Job, result: Result) -> None:
        """Hands `result` to the job's future. Never raises: should recording it fail in a way
        the table did not handle, the client still gets an error from memory."""
        with self._cond:
            self._seen[job.tenant] = time.monotonic()
            if job.op.stage in (Stage.TRAIN, Stage.OPTIM):
                self._stepped[job.tenant] = self._seen[job.tenant]
            progress = self._train.pop(job.request_id, None)
            if progress is not None:
                waits = self.stats.train_wait_rounds
                waited = self.stats.rounds - progress.queued_round
                waits[job.tenant] = max(waits.get(job.tenant, 0), waited)
        try:
            self.stats.requests[job.kind] += 1
            if result.failed:
                self.stats.failed[job.kind] += 1
            self.futures.complete(job.request_id, result)
        except Exception as exc:  # the waiting client gets an error instead
            log.exception("could not record the result of %s", job.request_id)
            self.futures.deliver(
                job.request_id, self._failure("recording the result", exc), stored=False
            )
        finally:
            with self._cond:
                self._in_round.pop(job.request_id, None)

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
