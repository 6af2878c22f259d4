"""What each tenant and run used, counted as the engine works and kept in SQLite.

Counters, per tenant, run and UTC day:
- `prefill_tokens`: prompt tokens of sample requests (once per request: its rows share the
  prompt) and input tokens of forward-only calls;
- `sampled_tokens`: tokens generated;
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
from typing import Any

from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from lorafleet.server.ops.futures import PROTOBUF, Result
from lorafleet.server.ops.payloads import ForwardBackwardCall, SampleArgs
from lorafleet.server.ops.scheduler import Op
from lorafleet.server.state.store import Store

log = logging.getLogger(__name__)

COUNTERS = (
    "prefill_tokens",
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


def fb_tokens(payload: Any) -> int:
    if isinstance(payload, ForwardBackwardCall):
        return sum(int(d.tokens.numel()) for d in payload.data)
    return 0


def sample_bound(args: SampleArgs, context_length: int | None) -> int:
    """The most tokens a sample request can generate: what its quota check reserves."""
    per_row = args.params.max_tokens
    if per_row is None:
        per_row = max(0, (context_length or 0) - len(args.prompt))
    return args.num_samples * per_row


def sample_run(args: SampleArgs) -> str:
    """The training run whose weights a sample used ("" for the base model)."""
    key = args.checkpoint_path or (args.adapter[0] if args.adapter is not None else "")
    if key.startswith("tinker://"):
        return key.removeprefix("tinker://").split("/", 1)[0]
    return key.split("#", 1)[0]


def sampled_tokens(result: Result) -> int:
    if result.failed or result.content_type != PROTOBUF:
        return 0
    try:
        response = pb.SampleResponse.FromString(result.body)
    except DecodeError:
        log.exception("metering: a sample result did not decode; its tokens are not counted")
        return 0
    return sum(len(seq.tokens) // 4 for seq in response.sequences)  # int32 each


def _measure(op: Op, tokens: int) -> float:
    """An op's share of a batch's time: its tokens (training), its rows (a sampler step, where
    each row decodes one token), else one."""
    if isinstance(op.payload, ForwardBackwardCall):
        return float(max(1, tokens or fb_tokens(op.payload)))
    if isinstance(op.payload, SampleArgs):
        return float(op.payload.num_samples)
    return 1.0


def _run_of(op: Op) -> str:
    if op.model_id is not None:
        return op.model_id
    if isinstance(op.payload, SampleArgs):
        return sample_run(op.payload)
    return ""


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
        kind: str,
        work: list[tuple[Op, int]],
        seconds: float,
        finished: list[tuple[Op, Result]],
    ) -> None:
        """The scheduler's hook after each engine batch (worker thread): `work` shared the
        batch's `seconds`, each op with the tokens it ran in it (0: not measured there; a
        forward_backward call split over rounds runs part of its tokens in each); `finished`
        are the ops it completed."""
        failed = {op.request_id for op, result in finished if result.failed}
        measured = [(op, _measure(op, tokens)) for op, tokens in work]
        total = sum(weight for _, weight in measured)
        if total > 0 and seconds > 0:
            for op, weight in measured:
                self.record(op.tenant, _run_of(op), "compute_seconds", seconds * weight / total)
        for op, tokens in work:
            if op.kind in ("forward", "forward_backward") and op.request_id not in failed:
                counter = "trained_tokens" if op.kind == "forward_backward" else "prefill_tokens"
                self.record(op.tenant, _run_of(op), counter, tokens or fb_tokens(op.payload))
        for op, result in finished:
            if result.failed:
                continue
            if op.kind == "optim_step":
                self.record(op.tenant, _run_of(op), "optimizer_steps", 1)
            elif op.kind == "sample" and isinstance(op.payload, SampleArgs):
                run = _run_of(op)
                self.record(op.tenant, run, "prefill_tokens", len(op.payload.prompt))
                self.record(op.tenant, run, "sampled_tokens", sampled_tokens(result))

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
