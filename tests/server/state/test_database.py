"""The database under every table: schemas 1 to 3 migrated at open in one transaction (a row
that cannot be converted changes nothing), a newer schema refused, and the write path that
makes room on a full disk before it gives up."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest

from lorafleet.server.errors import DiskFull
from lorafleet.server.state.store import SCHEMA_VERSION, Store, StoreError
from lorafleet.server.state.store.database import Database

WEIGHTS = "tenants/t1/runs/m1/weights"

# the checkpoints table and meta as schema 1 created them
SCHEMA_1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE checkpoints (
    tinker_path TEXT PRIMARY KEY, tenant TEXT NOT NULL, model_id TEXT NOT NULL,
    kind TEXT NOT NULL, name TEXT NOT NULL, dir TEXT NOT NULL, created_at REAL NOT NULL,
    size_bytes INTEGER, user_metadata TEXT, expires_at REAL, info TEXT NOT NULL
);
INSERT INTO meta VALUES ('schema_version', '1');
"""
WEIGHTS = "tenants/t1/runs/m1/weights"


def _old_database(data_dir: Path, rows: dict[str, str]) -> Path:
    """A schema-1 database in `data_dir` whose rows (tinker path -> dir) hold absolute dirs."""
    data_dir.mkdir(parents=True, exist_ok=True)
    db_path = data_dir / "lorafleet.db"
    db = sqlite3.connect(db_path)
    db.executescript(SCHEMA_1)
    for path, directory in rows.items():
        db.execute(
            "INSERT INTO checkpoints VALUES (?, 't1', 'm1', 'training', ?, ?, ?, 1, NULL, NULL, '{}')",
            (path, path.rsplit("/", 1)[1], directory, time.time()),
        )
    db.commit()
    db.close()
    return db_path


def _stored(db_path: Path) -> tuple[str, dict[str, str]]:
    db = sqlite3.connect(db_path)
    try:
        version = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0]
        return version, dict(db.execute("SELECT tinker_path, dir FROM checkpoints").fetchall())
    finally:
        db.close()


def test_a_schema_1_database_from_a_moved_data_dir_is_migrated(tmp_path):
    """Absolute dirs under the old location (`/srv/old-data/...`) become relative ones that
    resolve under wherever the database now is."""
    new = tmp_path / "data2"
    db_path = _old_database(
        new,
        {
            "tinker://m1/weights/a": f"/srv/old-data/{WEIGHTS}/a",
            "tinker://m1/sampler_weights/b": "/srv/old-data/tenants/t1/runs/m1/sampler_weights/b",
            "tinker://m1/weights/c": "/srv/old-data/ephemeral/m1/3",
        },
    )
    store = Store(db_path)
    try:
        assert store.checkpoints.get("tinker://m1/weights/a").dir == str(new / WEIGHTS / "a")
        assert store.checkpoints.get("tinker://m1/weights/c").dir == str(new / "ephemeral/m1/3")
    finally:
        store.close()
    assert _stored(db_path) == (
        str(SCHEMA_VERSION),
        {
            "tinker://m1/weights/a": f"{WEIGHTS}/a",
            "tinker://m1/sampler_weights/b": "tenants/t1/runs/m1/sampler_weights/b",
            "tinker://m1/weights/c": "ephemeral/m1/3",
        },
    )
    Store(db_path).close()  # opening a migrated database again changes nothing
    assert _stored(db_path)[1]["tinker://m1/weights/a"] == f"{WEIGHTS}/a"


def test_a_migration_that_cannot_convert_a_row_changes_nothing(tmp_path):
    rows = {"tinker://m1/weights/a": f"/srv/old/{WEIGHTS}/a", "tinker://m1/weights/b": "/etc/b"}
    db_path = _old_database(tmp_path / "data", rows)
    with pytest.raises(StoreError, match=r"tinker://m1/weights/b.*'/etc/b'.*left unchanged"):
        Store(db_path)
    assert _stored(db_path) == ("1", rows)


def test_a_newer_schema_is_refused(tmp_path):
    db_path = _old_database(tmp_path / "data", {})
    db = sqlite3.connect(db_path)
    db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION + 1),))
    db.commit()
    db.close()
    with pytest.raises(StoreError, match=f"schema version {SCHEMA_VERSION + 1}"):
        Store(db_path)


def test_a_schema_2_database_gains_the_usage_table(tmp_path):
    path = tmp_path / "lorafleet.db"
    Store(path).close()
    with sqlite3.connect(path) as db:  # as a server before metering left it
        db.execute("DROP TABLE usage")
        db.execute("DROP TABLE aliases")
        db.execute("DROP TABLE run_metrics")
        db.execute("UPDATE meta SET value='2' WHERE key='schema_version'")
    store = Store(path)
    try:
        store.usage.add([("t", "run", "2026-12-01", "trained_tokens", 5.0)])
        store.usage.add([("t", "run", "2026-12-01", "trained_tokens", 2.0)])
        assert store.usage.totals("t") == [("t", "run", "trained_tokens", 7.0)]
    finally:
        store.close()
    with sqlite3.connect(path) as db:
        version = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert int(version[0]) == SCHEMA_VERSION == 5
    assert {"usage", "aliases", "run_metrics"} <= tables


def _always_full(calls: list[str]):
    def write(_db: sqlite3.Connection) -> None:
        calls.append("write")
        raise sqlite3.OperationalError("database or disk is full")

    return write


def test_a_write_on_a_full_disk_retries_after_each_remedy_then_raises_disk_full(tmp_path):
    calls: list[str] = []

    def release() -> bool:
        calls.append("release")
        return True

    db = Database(tmp_path / "db.sqlite", on_disk_full=release)
    try:
        with pytest.raises(DiskFull):
            db.write(_always_full(calls))
        # first try, again after the WAL is truncated, again after the reserve is released
        assert calls == ["write", "write", "release", "write"]
    finally:
        db.close()


def test_without_a_disk_guard_a_full_disk_is_not_retried_for_nothing(tmp_path):
    """Before the split the write loop tried a third time with no remedy at all."""
    calls: list[str] = []
    db = Database(tmp_path / "db.sqlite")
    try:
        with pytest.raises(DiskFull):
            db.write(_always_full(calls))
        assert calls == ["write", "write"]
    finally:
        db.close()


def test_a_guard_that_frees_nothing_is_not_followed_by_another_try(tmp_path):
    calls: list[str] = []

    def release() -> bool:
        calls.append("release")
        return False

    db = Database(tmp_path / "db.sqlite", on_disk_full=release)
    try:
        with pytest.raises(DiskFull):
            db.write(_always_full(calls))
        assert calls == ["write", "write", "release"]
    finally:
        db.close()


def test_other_errors_are_not_taken_for_a_full_disk(tmp_path):
    db = Database(tmp_path / "db.sqlite")
    try:
        with pytest.raises(sqlite3.OperationalError, match="no such table"):
            db.run("DELETE FROM nowhere", ())
    finally:
        db.close()


def test_every_table_shares_the_one_connection_and_its_transactions(tmp_path):
    """A transaction held by one thread keeps every table's writes from another thread out
    until it ends, and a rolled-back transaction leaves no table changed."""
    store = Store(tmp_path / "db.sqlite")
    try:
        entered, release = threading.Event(), threading.Event()
        written: list[str] = []

        def hold() -> None:
            with store.database.tx():
                entered.set()
                release.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        entered.wait(10)
        writer = threading.Thread(
            target=lambda: (store.aliases.put("t", "a", "x", 0.0, 8), written.append("alias"))
        )
        writer.start()
        writer.join(0.2)
        assert written == []  # waiting for the lock the transaction holds
        release.set()
        holder.join(10)
        writer.join(10)
        assert written == ["alias"]

        with pytest.raises(RuntimeError, match="abandoned"), store.database.tx() as db:
            db.execute("INSERT INTO aliases VALUES ('t', 'b', 'y', 0.0)")
            db.execute("INSERT INTO usage VALUES ('t', 'r', '2026-12-01', 'steps', 1.0)")
            raise RuntimeError("abandoned")
        assert store.aliases.get("t", "b") is None
        assert store.usage.totals("t") == []
    finally:
        store.close()


def test_a_new_database_is_at_the_current_schema_and_reopens_unchanged(tmp_path):
    path = tmp_path / "lorafleet.db"
    Store(path).close()
    store = Store(path)
    try:
        assert store.path == path and store.data_dir == tmp_path
        row = store.database.one("SELECT value FROM meta WHERE key='schema_version'", ())
        assert row is not None and int(row["value"]) == SCHEMA_VERSION
        started = time.time()
        store.sessions.add("s", "t", {})
        session = store.sessions.get("s")
        assert session is not None and session.created_at >= started
    finally:
        store.close()
