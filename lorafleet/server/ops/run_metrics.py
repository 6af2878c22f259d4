"""Per-step run metrics, the console's curves: the server's own loss of every forward_backward
(source "server") and what a client posts to `POST /api/v1/lorafleet/runs/{model_id}/metrics`
(source "client": rewards of `lorafleet rl`, say).

The server's points are taken on the engine worker (the scheduler's work hook) and only held in
memory there; they reach SQLite when the console reads (or at `close`), so a training step
pays one protobuf parse and a list append, never a database write. A client's post is bounded
per call and per run before anything is written, so a runaway client cannot fill the disk."""

from __future__ import annotations

import math
import re
import threading
import time
from typing import Any

from lorafleet.server.errors import NotFound, UserError
from lorafleet.server.ops.futures import Result
from lorafleet.server.ops.types import ForwardBackward, Job, Stage
from lorafleet.server.state.keys import Tenant
from lorafleet.server.state.store import Store

SERVER_LOSS = "loss"  # the name of the server's own curve: `loss:sum` of each forward_backward
METRIC_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_:./-]{0,63}")
MAX_POINTS_PER_CALL = 256
MAX_NAMES_PER_RUN = 32
MAX_POINTS_PER_RUN = 200_000
MAX_STEP = 10**9
MAX_CURVE_POINTS = 1000
"""Points of one curve a read returns, thinned evenly over its steps (the newest always in):
the chart is about as many pixels wide, and a run of 200 000 points would otherwise cost
every open page a 2 MB snapshot a second."""
FLUSH_AT = 512  # pending server points that make the worker write them itself

Row = tuple[str, str, str, int, float, str, float]


class RunMetrics:
    def __init__(self, store: Store):
        self.store = store
        self._lock = threading.Lock()
        self._pending: list[Row] = []
        self._next_step: dict[tuple[str, str], int] = {}
        self._post_lock = threading.Lock()  # a post's bound check and its write, as one
        self.flush_failures = 0

    # ------------------------------------------------------------------ the server's loss
    def on_work(
        self,
        stage: Stage,
        work: list[tuple[Job, int]],
        seconds: float,
        finished: list[tuple[Job, Result]],
    ) -> None:
        """The scheduler's work hook (worker thread): one "loss" point per finished
        forward_backward, numbered per run from 0 in the order the calls finished."""
        if stage is not Stage.TRAIN:
            return
        now = time.time()
        rows: list[Row] = []
        for job, result in finished:
            if not isinstance(job.op, ForwardBackward) or result.failed:
                continue
            loss = _loss(result)
            if loss is None or job.model_id is None:
                continue
            rows.append(
                (
                    job.tenant,
                    job.model_id,
                    SERVER_LOSS,
                    self._step(job.tenant, job.model_id),
                    loss,
                    "server",
                    now,
                )
            )
        if not rows:
            return
        with self._lock:
            self._pending.extend(rows)
            due = len(self._pending) >= FLUSH_AT
        if due:
            self.flush()

    def _step(self, tenant: str, run: str) -> int:
        key = (tenant, run)
        step = self._next_step.get(key)
        if step is None:  # a run resumed after a restart goes on from its stored points
            step = self.store.run_metrics.max_step(tenant, run, SERVER_LOSS, "server") + 1
        self._next_step[key] = step + 1
        return step

    def flush(self) -> None:
        """Writes the pending server points; a failed write keeps them for the next flush and
        raises to the caller (the scheduler's hook logs it; a console read answers 500)."""
        with self._lock:
            rows, self._pending = self._pending, []
        if not rows:
            return
        try:
            self.store.run_metrics.add(rows)
        except BaseException:
            self.flush_failures += 1
            with self._lock:
                self._pending[:0] = rows[-MAX_POINTS_PER_RUN:]
            raise

    # ------------------------------------------------------------------ a client's points
    def post(self, tenant: Tenant, run: str, body: Any) -> dict[str, Any]:
        """`{"points": [{"name", "step", "value"}, ...]}` for one of the caller's runs."""
        row = self.store.models.get(run)
        if row is None or row.tenant != tenant.id:
            raise NotFound(f"unknown model_id {run!r}")
        points = _points(body)
        with self._post_lock:  # posts run on worker threads: two must not both pass the bounds
            return self._add_points(tenant, run, points)

    def _add_points(
        self, tenant: Tenant, run: str, points: list[tuple[str, int, float]]
    ) -> dict[str, Any]:
        names, count, _ = self.store.run_metrics.stats(tenant.id, run)
        new_names = {name for name, _, _ in points} - names
        if len(names) + len(new_names) > MAX_NAMES_PER_RUN:
            raise UserError(
                f"points: run {run!r} would have {len(names) + len(new_names)} metric names, "
                f"more than {MAX_NAMES_PER_RUN}; new names: {sorted(new_names)[:5]}"
            )
        if count + len(points) > MAX_POINTS_PER_RUN:
            raise UserError(
                f"points: run {run!r} holds {count} points; {len(points)} more would pass the "
                f"limit of {MAX_POINTS_PER_RUN} per run"
            )
        now = time.time()
        self.store.run_metrics.add(
            [(tenant.id, run, name, step, value, "client", now) for name, step, value in points]
        )
        return {"accepted": len(points)}

    # ------------------------------------------------------------------ reading
    def series(self, tenant: str, run: str, after_step: int = -1) -> list[dict[str, Any]]:
        """The run's curves, one per (name, source): `points` as [step, value] pairs, at most
        MAX_CURVE_POINTS of each."""
        self.flush()
        out: dict[tuple[str, str], dict[str, Any]] = {}
        for name, source, step, value, _at in self.store.run_metrics.curves(
            tenant, run, after_step, MAX_CURVE_POINTS
        ):
            entry = out.setdefault((name, source), {"name": name, "source": source, "points": []})
            entry["points"].append([step, value])
        return list(out.values())

    def close(self) -> None:
        self.flush()


def _loss(result: Result) -> float | None:
    """`loss:sum` of a finished forward_backward, from the metrics its result carries beside
    the body (None: the loss has none, or is not finite)."""
    value = None if result.metrics is None else result.metrics.get("loss:sum")
    return None if value is None or not math.isfinite(value) else float(value)


def _points(body: Any) -> list[tuple[str, int, float]]:
    if (
        not isinstance(body, dict)
        or set(body) != {"points"}
        or not isinstance(body["points"], list)
    ):
        raise UserError(
            'body must be {"points": [{"name": str, "step": int, "value": number}, ...]}'
        )
    raw = body["points"]
    if not 1 <= len(raw) <= MAX_POINTS_PER_CALL:
        raise UserError(f"points: 1 to {MAX_POINTS_PER_CALL} points per call, got {len(raw)}")
    points: list[tuple[str, int, float]] = []
    for i, p in enumerate(raw):
        if not isinstance(p, dict) or set(p) != {"name", "step", "value"}:
            raise UserError(f"points[{i}] must have exactly name, step and value, got {p!r:.200}")
        name, step, value = p["name"], p["step"], p["value"]
        if not isinstance(name, str) or not METRIC_NAME.fullmatch(name):
            raise UserError(f"points[{i}].name must match {METRIC_NAME.pattern}, got {name!r:.80}")
        if type(step) is not int or not 0 <= step <= MAX_STEP:
            raise UserError(
                f"points[{i}].step must be a whole number 0..{MAX_STEP}, got {step!r:.40}"
            )
        if type(value) not in (int, float) or not math.isfinite(_as_float(value)):
            raise UserError(f"points[{i}].value must be a finite number, got {value!r:.40}")
        points.append((name, step, float(value)))
    return points


def _as_float(value: int | float) -> float:
    """A JSON integer past a float's range (`1e400` written out as digits) is infinite, not a
    500: `float()` of it raises OverflowError."""
    try:
        return float(value)
    except OverflowError:
        return math.inf
