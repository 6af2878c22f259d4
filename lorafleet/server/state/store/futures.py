"""The `futures` table: every request's future, its result once finished (kept for retries
and late polls), and its `(scope, seq_id)` that makes a retried request find the first one."""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass

from lorafleet.server.state.store.database import Database


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


def _future(row: sqlite3.Row) -> FutureRow:
    return FutureRow(**dict(row))


class FuturesTable:
    def __init__(self, db: Database):
        self._db = db

    def add(
        self,
        request_id: str,
        tenant: str,
        scope: str | None,
        seq_id: int | None,
        kind: str,
        fingerprint: str | None,
    ) -> None:
        """A pending future."""
        self._db.run(
            "INSERT INTO futures VALUES (?, ?, ?, ?, ?, ?, 'pending', NULL, NULL, ?, NULL)",
            (request_id, tenant, scope, seq_id, kind, fingerprint, time.time()),
        )

    def get(self, request_id: str) -> FutureRow | None:
        row = self._db.one("SELECT * FROM futures WHERE request_id=?", (request_id,))
        return None if row is None else _future(row)

    def find(self, scope: str, seq_id: int) -> FutureRow | None:
        """The future a request with this `seq_id` in this scope (a model, a sampling session)
        already made."""
        row = self._db.one("SELECT * FROM futures WHERE scope=? AND seq_id=?", (scope, seq_id))
        return None if row is None else _future(row)

    def of_scopes(self, scopes: list[str], limit: int) -> list[FutureRow]:
        """The retained futures of the given scopes (models, sampling sessions), oldest first."""
        if not scopes:
            return []
        marks = ", ".join("?" for _ in scopes)
        rows = self._db.all(
            f"SELECT * FROM futures WHERE scope IN ({marks}) ORDER BY created_at, request_id LIMIT ?",
            (*scopes, limit),
        )
        return [_future(r) for r in rows]

    def finish(self, request_id: str, state: str, content_type: str, body: bytes) -> None:
        self._db.run(
            "UPDATE futures SET state=?, content_type=?, body=?, finished_at=? WHERE request_id=?",
            (state, content_type, body, time.time(), request_id),
        )

    def fail_pending(self, content_type: str, body: bytes) -> int:
        """At start-up: every future the old process left pending fails with this result."""
        return self._db.run(
            "UPDATE futures SET state='failed', content_type=?, body=?, finished_at=? WHERE state='pending'",
            (content_type, body, time.time()),
        )

    def prune(self, older_than: float) -> int:
        """Results are kept for retries and late polls, not forever."""
        return self._db.run(
            "DELETE FROM futures WHERE state!='pending' AND finished_at < ?", (older_than,)
        )

    def prune_to_bytes(self, max_bytes: int) -> int:
        """Deletes the oldest finished results until the newest ones' bodies total at most
        `max_bytes` (a few big sample results must not fill the disk within the TTL)."""
        return self._db.run(
            "DELETE FROM futures WHERE request_id IN (SELECT request_id FROM ("
            "SELECT request_id, SUM(length(body)) OVER ("
            "ORDER BY finished_at DESC, request_id ROWS UNBOUNDED PRECEDING) AS newer "
            "FROM futures WHERE state!='pending') WHERE newer > ?)",
            (max_bytes,),
        )

    def result_bytes(self) -> int:
        """The bodies of the finished results kept."""
        row = self._db.one(
            "SELECT COALESCE(SUM(length(body)), 0) AS n FROM futures WHERE state!='pending'", ()
        )
        return int(row["n"]) if row else 0
