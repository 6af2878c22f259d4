"""The way out of a full data disk stays open (issue 20, found by re-testing): deleting a
checkpoint works on a disk with no byte left; while the disk is full, finished results are
not written to SQLite (where a few big sample results ate the reserve that keeps deletions
writable, after which every delete answered 507 "delete checkpoints"); and heartbeats the disk
cannot store still keep their sessions alive."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from lorafleet.server.http.sessions import Sessions
from lorafleet.server.ops.futures import FULL_DISK_STORE_BYTES, FutureTable, Result
from lorafleet.server.state import disk
from lorafleet.server.state.keys import Tenant
from lorafleet.server.state.ownership import Ownership
from lorafleet.server.state.store import ModelRow, Store
from lorafleet.server.state.store.sessions import SessionsTable


def test_big_results_are_kept_out_of_sqlite_while_the_disk_is_full(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    full = [True]
    futures = FutureTable(store, disk_full=lambda: full[0])
    big = Result.json({"tokens": [7] * FULL_DISK_STORE_BYTES})
    small = Result.json({"ok": 1})
    for request_id in ("big", "small", "big-after"):
        futures.create(request_id, "t", kind="sample")
    futures.complete("big", big)
    futures.complete("small", small)
    full[0] = False
    futures.complete("big-after", big)

    big_row, small_row, after_row = (store.futures.get(r) for r in ("big", "small", "big-after"))
    assert big_row is not None and big_row.state == "pending"  # not written while full
    assert small_row is not None and small_row.state == "done"  # bookkeeping-sized: written
    assert after_row is not None and after_row.state == "done"
    assert futures.memory()["results_unstored"] == 1
    delivered = asyncio.run(futures.wait("big", "t", 1.0))  # still delivered, from memory
    assert delivered is not None and delivered.body == big.body


_DELETE_ON_FULL_DISK = r"""
import json, sys
from pathlib import Path
from types import SimpleNamespace
from lorafleet.server.engine.checkpoint_files import CheckpointFiles
from lorafleet.server.state.disk import DiskGuard
from lorafleet.server.errors import DiskFull
from lorafleet.server.state.paths import TENANTS_DIR
from lorafleet.server.state.store import CheckpointRow, Store

root = Path(sys.argv[1])
guard = DiskGuard(root, 1 << 20)
store = Store(root / "lorafleet.db", on_disk_full=guard.release)
path = "tinker://m:train:0/weights/w0"
ckpt = root / TENANTS_DIR / "t" / "runs" / "m.train.0" / "weights" / "w0"
ckpt.mkdir(parents=True)
(ckpt / "adapter.bin").write_bytes(b"w" * (512 << 10))
row = CheckpointRow(path, "t", "m:train:0", "training", "w0", str(ckpt), 0.0, 512 << 10,
                    None, None, {})
store.checkpoints.put(row)

def fill(name):
    with open(root / name, "wb", buffering=0) as out:
        for chunk in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    out.write(b"x" * chunk)
            except OSError:
                pass

# fill until the store cannot write even after its remedies (WAL truncated, reserve released)
refused = False
for i in range(400):
    fill(f"filler-{i}")
    try:
        store.futures.add(f"x{i}", "t", None, None, "sample", "p" * 4096)
    except DiskFull:
        refused = True
        break
retired = []
files = CheckpointFiles(store, None, SimpleNamespace(retire_checkpoint=retired.append), root,
                        "base", root)
out = {"refused_before": refused}
try:
    files.delete(store.checkpoints.get(path))
    out["delete"] = "ok"
except DiskFull as exc:
    out["delete"] = f"DiskFull: {exc.message}"
out["row_left"] = store.checkpoints.get(path) is not None
out["dir_left"] = ckpt.exists()
out["retired"] = retired
print(json.dumps(out))
"""


def test_deleting_a_checkpoint_works_on_a_disk_with_no_byte_left(tmp_path):
    """A real 2 MiB tmpfs in a private mount namespace (`unshare -rm`), filled until SQLite
    cannot write at all: the delete frees the files to make room for the row's DELETE."""
    from tests.reliability.disk_full import run_on_small_tmpfs

    out = run_on_small_tmpfs(tmp_path, _DELETE_ON_FULL_DISK)
    assert out == {
        "refused_before": True,
        "delete": "ok",
        "row_left": False,
        "dir_left": False,
        "retired": ["tinker://m:train:0/weights/w0"],
    }


class _FullDiskSessions(SessionsTable):
    """A real sessions table whose heartbeat writes fail as on a full disk while `full`."""

    full = True

    def heartbeat(self, session_id: str) -> None:
        if self.full:
            raise disk.disk_full_error()
        super().heartbeat(session_id)


class _FullDiskStore(Store):
    def __init__(self, path: Path):
        super().__init__(path)
        self.sessions: _FullDiskSessions = _FullDiskSessions(self.database)


class _Engine:
    def __init__(self) -> None:
        self.unloaded: list[str] = []

    def unload_models(self, model_ids: list[str], reason: str) -> None:
        self.unloaded += model_ids


def test_heartbeats_a_full_disk_cannot_store_still_keep_the_session_alive(tmp_path):
    """Before: each heartbeat answered 507 and left last_heartbeat where it was, so once the disk
    had been full longer than the session timeout, maintenance unloaded every live model."""
    store = _FullDiskStore(tmp_path / "db.sqlite")
    engine = _Engine()
    sessions = Sessions(store, Ownership(store), engine, None)
    tenant = Tenant("t")
    session_id = sessions.create(tenant, {"tags": [], "sdk_version": "0.38.0"})["session_id"]
    store.models.add(
        ModelRow(
            "m", tenant.id, session_id, "base", 4, {}, None, time.time(), time.time(), "active"
        )
    )
    assert sessions.heartbeat(tenant, {"session_id": session_id}) == {"type": "session_heartbeat"}
    sessions.expire_stale(time.time() - 1.0, 900)  # its stored heartbeat is older than this
    assert engine.unloaded == []
    assert store.sessions.get(session_id).finished_at is None
    sessions.expire_stale(time.time() + 1.0, 900)  # silent past the timeout: expired after all
    assert engine.unloaded == ["m"]
