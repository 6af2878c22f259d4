"""SQLite persistence for what must outlive the process: sessions, models, futures, checkpoints,
sampling sessions.

Adapter weights live in files (see paths.py); this database only says who owns what and where it
is. One connection behind a lock (the HTTP thread and the engine worker both write; every
statement is short), WAL so that readers never wait for the writer, `synchronous=NORMAL`
because WAL keeps the database consistent across a crash and losing the last few milliseconds
of commits costs at most a retried request.

Paths are stored relative to the data directory (the database file's directory), so a data dir
that is moved or restored elsewhere still names its own files: `CheckpointRow.dir` is absolute
in memory and converted here, on the way in and out, and a stored path that would lead outside
the data dir is refused when read. Older databases are migrated in one transaction at open.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from lorafleet.server.state import disk

_T = TypeVar("_T")
SCHEMA_VERSION = 4
"""1: checkpoint dirs absolute; 2: relative to the data dir; 3: the usage table (metering);
4: model aliases (OpenAI routes) and run metrics (console curves)."""

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
"""


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True)


def _unjson(text: str | None) -> Any:
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
    """Metering (metering.py): one row per tenant, run, UTC day and counter."""
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


_MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {
    1: _v1_relative_dirs,
    2: _v2_usage_table,
    3: _v3_aliases_and_run_metrics,
}
"""schema version -> the step to the next one; all steps run in one transaction at open."""


@dataclass
class SessionRow:
    session_id: str
    tenant: str
    created_at: float
    last_heartbeat: float
    finished_at: float | None
    finish_reason: str | None
    info: dict[str, Any]


@dataclass
class ModelRow:
    model_id: str
    tenant: str
    session_id: str
    base_model: str  # the name the client used (preset name or path), echoed back to it
    lora_rank: int
    lora: dict[str, Any]  # rank, alpha, seed, train_attn, train_mlp, train_unembed
    user_metadata: dict[str, str] | None
    created_at: float
    last_request_time: float
    status: str  # "active" | "unloaded" | "lost"


@dataclass
class FutureRow:
    request_id: str
    tenant: str
    scope: str | None
    seq_id: int | None
    kind: str
    fingerprint: str | None
    state: str  # "pending" | "done" | "failed"
    content_type: str | None
    body: bytes | None
    created_at: float
    finished_at: float | None


@dataclass
class CheckpointRow:
    tinker_path: str
    tenant: str
    model_id: str
    kind: str  # "training" | "sampler"
    name: str
    dir: str
    created_at: float
    size_bytes: int | None
    user_metadata: dict[str, str] | None
    expires_at: float | None
    info: dict[str, Any]  # base_model, lora config: what weights_info and loads need

    def expired(self, now: float | None = None) -> bool:
        """Past its TTL: gone for the client at once, deleted at the next maintenance."""
        return self.expires_at is not None and self.expires_at <= (
            time.time() if now is None else now
        )


@dataclass
class SamplingSessionRow:
    sampling_session_id: str
    tenant: str
    session_id: str
    base_model: str
    model_path: str | None
    adapter_id: str | None  # sampler version key; None = the base model
    adapter_version: int | None
    created_at: float


class Store:
    def __init__(self, path: str | Path, *, on_disk_full: Callable[[], bool] | None = None):
        """The data dir, which stored paths are relative to, is the database file's directory."""
        self.path = Path(path)
        self._on_disk_full = on_disk_full  # DiskGuard.release: True if room was made
        self.data_dir = Path(os.path.abspath(self.path.parent))
        self._real_root = os.path.realpath(self.data_dir)
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
        with self._tx() as db:
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
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _one(self, sql: str, args: tuple) -> sqlite3.Row | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def _all(self, sql: str, args: tuple) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _run(self, sql: str, args: tuple) -> int:
        return self._write(lambda db: db.execute(sql, args).rowcount)

    def _write(self, write: Callable[[sqlite3.Connection], _T]) -> _T:
        """A write. On a full disk it first makes room (the WAL checkpointed and truncated, then
        the disk guard's reserve released) and retries; if that is not enough, DiskFull."""
        failure: sqlite3.OperationalError | None = None
        with self._lock:
            for remedy in (None, self._truncate_wal, self._on_disk_full):
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

    # ------------------------------------------------------------------ sessions
    def add_session(self, session_id: str, tenant: str, info: dict[str, Any]) -> None:
        now = time.time()
        self._run(
            "INSERT INTO sessions VALUES (?, ?, ?, ?, NULL, NULL, ?)",
            (session_id, tenant, now, now, _json(info)),
        )

    def get_session(self, session_id: str) -> SessionRow | None:
        row = self._one("SELECT * FROM sessions WHERE session_id=?", (session_id,))
        if row is None:
            return None
        data = dict(row)
        data["info"] = _unjson(data["info"])
        return SessionRow(**data)

    def heartbeat(self, session_id: str) -> None:
        self._run(
            "UPDATE sessions SET last_heartbeat=? WHERE session_id=?", (time.time(), session_id)
        )

    def finish_session(self, session_id: str, reason: str | None) -> None:
        self._run(
            "UPDATE sessions SET finished_at=?, finish_reason=? WHERE session_id=? AND finished_at IS NULL",
            (time.time(), reason, session_id),
        )

    def stale_sessions(self, heartbeat_before: float) -> list[SessionRow]:
        rows = self._all(
            "SELECT session_id FROM sessions WHERE finished_at IS NULL AND last_heartbeat < ?",
            (heartbeat_before,),
        )
        return [s for s in (self.get_session(r["session_id"]) for r in rows) if s is not None]

    # ------------------------------------------------------------------ models
    def add_model(self, row: ModelRow) -> None:
        self._run(
            "INSERT INTO models VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row.model_id,
                row.tenant,
                row.session_id,
                row.base_model,
                row.lora_rank,
                _json(row.lora),
                _json(row.user_metadata),
                row.created_at,
                row.last_request_time,
                row.status,
            ),
        )

    @staticmethod
    def _model(row: sqlite3.Row) -> ModelRow:
        data = dict(row)
        data["lora"] = _unjson(data["lora"])
        data["user_metadata"] = _unjson(data["user_metadata"])
        return ModelRow(**data)

    def get_model(self, model_id: str) -> ModelRow | None:
        row = self._one("SELECT * FROM models WHERE model_id=?", (model_id,))
        return None if row is None else self._model(row)

    def set_model_status(self, model_id: str, status: str) -> None:
        self._run("UPDATE models SET status=? WHERE model_id=?", (status, model_id))

    def touch_model(self, model_id: str) -> None:
        self._run("UPDATE models SET last_request_time=? WHERE model_id=?", (time.time(), model_id))

    def session_models(self, session_id: str) -> list[ModelRow]:
        return [
            self._model(r)
            for r in self._all("SELECT * FROM models WHERE session_id=?", (session_id,))
        ]

    def list_models(self, tenant: str, limit: int, offset: int) -> tuple[list[ModelRow], int]:
        rows = self._all(
            "SELECT * FROM models WHERE tenant=? ORDER BY created_at DESC, model_id LIMIT ? OFFSET ?",
            (tenant, limit, offset),
        )
        total = self._one("SELECT COUNT(*) AS n FROM models WHERE tenant=?", (tenant,))
        return [self._model(r) for r in rows], int(total["n"]) if total else 0

    def mark_active_models(self, status: str) -> int:
        """At start-up: models whose weights lived only in the old process's memory."""
        return self._run("UPDATE models SET status=? WHERE status='active'", (status,))

    # ------------------------------------------------------------------ futures
    def add_future(
        self,
        request_id: str,
        tenant: str,
        scope: str | None,
        seq_id: int | None,
        kind: str,
        fingerprint: str | None,
    ) -> None:
        self._run(
            "INSERT INTO futures VALUES (?, ?, ?, ?, ?, ?, 'pending', NULL, NULL, ?, NULL)",
            (request_id, tenant, scope, seq_id, kind, fingerprint, time.time()),
        )

    @staticmethod
    def _future(row: sqlite3.Row) -> FutureRow:
        return FutureRow(**dict(row))

    def get_future(self, request_id: str) -> FutureRow | None:
        row = self._one("SELECT * FROM futures WHERE request_id=?", (request_id,))
        return None if row is None else self._future(row)

    def find_future(self, scope: str, seq_id: int) -> FutureRow | None:
        row = self._one("SELECT * FROM futures WHERE scope=? AND seq_id=?", (scope, seq_id))
        return None if row is None else self._future(row)

    def finish_future(self, request_id: str, state: str, content_type: str, body: bytes) -> None:
        self._run(
            "UPDATE futures SET state=?, content_type=?, body=?, finished_at=? WHERE request_id=?",
            (state, content_type, body, time.time(), request_id),
        )

    def fail_unfinished_futures(self, content_type: str, body: bytes) -> int:
        return self._run(
            "UPDATE futures SET state='failed', content_type=?, body=?, finished_at=? WHERE state='pending'",
            (content_type, body, time.time()),
        )

    def prune_futures(self, older_than: float) -> int:
        """Results are kept for retries and late polls, not forever."""
        return self._run(
            "DELETE FROM futures WHERE state!='pending' AND finished_at < ?", (older_than,)
        )

    def prune_futures_to_bytes(self, max_bytes: int) -> int:
        """Deletes the oldest finished results until the newest ones' bodies total at most
        `max_bytes` (a few big sample results must not fill the disk within the TTL)."""
        return self._run(
            "DELETE FROM futures WHERE request_id IN (SELECT request_id FROM ("
            "SELECT request_id, SUM(length(body)) OVER ("
            "ORDER BY finished_at DESC, request_id ROWS UNBOUNDED PRECEDING) AS newer "
            "FROM futures WHERE state!='pending') WHERE newer > ?)",
            (max_bytes,),
        )

    def stored_result_bytes(self) -> int:
        row = self._one(
            "SELECT COALESCE(SUM(length(body)), 0) AS n FROM futures WHERE state!='pending'", ()
        )
        return int(row["n"]) if row else 0

    # ------------------------------------------------------------------ checkpoints
    def _stored_dir(self, row: CheckpointRow) -> str:
        where = Path(row.dir)
        try:
            relative = where.relative_to(self.data_dir)
        except ValueError:
            raise StoreError(
                f"checkpoint {row.tinker_path}: dir {where} is not inside the data dir {self.data_dir}"
            ) from None
        return str(relative_dir(relative.as_posix(), row.tinker_path))

    def _absolute_dir(self, stored: str, tinker_path: str) -> str:
        """The stored dir under this data dir; refused if it (through a symlink, say) leads
        outside it."""
        where = self.data_dir / relative_dir(stored, tinker_path)
        real = os.path.realpath(where)
        if os.path.commonpath([real, self._real_root]) != self._real_root:
            raise StoreError(
                f"checkpoint {tinker_path}: stored dir {stored!r} resolves to {real}, outside the data dir"
            )
        return str(where)

    def put_checkpoint(self, row: CheckpointRow) -> None:
        self._run(
            "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row.tinker_path,
                row.tenant,
                row.model_id,
                row.kind,
                row.name,
                self._stored_dir(row),
                row.created_at,
                row.size_bytes,
                _json(row.user_metadata),
                row.expires_at,
                _json(row.info),
            ),
        )

    def _checkpoint(self, row: sqlite3.Row) -> CheckpointRow:
        data = dict(row)
        data["dir"] = self._absolute_dir(data["dir"], data["tinker_path"])
        data["user_metadata"] = _unjson(data["user_metadata"])
        data["info"] = _unjson(data["info"])
        return CheckpointRow(**data)

    def get_checkpoint(self, tinker_path: str) -> CheckpointRow | None:
        """Expired rows too: the caller tells the client it expired rather than that it never was."""
        row = self._one("SELECT * FROM checkpoints WHERE tinker_path=?", (tinker_path,))
        return None if row is None else self._checkpoint(row)

    def list_checkpoints(
        self, tenant: str, model_id: str | None = None, limit: int = 1000, offset: int = 0
    ) -> tuple[list[CheckpointRow], int]:
        """Expired ones too, until maintenance deletes them: the listing shows their past
        `expires_at` (every load of one is refused), so the client sees why it is going.
        One run's checkpoints come oldest first (the order they were saved in); all of a
        tenant's (`list_user_checkpoints`) newest first, as SDK 0.38 documents, so its first
        page (and `tinker checkpoint list --limit N`) shows the latest ones."""
        where, args = "tenant=?", [tenant]
        order = "created_at, tinker_path"
        if model_id is not None:
            where += " AND model_id=?"
            args.append(model_id)
        else:
            order = "created_at DESC, tinker_path DESC"
        rows = self._all(
            f"SELECT * FROM checkpoints WHERE {where} ORDER BY {order} LIMIT ? OFFSET ?",
            (*args, limit, offset),
        )
        total = self._one(f"SELECT COUNT(*) AS n FROM checkpoints WHERE {where}", tuple(args))
        return [self._checkpoint(r) for r in rows], int(total["n"]) if total else 0

    def all_checkpoints(self) -> list[CheckpointRow]:
        """Every row, expired ones too: what start-up recovery must not delete."""
        return [
            self._checkpoint(r)
            for r in self._all("SELECT * FROM checkpoints ORDER BY tinker_path", ())
        ]

    def expired_checkpoints(self, now: float, limit: int) -> list[CheckpointRow]:
        """The oldest-expired first, at most `limit` (maintenance deletes them in bounded rounds)."""
        rows = self._all(
            "SELECT * FROM checkpoints WHERE expires_at IS NOT NULL AND expires_at <= ? "
            "ORDER BY expires_at, tinker_path LIMIT ?",
            (now, limit),
        )
        return [self._checkpoint(r) for r in rows]

    def last_checkpoint(self, model_id: str, kind: str) -> CheckpointRow | None:
        row = self._one(
            "SELECT * FROM checkpoints WHERE model_id=? AND kind=? "
            "AND (expires_at IS NULL OR expires_at > ?) ORDER BY created_at DESC LIMIT 1",
            (model_id, kind, time.time()),
        )
        return None if row is None else self._checkpoint(row)

    def delete_checkpoint(self, tinker_path: str) -> None:
        self._run("DELETE FROM checkpoints WHERE tinker_path=?", (tinker_path,))

    # ------------------------------------------------------------------ sampling sessions
    def add_sampling_session(self, row: SamplingSessionRow) -> None:
        self._run(
            "INSERT INTO sampling_sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row.sampling_session_id,
                row.tenant,
                row.session_id,
                row.base_model,
                row.model_path,
                row.adapter_id,
                row.adapter_version,
                row.created_at,
            ),
        )

    def get_sampling_session(self, sampling_session_id: str) -> SamplingSessionRow | None:
        row = self._one(
            "SELECT * FROM sampling_sessions WHERE sampling_session_id=?", (sampling_session_id,)
        )
        return None if row is None else SamplingSessionRow(**dict(row))

    # ------------------------------------------------------------------ REST: publication, projects, session listing
    # Published flags and projects live in the `info` JSON of checkpoints and sessions (no schema
    # change); a model's project is its session's. Expired checkpoints count as gone here too.
    _LIVE = "(c.expires_at IS NULL OR c.expires_at > ?)"
    _PUBLIC = "json_extract(c.info, '$.public') = 1"
    _IN_PROJECT = (
        "EXISTS (SELECT 1 FROM sessions s WHERE s.session_id = m.session_id "
        "AND json_extract(s.info, '$.project_id') = ?)"
    )

    @staticmethod
    def _session(row: sqlite3.Row) -> SessionRow:
        data = dict(row)
        data["info"] = _unjson(data["info"])
        return SessionRow(**data)

    def has_public_checkpoint(self, model_id: str) -> bool:
        row = self._one(
            f"SELECT 1 FROM checkpoints c WHERE c.model_id=? AND {self._PUBLIC} AND {self._LIVE} LIMIT 1",
            (model_id, time.time()),
        )
        return row is not None

    def list_public_checkpoints(
        self, model_id: str, limit: int, offset: int
    ) -> tuple[list[CheckpointRow], int]:
        where = f"c.model_id=? AND {self._PUBLIC} AND {self._LIVE}"
        args = (model_id, time.time())
        rows = self._all(
            f"SELECT * FROM checkpoints c WHERE {where} ORDER BY c.created_at, c.tinker_path LIMIT ? OFFSET ?",
            (*args, limit, offset),
        )
        total = self._one(f"SELECT COUNT(*) AS n FROM checkpoints c WHERE {where}", args)
        return [self._checkpoint(r) for r in rows], int(total["n"]) if total else 0

    def list_runs(
        self,
        tenant: str,
        limit: int,
        offset: int,
        *,
        accessible: bool = False,
        project_id: str | None = None,
    ) -> tuple[list[ModelRow], int]:
        """The tenant's runs; `accessible` adds other tenants' runs with a published
        checkpoint; `project_id` keeps those whose session is in that project."""
        where = "m.tenant=?"
        args: list[Any] = [tenant]
        if accessible:
            where = (
                f"({where} OR EXISTS (SELECT 1 FROM checkpoints c WHERE c.model_id = m.model_id "
                f"AND {self._PUBLIC} AND {self._LIVE}))"
            )
            args.append(time.time())
        if project_id is not None:
            where += f" AND {self._IN_PROJECT}"
            args.append(project_id)
        rows = self._all(
            f"SELECT * FROM models m WHERE {where} ORDER BY m.created_at DESC, m.model_id LIMIT ? OFFSET ?",
            (*args, limit, offset),
        )
        total = self._one(f"SELECT COUNT(*) AS n FROM models m WHERE {where}", tuple(args))
        return [self._model(r) for r in rows], int(total["n"]) if total else 0

    def list_sessions(self, tenant: str, limit: int, offset: int) -> tuple[list[SessionRow], int]:
        """Newest first."""
        rows = self._all(
            "SELECT * FROM sessions WHERE tenant=? ORDER BY created_at DESC, session_id DESC "
            "LIMIT ? OFFSET ?",
            (tenant, limit, offset),
        )
        total = self._one("SELECT COUNT(*) AS n FROM sessions WHERE tenant=?", (tenant,))
        return [self._session(r) for r in rows], int(total["n"]) if total else 0

    def sessions_before(
        self, tenant: str, before: tuple[float, str] | None, batch: int
    ) -> list[SessionRow]:
        """One batch of the tenant's sessions, newest first, strictly after the cursor
        `(created_at, session_id)` in that order."""
        if before is None:
            rows = self._all(
                "SELECT * FROM sessions WHERE tenant=? ORDER BY created_at DESC, session_id DESC LIMIT ?",
                (tenant, batch),
            )
        else:
            rows = self._all(
                "SELECT * FROM sessions WHERE tenant=? AND (created_at < ? OR "
                "(created_at = ? AND session_id < ?)) ORDER BY created_at DESC, session_id DESC LIMIT ?",
                (tenant, before[0], before[0], before[1], batch),
            )
        return [self._session(r) for r in rows]

    def set_session_info(self, session_id: str, info: dict[str, Any]) -> None:
        self._run("UPDATE sessions SET info=? WHERE session_id=?", (_json(info), session_id))

    def session_sampler_ids(self, session_id: str) -> list[str]:
        rows = self._all(
            "SELECT sampling_session_id FROM sampling_sessions WHERE session_id=? "
            "ORDER BY created_at, sampling_session_id",
            (session_id,),
        )
        return [r["sampling_session_id"] for r in rows]

    def session_checkpoint_usage(self, session_id: str) -> tuple[int, int]:
        """(count, bytes) of the live checkpoints of the session's runs."""
        row = self._one(
            "SELECT COUNT(*) AS n, COALESCE(SUM(c.size_bytes), 0) AS b FROM checkpoints c "
            f"JOIN models m ON m.model_id = c.model_id WHERE m.session_id=? AND {self._LIVE}",
            (session_id, time.time()),
        )
        return (int(row["n"]), int(row["b"])) if row else (0, 0)

    def checkpoint_usage(
        self, tenant: str, project_id: str | None
    ) -> list[tuple[str | None, int, int]]:
        """(project_id, count, bytes) of the tenant's live checkpoints, per project."""
        where = f"c.tenant=? AND {self._LIVE}"
        args: list[Any] = [tenant, time.time()]
        if project_id is not None:
            where += " AND json_extract(s.info, '$.project_id') = ?"
            args.append(project_id)
        rows = self._all(
            "SELECT json_extract(s.info, '$.project_id') AS project, COUNT(*) AS n, "
            "COALESCE(SUM(c.size_bytes), 0) AS b FROM checkpoints c "
            "LEFT JOIN models m ON m.model_id = c.model_id "
            "LEFT JOIN sessions s ON s.session_id = m.session_id "
            f"WHERE {where} GROUP BY project ORDER BY project",
            tuple(args),
        )
        return [(r["project"], int(r["n"]), int(r["b"])) for r in rows]

    def find_copy(self, tenant: str, idempotency_key: str) -> CheckpointRow | None:
        """The copy an earlier attempt of the same copy_weights call made, if any."""
        row = self._one(
            "SELECT * FROM checkpoints c WHERE c.tenant=? "
            "AND json_extract(c.info, '$.copy_key') = ?",
            (tenant, idempotency_key),
        )
        return None if row is None else self._checkpoint(row)

    def scope_futures(self, scopes: list[str], limit: int) -> list[FutureRow]:
        """The retained futures of the given scopes (models, sampling sessions), oldest first."""
        if not scopes:
            return []
        marks = ", ".join("?" for _ in scopes)
        rows = self._all(
            f"SELECT * FROM futures WHERE scope IN ({marks}) ORDER BY created_at, request_id LIMIT ?",
            (*scopes, limit),
        )
        return [self._future(r) for r in rows]

    def set_checkpoint_info(self, tinker_path: str, info: dict[str, Any]) -> bool:
        """Updates only `info` (a row deleted meanwhile stays deleted); False if there is none."""
        return (
            self._run(
                "UPDATE checkpoints SET info=? WHERE tinker_path=?", (_json(info), tinker_path)
            )
            > 0
        )

    def last_public_checkpoint(self, model_id: str, kind: str) -> CheckpointRow | None:
        row = self._one(
            f"SELECT * FROM checkpoints c WHERE c.model_id=? AND c.kind=? AND {self._PUBLIC} "
            f"AND {self._LIVE} ORDER BY c.created_at DESC LIMIT 1",
            (model_id, kind, time.time()),
        )
        return None if row is None else self._checkpoint(row)

    # ------------------------------------------------------------------ model aliases (OpenAI routes)
    def put_alias(self, tenant: str, alias: str, target: str, at: float, max_aliases: int) -> bool:
        """Creates or repoints an alias; False (nothing written) when the tenant already has
        `max_aliases` others. One statement, so concurrent puts cannot pass the bound."""
        return (
            self._run(
                "INSERT OR REPLACE INTO aliases SELECT ?, ?, ?, ? WHERE "
                "(SELECT COUNT(*) FROM aliases WHERE tenant=? AND alias<>?) < ?",
                (tenant, alias, target, at, tenant, alias, max_aliases),
            )
            > 0
        )

    def get_alias(self, tenant: str, alias: str) -> tuple[str, float] | None:
        """(target, created_at)."""
        row = self._one(
            "SELECT target, created_at FROM aliases WHERE tenant=? AND alias=?", (tenant, alias)
        )
        return None if row is None else (str(row["target"]), float(row["created_at"]))

    def list_aliases(self, tenant: str, limit: int) -> list[tuple[str, str, float]]:
        """(alias, target, created_at), newest first."""
        rows = self._all(
            "SELECT alias, target, created_at FROM aliases WHERE tenant=? "
            "ORDER BY created_at DESC, alias LIMIT ?",
            (tenant, limit),
        )
        return [(str(r["alias"]), str(r["target"]), float(r["created_at"])) for r in rows]

    def delete_alias(self, tenant: str, alias: str) -> bool:
        return self._run("DELETE FROM aliases WHERE tenant=? AND alias=?", (tenant, alias)) > 0

    def list_sampler_paths(self, tenant: str, limit: int) -> list[tuple[str, float]]:
        """(tinker_path, created_at) of the tenant's unexpired sampler checkpoints, newest first."""
        rows = self._all(
            "SELECT tinker_path, created_at FROM checkpoints WHERE tenant=? AND kind='sampler' "
            "AND (expires_at IS NULL OR expires_at > ?) "
            "ORDER BY created_at DESC, tinker_path DESC LIMIT ?",
            (tenant, time.time(), limit),
        )
        return [(str(r["tinker_path"]), float(r["created_at"])) for r in rows]

    # ------------------------------------------------------------------ metering and quotas
    def add_usage(self, rows: list[tuple[str, str, str, str, float]]) -> None:
        """Adds (tenant, run, day, counter, amount) to the stored totals, all in one
        transaction (metering flushes its counts in batches, not per request)."""
        if not rows:
            return

        def add(_db: sqlite3.Connection) -> None:
            with self._tx() as db:
                db.executemany(
                    "INSERT INTO usage VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, run, "
                    "day, counter) DO UPDATE SET value = value + excluded.value",
                    rows,
                )

        self._write(add)

    def usage_rows(
        self, tenant: str | None, since_day: str | None = None
    ) -> list[tuple[str, str, str, str, float]]:
        """(tenant, run, day, counter, value), a tenant's (None: everyone's), from `since_day`."""
        where, args = "1=1", []
        if tenant is not None:
            where += " AND tenant=?"
            args.append(tenant)
        if since_day is not None:
            where += " AND day>=?"
            args.append(since_day)
        rows = self._all(
            f"SELECT tenant, run, day, counter, value FROM usage WHERE {where} "
            "ORDER BY tenant, day, run, counter",
            tuple(args),
        )
        return [(r[0], r[1], r[2], r[3], float(r[4])) for r in rows]

    def usage_totals(self, tenant: str | None) -> list[tuple[str, str, str, float]]:
        """(tenant, run, counter, value) over all days."""
        where, args = ("tenant=?", (tenant,)) if tenant is not None else ("1=1", ())
        rows = self._all(
            f"SELECT tenant, run, counter, SUM(value) FROM usage WHERE {where} "
            "GROUP BY tenant, run, counter ORDER BY tenant, run, counter",
            args,
        )
        return [(r[0], r[1], r[2], float(r[3])) for r in rows]

    def day_usage(self, day: str) -> list[tuple[str, str, float]]:
        """(tenant, counter, value) of one day, summed over runs (the per-day quotas)."""
        rows = self._all(
            "SELECT tenant, counter, SUM(value) FROM usage WHERE day=? GROUP BY tenant, counter",
            (day,),
        )
        return [(r[0], r[1], float(r[2])) for r in rows]

    def registered_runs(self, tenant: str) -> int:
        """The tenant's runs that hold or may page back into a slot: not unloaded, lost (a
        restart), or the idle run a copy_weights made."""
        row = self._one(
            "SELECT COUNT(*) AS n FROM models WHERE tenant=? "
            "AND status NOT IN ('unloaded', 'lost', 'copy')",
            (tenant,),
        )
        return int(row["n"]) if row else 0

    def storage_bytes(self, tenant: str | None = None) -> list[tuple[str, str, int]]:
        """(tenant, run, bytes) of stored checkpoints, expired ones not yet deleted included
        (they are on disk until maintenance deletes them)."""
        where, args = ("tenant=?", (tenant,)) if tenant is not None else ("1=1", ())
        rows = self._all(
            f"SELECT tenant, model_id, COALESCE(SUM(size_bytes), 0) FROM checkpoints WHERE {where} "
            "GROUP BY tenant, model_id ORDER BY tenant, model_id",
            args,
        )
        return [(r[0], r[1], int(r[2])) for r in rows]

    def checkpoint_size_estimate(self, model_id: str, kinds: tuple[str, ...], rank: int) -> int:
        """What the next save of these kinds will likely take: the run's largest such
        checkpoint, else the largest of any run of the same rank (sizes follow the LoRA shape),
        else 0."""
        marks = ", ".join("?" for _ in kinds)
        row = self._one(
            f"SELECT MAX(size_bytes) AS b FROM checkpoints WHERE model_id=? AND kind IN ({marks})",
            (model_id, *kinds),
        )
        if row is not None and row["b"] is not None:
            return int(row["b"])
        row = self._one(
            f"SELECT MAX(c.size_bytes) AS b FROM checkpoints c JOIN models m "
            f"ON m.model_id = c.model_id WHERE c.kind IN ({marks}) AND m.lora_rank=?",
            (*kinds, rank),
        )
        return int(row["b"]) if row is not None and row["b"] is not None else 0

    # ------------------------------------------------------------------ run metrics (console)
    def add_run_metrics(self, rows: list[tuple[str, str, str, int, float, str, float]]) -> None:
        """(tenant, run, name, step, value, source, at) rows; a point posted again for the same
        step replaces the earlier one (a client retrying its post)."""
        if not rows:
            return

        def add(db: sqlite3.Connection) -> None:
            db.executemany("INSERT OR REPLACE INTO run_metrics VALUES (?, ?, ?, ?, ?, ?, ?)", rows)

        self._write(add)

    def run_metrics(
        self, tenant: str, run: str, after_step: int = -1, limit: int = 10000
    ) -> list[tuple[str, str, int, float, float]]:
        """(name, source, step, value, at) of one run, by name, source and step."""
        rows = self._all(
            "SELECT name, source, step, value, at FROM run_metrics WHERE tenant=? AND run=? "
            "AND step>? ORDER BY name, source, step LIMIT ?",
            (tenant, run, after_step, limit),
        )
        return [(r[0], r[1], int(r[2]), float(r[3]), float(r[4])) for r in rows]

    def run_metric_curves(
        self, tenant: str, run: str, after_step: int, per_curve: int
    ) -> list[tuple[str, str, int, float, float]]:
        """Like `run_metrics`, but at most `per_curve` points of each (name, source) past
        `after_step`: every `k`-th step counted back from the name's newest, `k` spread over its
        steps. Every curve shows however many points another has (one LIMIT over them all
        dropped whole curves), and the cost follows the index: the names one lookup each
        (a run has at most a few dozen), their step ranges from the index's ends."""
        out: list[tuple[str, str, int, float, float]] = []
        name = ""
        while True:
            found = self._one(
                "SELECT name FROM run_metrics WHERE tenant=? AND run=? AND name>? "
                "ORDER BY name LIMIT 1",
                (tenant, run, name),
            )
            if found is None:
                return out
            name = str(found["name"])
            where = "FROM run_metrics WHERE tenant=? AND run=? AND name=? AND step>?"
            args = (tenant, run, name, after_step)
            low = self._one(f"SELECT MIN(step) AS s {where}", args)
            high = self._one(f"SELECT MAX(step) AS s {where}", args)
            if low is None or high is None or low["s"] is None:
                continue
            stride = max(1, -(-(int(high["s"]) - int(low["s"]) + 1) // per_curve))
            rows = self._all(
                f"SELECT source, step, value, at {where} AND (? - step) % ? = 0 "
                "ORDER BY source, step",
                (*args, int(high["s"]), stride),
            )
            out.extend((name, r[0], int(r[1]), float(r[2]), float(r[3])) for r in rows)

    def run_metric_stats(self, tenant: str, run: str) -> tuple[set[str], int, int]:
        """The names a run has points under, its number of points and its highest step (-1
        when none): what bounds a client's posts."""
        names = {
            r[0]
            for r in self._all(
                "SELECT DISTINCT name FROM run_metrics WHERE tenant=? AND run=?", (tenant, run)
            )
        }
        row = self._one(
            "SELECT COUNT(*) AS n, COALESCE(MAX(step), -1) AS s FROM run_metrics "
            "WHERE tenant=? AND run=?",
            (tenant, run),
        )
        return names, int(row["n"]) if row else 0, int(row["s"]) if row else -1

    def max_metric_step(self, tenant: str, run: str, name: str, source: str) -> int:
        row = self._one(
            "SELECT COALESCE(MAX(step), -1) AS s FROM run_metrics "
            "WHERE tenant=? AND run=? AND name=? AND source=?",
            (tenant, run, name, source),
        )
        return int(row["s"]) if row else -1
