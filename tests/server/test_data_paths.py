"""Paths in the database are relative to the data dir: older databases (absolute paths) are
migrated at open, a stored path never leads outside the data dir, and start-up recovery refuses
to delete more than a crash explains (the outside tester's `mv data data2` lost every
checkpoint: the rows held absolute paths and recovery deleted the directories as orphans)."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest

from lorafleet import cli
from lorafleet.server.main import ServerThread
from lorafleet.server.state import recovery
from lorafleet.server.state.recovery import MAX_UNASKED_DELETES, RecoveryRefused
from lorafleet.server.state.store import SCHEMA_VERSION, CheckpointRow, Store, StoreError
from tests.server.conftest import server_config

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


def _row(path: str, directory: Path | str) -> CheckpointRow:
    return CheckpointRow(
        path, "t1", "m1", "training", path.rsplit("/", 1)[1], str(directory), 0.0, 1, None, None, {}
    )


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
        assert store.get_checkpoint("tinker://m1/weights/a").dir == str(new / WEIGHTS / "a")
        assert store.get_checkpoint("tinker://m1/weights/c").dir == str(new / "ephemeral/m1/3")
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


@pytest.mark.parametrize("stored", ["../elsewhere/a", "/etc/passwd", "tenants/../../a", "escape"])
def test_a_stored_dir_never_resolves_outside_the_data_dir(tmp_path, stored):
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", data / "escape")  # a symlink out of the data dir
    store = Store(data / "lorafleet.db")
    try:
        store.put_checkpoint(_row("tinker://m1/weights/a", data / WEIGHTS / "a"))
        store._db.execute("UPDATE checkpoints SET dir=?", (stored,))
        with pytest.raises(StoreError, match="tinker://m1/weights/a"):
            store.get_checkpoint("tinker://m1/weights/a")
    finally:
        store.close()


def test_a_row_outside_the_data_dir_is_not_written(tmp_path):
    (tmp_path / "data").mkdir()
    store = Store(tmp_path / "data" / "lorafleet.db")
    try:
        with pytest.raises(StoreError, match="not inside the data dir"):
            store.put_checkpoint(_row("tinker://m1/weights/a", tmp_path / "elsewhere" / "a"))
        assert store.get_checkpoint("tinker://m1/weights/a") is None
    finally:
        store.close()


def _checkpoint_dirs(data: Path, names: list[str]) -> list[Path]:
    made = []
    for name in names:
        (data / WEIGHTS / name).mkdir(parents=True)
        (data / WEIGHTS / name / "state.json").write_text("{}")
        made.append(data / WEIGHTS / name)
    return made


def test_recovery_refuses_to_delete_more_than_a_crash_leaves(tmp_path):
    data = tmp_path / "data"
    dirs = _checkpoint_dirs(data, [f"o{i}" for i in range(MAX_UNASKED_DELETES + 1)])
    (data / WEIGHTS / ".x.ab12.tmp").mkdir()
    store = Store(data / "lorafleet.db")
    try:
        with pytest.raises(RecoveryRefused) as refused:
            recovery.sweep(data, store)
        message = str(refused.value)
        assert f"delete {MAX_UNASKED_DELETES + 1} checkpoint directories" in message
        assert "--allow-recovery-deletes" in message and "allow_recovery_deletes" in message
        assert all(d.is_dir() for d in dirs) and (data / WEIGHTS / ".x.ab12.tmp").is_dir()
        counts = recovery.sweep(data, store, allow_deletes=True)
        assert counts["orphans_removed"] == MAX_UNASKED_DELETES + 1
        assert counts["temp_removed"] == 1
        assert not any(d.exists() for d in dirs)
    finally:
        store.close()


def test_recovery_refuses_when_the_rows_files_are_gone_and_others_are_there(tmp_path):
    """The tester's report: every row's directory missing, as many unnamed ones present."""
    data = tmp_path / "data"
    dirs = _checkpoint_dirs(data, ["x", "y"])
    store = Store(data / "lorafleet.db")
    try:
        for name in ("a", "b"):
            store.put_checkpoint(_row(f"tinker://m1/weights/{name}", data / WEIGHTS / name))
        with pytest.raises(RecoveryRefused, match="2 checkpoint directories .* 2 of 2 rows"):
            recovery.sweep(data, store)
        assert all(d.is_dir() for d in dirs)
    finally:
        store.close()


def test_recovery_keeps_a_directory_where_a_rows_tinker_path_belongs(tmp_path):
    """Even when the row names another place, its checkpoint's own place is never an orphan."""
    data = tmp_path / "data"
    (kept,) = _checkpoint_dirs(data, ["a"])
    store = Store(data / "lorafleet.db")
    try:
        store.put_checkpoint(_row("tinker://m1/weights/a", data / "tenants/t1/elsewhere/a"))
        counts = recovery.sweep(data, store)
        assert counts["orphans_removed"] == 0 and counts["missing_dirs"] == 1
        assert kept.is_dir()
    finally:
        store.close()


def test_the_server_does_not_start_over_a_refused_recovery_unless_allowed(tmp_path):
    data = tmp_path / "data"
    dirs = _checkpoint_dirs(data, [f"o{i}" for i in range(MAX_UNASKED_DELETES + 1)])
    with pytest.raises(RecoveryRefused, match="--allow-recovery-deletes"):
        ServerThread(server_config(data))
    assert all(d.is_dir() for d in dirs)
    server = ServerThread(server_config(data, allow_recovery_deletes=True))
    try:
        assert server.service.recovered["orphans_removed"] == MAX_UNASKED_DELETES + 1
        assert not any(d.exists() for d in dirs)
    finally:
        server.stop()


def test_lorafleet_serve_names_the_counts_and_the_flag(tmp_path, monkeypatch):
    data = tmp_path / "data"
    dirs = _checkpoint_dirs(data, [f"o{i}" for i in range(MAX_UNASKED_DELETES + 1)])
    monkeypatch.setenv("LORAFLEET_API_KEYS", "tml-cli-refusal-key-0123456")
    args = ["serve", "--base-model", "tiny-qwen3", "--data-dir", str(data), "--port", "1"]
    with pytest.raises(SystemExit) as exited:
        cli.main(args)  # refused before the model loads
    message = str(exited.value.code)
    assert message.startswith("lorafleet serve: start-up recovery")
    assert f"delete {MAX_UNASKED_DELETES + 1} checkpoint directories" in message
    assert "--allow-recovery-deletes" in message
    assert all(d.is_dir() for d in dirs)
