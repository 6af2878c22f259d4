"""The one SQLite connection every table of the store shares: opening it, the schema and the
migrations from older versions, and the write path that survives a full disk.

One connection behind one lock (the HTTP thread and the engine worker both write; every
statement is short), WAL so that readers never wait for the writer, `synchronous=NORMAL`
because WAL keeps the database consistent across a crash and losing the last few milliseconds
of commits costs at most a retried request. Older databases are migrated in one transaction
at open.

Paths are stored relative to the data directory (the database file's directory), so a data
dir that is moved or restored elsewhere still names its own files (checkpoints.py converts
them on the way in and out; `relative_dir` is the rule both it and the schema-1 migration
apply).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from lorafleet.server.state import disk

_T = TypeVar("_T")
SCHEMA_VERSION = 5
"""1: checkpoint dirs absolute; 2: relative to the data dir; 3: the usage table (metering);
4: model aliases (OpenAI routes) and run metrics (console curves); 5: stability records
(record_stability_info samples, for the stable_reinforce loss)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    created_at REAL NOT NULL,
    last_heartbeat REAL NOT NULL,
    finished_at REAL,
    finish_reason TEXT,
    info TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS models (
    model_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    base_model TEXT NOT NULL,
    lora_rank INTEGER NOT NULL,
    lora TEXT NOT NULL,
    user_metadata TEXT,
    created_at REAL NOT NULL,
    last_request_time REAL NOT NULL,
    status TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS models_by_tenant ON models (tenant, created_at);
CREATE TABLE IF NOT EXISTS futures (
    request_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    scope TEXT,
    seq_id INTEGER,
    kind TEXT NOT NULL,
    fingerprint TEXT,
    state TEXT NOT NULL,
    content_type TEXT,
    body BLOB,
    created_at REAL NOT NULL,
    finished_at REAL
);
CREATE UNIQUE INDEX IF NOT EXISTS futures_by_seq ON futures (scope, seq_id)
    WHERE scope IS NOT NULL AND seq_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS checkpoints (
    tinker_path TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    model_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    dir TEXT NOT NULL,
    created_at REAL NOT NULL,
    size_bytes INTEGER,
    user_metadata TEXT,
    expires_at REAL,
    info TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS checkpoints_by_tenant ON checkpoints (tenant, model_id, created_at);
CREATE TABLE IF NOT EXISTS usage (
    tenant TEXT NOT NULL,
    run TEXT NOT NULL,
    day TEXT NOT NULL,
    counter TEXT NOT NULL,
    value REAL NOT NULL,
    PRIMARY KEY (tenant, run, day, counter)
);
CREATE TABLE IF NOT EXISTS sampling_sessions (
    sampling_session_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    base_model TEXT NOT NULL,
    model_path TEXT,
    adapter_id TEXT,
    adapter_version INTEGER,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS aliases (
    tenant TEXT NOT NULL,
    alias TEXT NOT NULL,
    target TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (tenant, alias)
);
CREATE TABLE IF NOT EXISTS run_metrics (
    tenant TEXT NOT NULL,
    run TEXT NOT NULL,
    name TEXT NOT NULL,
    step INTEGER NOT NULL,
    value REAL NOT NULL,
    source TEXT NOT NULL,
    at REAL NOT NULL,
    PRIMARY KEY (tenant, run, name, step, source)
);
CREATE TABLE IF NOT EXISTS stability_records (
    request_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    version TEXT NOT NULL,
    prompt BLOB NOT NULL,
    tokens BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    offsets BLOB NOT NULL,
    size_bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    last_used REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS stability_records_by_tenant ON stability_records (tenant);
CREATE INDEX IF NOT EXISTS stability_records_by_session ON stability_records (session_id);
CREATE INDEX IF NOT EXISTS stability_records_by_use ON stability_records (last_used);
"""


def to_json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True)


def from_json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


class StoreError(RuntimeError):
    """The database says something this server cannot act on safely (a newer schema, a stored
    path outside the data dir); nothing was changed."""


def relative_dir(stored: str, tinker_path: str) -> PurePosixPath:
    """A stored checkpoint dir, checked to stay inside the data dir: relative, no `..`."""
    path = PurePosixPath(stored)
    if path.is_absolute() or not path.parts or ".." in path.parts:
        raise StoreError(
            f"checkpoint {tinker_path}: stored dir {stored!r} is not a path inside the data dir"
        )
    return path


def _layout_tail(stored: str, tinker_path: str) -> str:
    """Schema 1 stored absolute dirs. Whatever directory the data dir was in then, the tail is
    the data-dir layout: `tenants/<tenant>/runs/<run>/<segment>/<name>` (checkpoints) or
    `ephemeral/<run>/<version>`."""
    path = PurePosixPath(stored)
    if not path.is_absolute():
        return str(relative_dir(stored, tinker_path))
    parts = path.parts
    if len(parts) > 6 and parts[-6] == "tenants" and parts[-4] == "runs":
        tail = parts[-6:]
    elif len(parts) > 3 and parts[-3] == "ephemeral":
        tail = parts[-3:]
    else:
        raise StoreError(
            f"cannot migrate checkpoint {tinker_path}: its dir {stored!r} is not in the data-dir "
            "layout (tenants/<tenant>/runs/<run>/<segment>/<name>); the database was left unchanged"
        )
    return str(relative_dir(str(PurePosixPath(*tail)), tinker_path))


def _v1_relative_dirs(db: sqlite3.Connection) -> None:
    for row in db.execute("SELECT tinker_path, dir FROM checkpoints").fetchall():
        db.execute(
            "UPDATE checkpoints SET dir=? WHERE tinker_path=?",
            (_layout_tail(row["dir"], row["tinker_path"]), row["tinker_path"]),
        )


_USAGE_TABLE = (
    "CREATE TABLE IF NOT EXISTS usage (tenant TEXT NOT NULL, run TEXT NOT NULL, day TEXT NOT NULL, "
    "counter TEXT NOT NULL, value REAL NOT NULL, PRIMARY KEY (tenant, run, day, counter))"
)


def _v2_usage_table(db: sqlite3.Connection) -> None:
    """Metering (ops/metering.py): one row per tenant, run, UTC day and counter."""
    db.execute(_USAGE_TABLE)


_ALIASES_TABLE = (
    "CREATE TABLE IF NOT EXISTS aliases (tenant TEXT NOT NULL, alias TEXT NOT NULL, "
    "target TEXT NOT NULL, created_at REAL NOT NULL, PRIMARY KEY (tenant, alias))"
)
_RUN_METRICS_TABLE = (
    "CREATE TABLE IF NOT EXISTS run_metrics (tenant TEXT NOT NULL, run TEXT NOT NULL, "
    "name TEXT NOT NULL, step INTEGER NOT NULL, value REAL NOT NULL, source TEXT NOT NULL, "
    "at REAL NOT NULL, PRIMARY KEY (tenant, run, name, step, source))"
)


def _v3_aliases_and_run_metrics(db: sqlite3.Connection) -> None:
    """Aliases a tenant gives its sampler paths (the OpenAI routes' `model`), and per-step run
    metrics (the server's own loss, and what clients post) for the console's curves."""
    db.execute(_ALIASES_TABLE)
    db.execute(_RUN_METRICS_TABLE)


def _v4_stability_records(db: sqlite3.Connection) -> None:
    """Records of samples taken with record_stability_info (store/stability_records.py); the
    statements are the ones in _SCHEMA, which creates them for a new database."""
    start = _SCHEMA.index("CREATE TABLE IF NOT EXISTS stability_records")
    for statement in _SCHEMA[start:].split(";"):
        if statement.strip():
            db.execute(statement)


_MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {
    1: _v1_relative_dirs,
    2: _v2_usage_table,
    3: _v3_aliases_and_run_metrics,
    4: _v4_stability_records,
}
"""schema version -> the step to the next one; all steps run in one transaction at open."""


class Database:
    """The connection, its lock and the data dir it lives in; the tables (one module each)
    read and write through it, so that they all share one lock and one transaction order."""

    def __init__(self, path: str | Path, *, on_disk_full: Callable[[], bool] | None = None):
        """The data dir, which stored paths are relative to, is the database file's directory."""
        self.path = Path(path)
        self._on_disk_full = on_disk_full  # DiskGuard.release: True if room was made
        self.data_dir = Path(os.path.abspath(self.path.parent))
        self.real_root = os.path.realpath(self.data_dir)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        try:
            with self._lock:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._db.execute("PRAGMA foreign_keys=ON")
                self._migrate()
                self._db.executescript(_SCHEMA)
                if self._schema_version() is None:
                    self._db.execute(
                        "INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
                    )
        except BaseException:
            self._db.close()
            raise

    def _schema_version(self) -> int | None:
        """None for a new database."""
        has_meta = self._db.execute(
            "SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'"
        ).fetchone()
        if has_meta is None:
            return None
        row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        return None if row is None else int(row["value"])

    def _migrate(self) -> None:
        """Brings an older database to SCHEMA_VERSION, all steps in one transaction: a step
        that fails (a row it cannot convert) leaves the database as it was."""
        with self.tx() as db:
            version = self._schema_version()
            if version is None or version == SCHEMA_VERSION:
                return
            steps = range(version, SCHEMA_VERSION)
            if version > SCHEMA_VERSION or any(step not in _MIGRATIONS for step in steps):
                raise StoreError(
                    f"{self.path}: schema version {version}, this server speaks {SCHEMA_VERSION}"
                )
            for step in steps:
                _MIGRATIONS[step](db)
            db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """One transaction under the lock; rolled back on any error."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def one(self, sql: str, args: tuple) -> sqlite3.Row | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def all(self, sql: str, args: tuple) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def run(self, sql: str, args: tuple) -> int:
        """One writing statement through `write`; the number of rows it changed."""
        return self.write(lambda db: db.execute(sql, args).rowcount)

    def write(self, write: Callable[[sqlite3.Connection], _T]) -> _T:
        """A write. On a full disk it first makes room (the WAL checkpointed and truncated, then
        the disk guard's reserve released) and retries; if that is not enough, DiskFull."""
        failure: sqlite3.OperationalError | None = None
        remedies: list[Callable[[], bool] | None] = [None, self._truncate_wal]
        if self._on_disk_full is not None:
            remedies.append(self._on_disk_full)
        with self._lock:
            for remedy in remedies:
                if remedy is not None and not remedy():
                    continue
                try:
                    if remedy is None and disk.injected_full():
                        raise sqlite3.OperationalError("database or disk is full")
                    return write(self._db)
                except sqlite3.OperationalError as exc:
                    if not disk.is_disk_full(exc):
                        raise
                    failure = exc
            raise disk.disk_full_error() from failure

    def _truncate_wal(self) -> bool:
        """Moves the WAL into the database and truncates it: a full disk leaves the WAL unable
        to grow and never reaching the size that would checkpoint it by itself."""
        try:
            busy, _, _ = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        except sqlite3.OperationalError as exc:
            if disk.is_disk_full(exc):
                return False
            raise
        return busy == 0
