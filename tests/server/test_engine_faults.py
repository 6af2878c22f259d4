"""The engine thread survives what used to kill it (issue 20): a result it cannot record (a full
disk under SQLite), an exception escaping a round, an out-of-space checkpoint write; a dead
engine is reported, not hidden; finished results are bounded by bytes in memory and in SQLite.

The scheduler tests drive a real `FutureTable` over a real `Store` with a stand-in executor (the
engine is not what fails here); the client-visible ones go through the `tinker` SDK against the
shared server, with the disk-full test hook of lorafleet/server/state/disk.py."""

from __future__ import annotations

import asyncio
import errno
import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker

from lorafleet.server.errors import NotFound
from lorafleet.server.ops import health
from lorafleet.server.ops.futures import PROBLEM_LOST, FutureTable, Result
from lorafleet.server.ops.scheduler import ENGINE_DEAD, PendingSample, Scheduler, TrainChunk
from lorafleet.server.ops.types import Job
from lorafleet.server.state import disk
from lorafleet.server.state.disk import DiskGuard
from lorafleet.server.state.store import Store
from lorafleet.server.state.store.futures import FuturesTable
from tests.server.conftest import KEY_B, connect, sl_datum
from tests.server.jobs import job

TENANT = "t"


class _DiskFullFutures(FuturesTable):
    """A real futures table whose result writes fail as SQLite fails on a full disk, while
    `full`."""

    full = True

    def finish(self, request_id: str, state: str, content_type: str, body: bytes) -> None:
        if self.full:
            raise sqlite3.OperationalError("database or disk is full")
        super().finish(request_id, state, content_type, body)


class _DiskFullStore(Store):
    """A real store whose result writes fail while `futures.full`."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.futures: _DiskFullFutures = _DiskFullFutures(self.database)


class _Engine:
    """Stands in for the executor: control ops answer, or fail the way `failures` says."""

    def __init__(self, failures: dict[str, BaseException | str] | None = None):
        self.failures = failures or {}

    def run_control(self, op: Job) -> Any:
        failure = self.failures.get(op.request_id)
        if isinstance(failure, BaseException):
            raise failure
        if failure == "not-a-result":
            return None  # an executor bug: the scheduler itself then trips over it
        return Result.json({"path": f"tinker://{op.model_id}/weights/{op.request_id}"})

    def run_train(self, chunks: list[TrainChunk]) -> list[Result]:
        return [Result.json({"ok": c.job.request_id}) for c in chunks]

    def run_optim(self, ops: list[Job]) -> list[Result]:
        return [Result.json({"ok": op.request_id}) for op in ops]

    def start_sample(self, ops: list[Job]) -> list[Result | PendingSample]:
        return [Result.json({"ok": op.request_id}) for op in ops]

    def step_sampler(self) -> bool:
        return False


def _table(store: Store, **bounds: int) -> FutureTable:
    return FutureTable(store, **bounds)


def _submit(
    futures: FutureTable, scheduler: Scheduler, request_id: str, kind: str, seq: int
) -> None:
    futures.create(request_id, TENANT, kind=kind, scope="m", seq_id=seq)
    scheduler.submit(job(request_id, kind, TENANT, model_id="m", seq_id=seq))


def _result(futures: FutureTable, request_id: str, timeout: float = 10.0) -> Result:
    result = asyncio.run(futures.wait(request_id, TENANT, timeout))
    assert result is not None, f"{request_id} still pending after {timeout} s"
    return result


def _error(result: Result) -> str:
    assert result.failed
    body = json.loads(result.body)
    assert set(body) == {"error", "category"}
    return str(body["error"])


def _running(futures: FutureTable, engine: _Engine, **kwargs: Any) -> Scheduler:
    scheduler = Scheduler(futures, **kwargs)
    scheduler.register_model("m")
    scheduler.start(lambda: engine).result(timeout=10)
    return scheduler


def test_a_result_that_cannot_be_stored_is_delivered_from_memory_and_the_worker_goes_on(tmp_path):
    store = _DiskFullStore(tmp_path / "db.sqlite")
    futures = _table(store)
    scheduler = _running(futures, _Engine())
    try:
        _submit(futures, scheduler, "r1", "save_weights", 1)
        assert json.loads(_result(futures, "r1").body)["path"].endswith("/r1")
        _submit(futures, scheduler, "r2", "forward_backward", 2)
        assert json.loads(_result(futures, "r2").body) == {"ok": "r2"}
        assert scheduler.liveness() == "ok" and futures.unstored == 2
        store.futures.full = False  # space is back: results are stored again, no restart
        _submit(futures, scheduler, "r3", "optim_step", 3)
        _result(futures, "r3")
        row = store.futures.get("r3")
        assert row is not None and row.state == "done"
    finally:
        scheduler.stop()
        store.close()


def test_a_result_the_scheduler_cannot_handle_becomes_an_error_and_the_worker_goes_on(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    futures = _table(store)
    scheduler = _running(futures, _Engine({"bad": "not-a-result"}))
    try:
        _submit(futures, scheduler, "bad", "save_weights", 1)
        message = _error(_result(futures, "bad"))
        assert message.startswith("internal error while recording the result: AttributeError")
        _submit(futures, scheduler, "next", "forward_backward", 2)
        assert not _result(futures, "next").failed
        assert scheduler.liveness() == "ok"
    finally:
        scheduler.stop()
        store.close()


def test_an_exception_escaping_a_round_fails_its_ops_and_the_worker_goes_on(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    futures = _table(store)

    class _BrokenSampler(_Engine):
        def start_sample(self, ops: list[Job]) -> list[Result | PendingSample]:
            # an executor bug: a pending sample without a future, which the round trips over
            return [PendingSample(None, lambda out: Result.json(out)) for _ in ops]  # type: ignore[arg-type]

    scheduler = _running(futures, _BrokenSampler())
    try:
        futures.create("s1", TENANT, kind="sample")
        scheduler.submit(job("s1", "sample", TENANT))
        message = _error(_result(futures, "s1"))
        assert message.startswith("internal error while running the request: AttributeError")
        _submit(futures, scheduler, "next", "forward_backward", 1)
        assert not _result(futures, "next").failed
        assert scheduler.stats.round_errors == 1 and scheduler.liveness() == "ok"
    finally:
        scheduler.stop()
        store.close()


def test_an_out_of_space_checkpoint_write_is_disk_full_naming_no_path(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    futures = _table(store)
    guard = DiskGuard(tmp_path, 1 << 16)
    secret = str(tmp_path / "tenants" / "secret")
    engine = _Engine({"save": OSError(errno.ENOSPC, "No space left on device", secret)})
    scheduler = _running(futures, engine, disk_guard=guard)
    try:
        _submit(futures, scheduler, "save", "save_weights", 1)
        result = _result(futures, "save")
        message = _error(result)
        assert message == disk.FULL_MESSAGE and str(tmp_path) not in result.body.decode()
        assert json.loads(result.body)["category"] == "server"
        assert guard.times_full == 1 and not (tmp_path / disk.RESERVE_NAME).exists()
        # this disk has room: the next save takes the reserve back and runs
        _submit(futures, scheduler, "save2", "save_weights", 2)
        assert not _result(futures, "save2").failed
        assert guard.state() == "ok" and (tmp_path / disk.RESERVE_NAME).stat().st_size == 1 << 16
    finally:
        scheduler.stop()
        store.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # on purpose
def test_a_dead_engine_fails_its_work_and_every_later_request_and_healthz_says_so(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    futures = _table(store)
    scheduler = _running(futures, _Engine({"fatal": SystemExit(3)}))
    try:
        assert health.report(scheduler.liveness(), "ok") == (
            200,
            {"status": "ok", "engine": "ok", "disk": "ok"},
        )
        _submit(futures, scheduler, "fatal", "save_weights", 1)
        assert _error(_result(futures, "fatal")) == ENGINE_DEAD
        _submit(futures, scheduler, "late", "forward_backward", 2)
        assert _error(_result(futures, "late", timeout=1.0)) == ENGINE_DEAD
        assert scheduler.call(lambda: None).exception(timeout=1.0) is not None
        assert scheduler.liveness() == "dead"
        assert health.report(scheduler.liveness(), "full")[0] == 503
    finally:
        scheduler.stop()
        store.close()


def _liveness_becomes(scheduler: Scheduler, state: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while scheduler.liveness() != state and time.monotonic() < deadline:
        time.sleep(0.02)
    return scheduler.liveness() == state


def test_a_round_that_never_ends_is_reported_stalled(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    futures = _table(store)
    release = threading.Event()

    class _Stuck(_Engine):
        def run_control(self, op: Job) -> Any:
            release.wait(30)
            return super().run_control(op)

    scheduler = _running(futures, _Stuck(), stall_s=0.2)
    try:
        _submit(futures, scheduler, "slow", "save_weights", 1)
        assert _liveness_becomes(scheduler, "stalled")
        release.set()
        _result(futures, "slow")
        assert _liveness_becomes(scheduler, "ok")  # once the round has ended
    finally:
        release.set()
        scheduler.stop()
        store.close()


# ============================================================================ results by bytes


def _finish(futures: FutureTable, request_id: str, size: int) -> None:
    futures.create(request_id, TENANT, kind="sample")
    futures.complete(request_id, Result("application/x-protobuf", bytes([len(request_id)]) * size))


def test_results_in_memory_are_bounded_by_bytes_and_big_ones_come_from_sqlite(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    futures = _table(store, memory_bytes=10_000, memory_entry_bytes=4_000)
    try:
        for i in range(5):
            _finish(futures, f"r{i}", 3_000)
        _finish(futures, "big", 50_000)
        memory = futures.memory()
        assert memory["results_in_memory_bytes"] <= 10_000
        assert 0 < memory["results_in_memory"] < 5  # the oldest left memory, `big` never entered
        for request_id, size in [("r0", 3_000), ("r4", 3_000), ("big", 50_000)]:
            assert len(_result(futures, request_id).body) == size
    finally:
        store.close()


def test_stored_results_are_bounded_by_bytes_oldest_first_and_a_late_poll_is_told(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    futures = _table(store, memory_bytes=0, stored_bytes=10_000)
    try:
        for i in range(8):
            _finish(futures, f"r{i}", 3_000)
            time.sleep(0.002)  # distinct finish times: "oldest" is well defined
        futures.prune_stored()
        assert store.futures.result_bytes() <= 10_000
        assert len(_result(futures, "r7").body) == 3_000
        with pytest.raises(NotFound, match="its result was dropped"):
            _result(futures, "r0")
    finally:
        store.close()


def test_an_unstored_result_that_leaves_memory_answers_why(tmp_path):
    store = _DiskFullStore(tmp_path / "db.sqlite")
    futures = _table(store, memory_bytes=5_000)
    try:
        _finish(futures, "first", 3_000)
        _finish(futures, "second", 3_000)  # pushes `first` out; it was never stored
        assert _error(_result(futures, "first")) == PROBLEM_LOST
        assert len(_result(futures, "second").body) == 3_000
    finally:
        store.close()


# ============================================================================ through the SDK


def test_healthz_is_open_and_says_only_how_the_engine_disk_and_sampler_are(server):
    response = httpx.get(f"{server.base_url}/api/v1/healthz", timeout=10)
    assert response.status_code == 200
    # `rollout`: the sampler's own health (`Sampler.health`), here the embedded engine's
    assert response.json() == {"status": "ok", "engine": "ok", "disk": "ok", "rollout": "ok"}


def test_a_full_disk_fails_saves_with_a_clear_error_and_recovers_without_a_restart(
    server, base_model, monkeypatch, tmp_path
):
    switch = tmp_path / "disk-full"
    monkeypatch.setenv(disk.FAULT_ENV, str(switch))
    sc_a, sc_b = connect(server), connect(server, KEY_B)
    try:
        tc_a = sc_a.create_lora_training_client(base_model=base_model, rank=4).result(timeout=60)
        tc_b = sc_b.create_lora_training_client(base_model=base_model, rank=4).result(timeout=60)
        switch.touch()
        with pytest.raises(tinker.RequestFailedError, match="the server's data disk is full"):
            tc_a.save_state("while-full").result(timeout=60)
        # another tenant's training is not held up
        out = tc_b.forward_backward([sl_datum([1, 2, 3, 4])], "cross_entropy").result(timeout=60)
        assert out.metrics["loss:sum"] > 0
        healthz = httpx.get(f"{server.base_url}/api/v1/healthz", timeout=10)
        assert healthz.status_code == 200
        assert healthz.json() == {
            "status": "degraded",
            "engine": "ok",
            "disk": "full",
            "rollout": "ok",
        }
        switch.unlink()  # space is back
        path = tc_a.save_state("after").result(timeout=60).path
        assert path.endswith("/weights/after")
        assert httpx.get(f"{server.base_url}/api/v1/healthz", timeout=10).json()["disk"] == "ok"
    finally:
        sc_a.close("success").result(timeout=30)
        sc_b.close("success").result(timeout=30)


# ============================================================================ SQLite on a full disk

_FULL_DISK_SCRIPT = r"""
import json, os, sys
from pathlib import Path
from lorafleet.server.state.disk import DiskGuard
from lorafleet.server.errors import DiskFull
from lorafleet.server.state.store import Store

root = Path(sys.argv[1])
guard = DiskGuard(root, 1 << 20)  # capped at 1/16 of the 2 MiB filesystem
store = Store(root / "lorafleet.db", on_disk_full=guard.release)
for i in range(40):
    store.futures.add(f"r{i}", "t", None, None, "sample", None)

def fill(name):
    with open(root / name, "wb", buffering=0) as out:
        for chunk in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    out.write(b"x" * chunk)
            except OSError:
                pass

fill("filler-1")
out = {"reserve": guard.reserve_bytes}
store.futures.finish("r1", "done", "application/json", b"{}")  # on a full disk
out["finished_on_full_disk"] = store.futures.get("r1").state
out["guard_full"] = guard.full
error = None
for i in range(200):  # the room the remedies made runs out too: then DiskFull, not OperationalError
    fill(f"filler-more-{i}")
    try:
        store.futures.add(f"x{i}", "t", None, None, "sample", "p" * 4096)
    except DiskFull as exc:
        error = [exc.status, exc.message]
        break
out["error"] = error
for path in root.glob("filler*"):
    path.unlink()
store.futures.add("after", "t", None, None, "sample", None)
out["after_freeing"] = store.futures.get("after").state
out["guard_after_refresh"] = guard.state()
print(json.dumps(out))
"""


def test_sqlite_on_a_really_full_disk_makes_room_then_says_disk_full(tmp_path):
    """On a real 2 MiB tmpfs (a private mount namespace): a full disk first makes SQLite unable
    to write anything; the store truncates its WAL and releases the disk reserve so that a
    result is still recorded, and once no room is left it raises DiskFull (507), never
    sqlite3.OperationalError, and works again when space returns."""
    from tests.reliability.disk_full import run_on_small_tmpfs

    out = run_on_small_tmpfs(tmp_path, _FULL_DISK_SCRIPT)
    assert out["reserve"] == 128 << 10
    assert out["finished_on_full_disk"] == "done" and out["guard_full"] is True
    assert out["error"] == [507, disk.FULL_MESSAGE]
    assert out["after_freeing"] == "pending" and out["guard_after_refresh"] == "ok"
