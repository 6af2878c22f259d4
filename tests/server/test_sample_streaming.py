"""The scheduler keeps one running sample batch: requests that arrive while others decode join
it (they finish first when they are shorter), and training work is not held up behind a long
generation (it runs between sampling slices)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from lorafleet.server.ops.futures import Result
from lorafleet.server.ops.scheduler import PendingSample, Scheduler
from tests.server.jobs import job, sample_op


class _StepExecutor:
    """A sampler whose requests need `payload` steps each; every step advances all of them."""

    def __init__(self):
        self.running: list[tuple[list[int], Future]] = []
        self.events: list[str] = []
        self.steps = 0
        self.lock = threading.Lock()

    def run_control(self, op):
        return Result.json({"ok": True})

    def run_train(self, ops):
        self.events.append(f"train@{self.steps}")
        return [Result.json({"ok": True}) for _ in ops]

    def run_optim(self, ops):
        return [Result.json({"ok": True}) for _ in ops]

    def run_sample(self, ops):  # pragma: no cover - the scheduler must use the running batch
        raise AssertionError("blocking sample path used")

    def start_sample(self, ops):
        pending = []
        for op in ops:
            future: Future = Future()
            self.running.append(([op.op.params.max_tokens], future))
            pending.append(
                PendingSample(
                    future,
                    lambda value, name=op.request_id: Result.json({"done": name, "at": value}),
                )
            )
        return pending

    def step_sampler(self):
        if not self.running:
            return False
        time.sleep(0.01)
        self.steps += 1
        still = []
        for left, future in self.running:
            left[0] -= 1
            if left[0] == 0:
                self.events.append(f"done@{self.steps}")
                future.set_result(self.steps)
            else:
                still.append((left, future))
        self.running = still
        return True


class _Futures:
    def __init__(self):
        self.done: dict[str, Result] = {}
        self.order: list[str] = []
        self.cond = threading.Condition()

    def complete(self, request_id, result):
        with self.cond:
            self.done[request_id] = result
            self.order.append(request_id)
            self.cond.notify_all()

    def wait(self, request_id, timeout=10.0):
        with self.cond:
            assert self.cond.wait_for(lambda: request_id in self.done, timeout), (
                f"{request_id} never finished"
            )


def test_late_samples_join_the_running_batch_and_training_runs_between_slices():
    executor, futures = _StepExecutor(), _Futures()
    scheduler = Scheduler(futures, sample_slice_s=0.05)  # type: ignore[arg-type]
    scheduler.register_model("m")
    scheduler.start(lambda: executor)
    try:
        scheduler.submit(job("long", sample_op(steps=100), "t1", scope="s1"))
        deadline = time.monotonic() + 10
        while executor.steps < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
        scheduler.submit(job("short", sample_op(steps=3), "t2", scope="s2"))
        futures.wait("short")
        assert "long" not in futures.done  # the short one joined and finished first
        scheduler.submit(job("fb", "forward_backward", "t3", model_id="m", seq_id=1))
        futures.wait("fb")
        assert "long" not in futures.done  # training did not wait for the long generation
        futures.wait("long")
        assert futures.order == ["short", "fb", "long"]
        train_step = int(next(e for e in executor.events if e.startswith("train")).split("@")[1])
        assert train_step < 100
        assert scheduler.stats.mixed_batches["sample"] >= 1
        assert not futures.done["long"].failed
    finally:
        scheduler.stop()
