"""What each tenant and run used, counted as the engine works and kept in SQLite.

Counters, per tenant, run and UTC day:
- `prefill_tokens`: prompt tokens of sample requests that were computed (once per request: its
  rows share the prompt) and input tokens of forward-only calls;
- `cached_prefill_tokens`: prompt tokens of sample requests read from the sampler's prefix
  cache instead (the response's `prompt_cache_hit_tokens`), counted apart because they cost
  a copy, not a forward pass;
- `sampled_tokens`: tokens generated
  (a sample that fails or is cancelled is charged the prompt it prefilled and the tokens it
  drew before it ended: work done, not only work that succeeded);
- `trained_tokens`: input tokens of forward_backward calls;
- `optimizer_steps`;
- `compute_seconds`: each engine batch's wall time shared among its requests by their tokens
  (forward/backward), rows (a sampler step) or equally (optimizer steps, control operations);
- `resident_adapter_seconds`: time a run holds a trainer bank slot, measured from the moment
  it takes one to the moment it leaves it (live_models.LiveModels.resident_seconds), collected
  at every flush and at close.
Checkpoint storage is not counted here: it is what the checkpoint rows say now (a gauge), so a
deletion is reflected at once.

Counts go to memory first and to SQLite every `flush_s` in one transaction (never a write per
request); a failed flush keeps them in memory for the next one, and close flushes what is left.
Reads merge the stored rows with what is not yet flushed, so they are always current. The
run of a sample is the training run its weights came from ("" for the base model).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any, assert_never

from lorafleet.server.ops.futures import Result
from lorafleet.server.ops.types import (
    CreateFromState,
    CreateModel,
    Forward,
    ForwardBackward,
    Job,
    LoadWeights,
    Meter,
    OptimStep,
    Refused,
    Sample,
    SaveExternal,
    SaveSampler,
    SaveWeights,
    Stage,
)
from lorafleet.server.state.store import Store

log = logging.getLogger(__name__)

COUNTERS = (
    "prefill_tokens",
    "cached_prefill_tokens",
    "sampled_tokens",
    "trained_tokens",
    "optimizer_steps",
    "compute_seconds",
    "resident_adapter_seconds",
)
Key = tuple[str, str, str, str]  # tenant, run, day, counter
Resident = Callable[[], list[tuple[str, str, float]]]
"""(tenant, run, seconds) each run held a trainer slot since the previous call."""


def utc_day(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d")


def seconds_to_next_day(at: float) -> float:
    now = datetime.fromtimestamp(at, UTC)
    midnight = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return (midnight - now).total_seconds()


def sample_bound(op: Sample, context_length: int | None) -> int:
    """The most tokens a sample request can generate: what its quota check reserves."""
    per_row = op.params.max_tokens
    if per_row is None:
        per_row = max(0, (context_length or 0) - len(op.prompt))
    return op.num_samples * per_row


def sample_run(op: Sample) -> str:
    """The training run whose weights a sample used ("" for the base model)."""
    key = op.checkpoint_path or (op.adapter[0] if op.adapter is not None else "")
    if key.startswith("tinker://"):
        return key.removeprefix("tinker://").split("/", 1)[0]
    return key.split("#", 1)[0]


def _share(job: Job, tokens: int) -> float:
    """A job's share of a batch's time: its tokens (training), its rows (a sampler step, where
    each row decodes one token), else one."""
    op = job.op
    match op:
        case Forward() | ForwardBackward():
            return float(max(1, tokens or op.tokens))
        case Sample():
            return float(op.num_samples)
        case (
            CreateModel()
            | CreateFromState()
            | LoadWeights()
            | SaveWeights()
            | SaveSampler()
            | SaveExternal()
            | OptimStep()
            | Refused()
        ):
            return 1.0
        case _:
            assert_never(op)


def _run_of(job: Job) -> str:
    if job.model_id is not None:
        return job.model_id
    if isinstance(job.op, Sample):
        return sample_run(job.op)
    return ""


def _counts(job: Job, tokens: int, result: Result | None) -> dict[Meter, float]:
    """What a job's work adds to each of its op's meters: `tokens` it ran in this batch (a
    training call split over rounds runs part of its tokens in each), and, once it finished
    (`result`), what the result says it produced."""
    op = job.op
    match op:
        case Forward() | ForwardBackward():
            meter = (
                Meter.TRAINED_TOKENS if isinstance(op, ForwardBackward) else Meter.PREFILL_TOKENS
            )
            return {meter: float(tokens or op.tokens)}
        case OptimStep():
            return {} if result is None else {Meter.OPTIMIZER_STEPS: 1.0}
        case Sample():
            if result is None:
                return {}
            # what it did, whether it succeeded, failed or was cancelled (work done is charged)
            cached = min(result.cached_prompt_tokens, result.prefill_tokens)
            return {
                Meter.PREFILL_TOKENS: float(result.prefill_tokens - cached),
                Meter.CACHED_PREFILL_TOKENS: float(cached),
                Meter.SAMPLED_TOKENS: float(result.sampled_tokens),
            }
        case (
            CreateModel()
            | CreateFromState()
            | LoadWeights()
            | SaveWeights()
            | SaveSampler()
            | SaveExternal()
            | Refused()
        ):
            return {}
        case _:
            assert_never(op)


class Metering:
    def __init__(
        self,
        store: Store,
        *,
        flush_s: float = 5.0,
        resident: Resident | None = None,
        clock: Callable[[], float] = time.time,
    ):
        if not 0 < flush_s < float("inf"):
            raise ValueError(f"usage_flush_s must be a positive number of seconds, got {flush_s!r}")
        self.store = store
        self.flush_s = flush_s
        self.resident = resident
        self.clock = clock
        self.flush_failures = 0
        self._lock = threading.Lock()
        self._pending: dict[Key, float] = defaultdict(float)
        self._day = ""
        self._today: dict[tuple[str, str], float] = defaultdict(float)  # (tenant, counter)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ counting
    def record(self, tenant: str, run: str, counter: str, amount: float) -> None:
        if amount <= 0:
            return
        now = self.clock()
        day = utc_day(now)
        with self._lock:
            self._roll(day)
            self._pending[(tenant, run, day, counter)] += amount
            self._today[(tenant, counter)] += amount

    def _roll(self, day: str) -> None:
        """Today's totals, read from SQLite once a day (caller holds the lock)."""
        if day == self._day:
            return
        self._today = defaultdict(float)
        for tenant, counter, value in self.store.usage.of_day(day):
            self._today[(tenant, counter)] += value
        for (tenant, _run, pending_day, counter), value in self._pending.items():
            if pending_day == day:
                self._today[(tenant, counter)] += value
        self._day = day

    def today(self, tenant: str, counter: str) -> float:
        """The tenant's use of `counter` since 00:00 UTC (for the per-day quotas)."""
        with self._lock:
            self._roll(utc_day(self.clock()))
            return self._today.get((tenant, counter), 0.0)

    def on_work(
        self,
        stage: Stage,
        work: list[tuple[Job, int]],
        seconds: float,
        finished: list[tuple[Job, Result]],
    ) -> None:
        """The scheduler's hook after each engine batch (worker thread): `work` shared the
        batch's `seconds`, each job with the tokens it ran in it (0: not measured there);
        `finished` are the jobs it completed. A failed job counts its time, and a sample also
        the tokens it prefilled and drew before it failed or was cancelled (the sampler tells
        them with its result): work done is charged, not only work that succeeded."""
        results = {job.request_id: result for job, result in finished}
        shares = [(job, _share(job, tokens)) for job, tokens in work]
        total = sum(share for _, share in shares)
        if total > 0 and seconds > 0:
            for job, share in shares:
                self.record(job.tenant, _run_of(job), "compute_seconds", seconds * share / total)
        for job, tokens in work:
            result = results.get(job.request_id)
            if result is not None and result.failed and not isinstance(job.op, Sample):
                continue
            if stage is Stage.TRAIN or result is not None:
                for meter, amount in _counts(job, tokens, result).items():
                    self.record(job.tenant, _run_of(job), meter.value, amount)

    def _tick_residency(self) -> None:
        if self.resident is None:
            return
        for tenant, run, seconds in self.resident():
            self.record(tenant, run, "resident_adapter_seconds", seconds)

    # ------------------------------------------------------------------ persistence
    def flush(self) -> int:
        """Writes the counts gathered since the last flush; on failure they stay for the next."""
        with self._lock:
            batch, self._pending = dict(self._pending), defaultdict(float)
        if not batch:
            return 0
        try:
            self.store.usage.add([(*key, value) for key, value in batch.items()])
        except BaseException:
            with self._lock:
                for key, value in batch.items():
                    self._pending[key] += value
            raise
        return len(batch)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="lorafleet-metering", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        """Never ends but by close: a failed tick is logged and counted, and the next tries
        again with everything still in memory."""
        while not self._stop.wait(self.flush_s):
            try:
                self._tick_residency()
                self.flush()
            except Exception:
                self.flush_failures += 1
                log.exception("metering: flush failed; the counts stay in memory for the next one")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        try:
            self._tick_residency()  # the slot time since the last flush
            self.flush()
        except Exception:
            self.flush_failures += 1
            log.exception("metering: the last flush failed; counts since the previous one are lost")

    # ------------------------------------------------------------------ reading
    def rows(
        self, tenant: str | None, since_day: str | None
    ) -> list[tuple[str, str, str, str, float]]:
        """(tenant, run, day, counter, value): stored plus not yet flushed."""
        merged: dict[Key, float] = defaultdict(float)
        for t, run, day, counter, value in self.store.usage.by_day(tenant, since_day):
            merged[(t, run, day, counter)] += value
        with self._lock:
            pending = list(self._pending.items())
        for (t, run, day, counter), value in pending:
            if (tenant is None or t == tenant) and (since_day is None or day >= since_day):
                merged[(t, run, day, counter)] += value
        return sorted((*key, value) for key, value in merged.items())

    def totals(self, tenant: str | None) -> list[tuple[str, str, str, float]]:
        """(tenant, run, counter, value) over all days: stored plus not yet flushed."""
        merged: dict[tuple[str, str, str], float] = defaultdict(float)
        for t, run, counter, value in self.store.usage.totals(tenant):
            merged[(t, run, counter)] += value
        with self._lock:
            pending = list(self._pending.items())
        for (t, run, _day, counter), value in pending:
            if tenant is None or t == tenant:
                merged[(t, run, counter)] += value
        return sorted((*key, value) for key, value in merged.items())


def usage_report(
    tenant: str,
    rows: Iterable[tuple[str, str, str, str, float]],
    totals: Iterable[tuple[str, str, str, float]],
    storage: Iterable[tuple[str, str, int]],
) -> dict[str, Any]:
    """One tenant's usage as JSON: totals and per run, over all time and per day, and the
    checkpoint bytes stored now."""

    def zero() -> dict[str, float]:
        return dict.fromkeys(COUNTERS, 0.0)

    report: dict[str, Any] = {"tenant": tenant, "totals": zero(), "runs": {}, "days": {}}
    for _t, run, counter, value in totals:
        report["totals"][counter] = report["totals"].get(counter, 0.0) + value
        report["runs"].setdefault(run, zero())[counter] = value
    for _t, run, day, counter, value in rows:
        entry = report["days"].setdefault(day, {"totals": zero(), "runs": {}})
        entry["totals"][counter] = entry["totals"].get(counter, 0.0) + value
        entry["runs"].setdefault(run, zero())[counter] = value
    by_run = {run: size for _t, run, size in storage}
    report["storage"] = {"checkpoint_bytes": sum(by_run.values()), "runs": by_run}
    return report
