"""SQLite persistence for what must outlive the process: sessions, models, futures, checkpoints,
sampling sessions.

Adapter weights live in files (see paths.py); this database only says who owns what and where it
is. One connection behind a lock (the HTTP thread and the engine worker both write; every
statement is short), WAL so that readers never wait for the writer, `synchronous=NORMAL`
because WAL keeps the database consistent across a crash and losing the last few milliseconds
of commits costs at most a retried request.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

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
"""


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True)


def _unjson(text: str | None) -> Any:
    return None if text is None else json.loads(text)


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
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                self._db.execute(
                    "INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
                )
            elif int(row["value"]) != SCHEMA_VERSION:
                raise RuntimeError(
                    f"{self.path}: schema version {row['value']}, this server speaks {SCHEMA_VERSION}"
                )

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
        with self._lock:
            return self._db.execute(sql, args).rowcount

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

    # ------------------------------------------------------------------ checkpoints
    def put_checkpoint(self, row: CheckpointRow) -> None:
        self._run(
            "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row.tinker_path,
                row.tenant,
                row.model_id,
                row.kind,
                row.name,
                row.dir,
                row.created_at,
                row.size_bytes,
                _json(row.user_metadata),
                row.expires_at,
                _json(row.info),
            ),
        )

    @staticmethod
    def _checkpoint(row: sqlite3.Row) -> CheckpointRow:
        data = dict(row)
        data["user_metadata"] = _unjson(data["user_metadata"])
        data["info"] = _unjson(data["info"])
        return CheckpointRow(**data)

    def get_checkpoint(self, tinker_path: str) -> CheckpointRow | None:
        row = self._one("SELECT * FROM checkpoints WHERE tinker_path=?", (tinker_path,))
        return None if row is None else self._checkpoint(row)

    def list_checkpoints(
        self, tenant: str, model_id: str | None = None, limit: int = 1000, offset: int = 0
    ) -> tuple[list[CheckpointRow], int]:
        where, args = "tenant=?", [tenant]
        if model_id is not None:
            where += " AND model_id=?"
            args.append(model_id)
        rows = self._all(
            f"SELECT * FROM checkpoints WHERE {where} ORDER BY created_at, tinker_path LIMIT ? OFFSET ?",
            (*args, limit, offset),
        )
        total = self._one(f"SELECT COUNT(*) AS n FROM checkpoints WHERE {where}", tuple(args))
        return [self._checkpoint(r) for r in rows], int(total["n"]) if total else 0

    def all_checkpoint_dirs(self) -> list[str]:
        return [r["dir"] for r in self._all("SELECT dir FROM checkpoints", ())]

    def last_checkpoint(self, model_id: str, kind: str) -> CheckpointRow | None:
        row = self._one(
            "SELECT * FROM checkpoints WHERE model_id=? AND kind=? ORDER BY created_at DESC LIMIT 1",
            (model_id, kind),
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
