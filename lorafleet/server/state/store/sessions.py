"""The `sessions` table: a client's training session, its heartbeat and its `info` JSON (the
SDK's tags and metadata, and its project)."""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from typing import Any

from lorafleet.server.state.store.database import Database, from_json, to_json


@dataclass
class SessionRow:
    session_id: str
    tenant: str
    created_at: float
    last_heartbeat: float
    finished_at: float | None
    finish_reason: str | None
    info: dict[str, Any]


def _session(row: sqlite3.Row) -> SessionRow:
    data = dict(row)
    data["info"] = from_json(data["info"])
    return SessionRow(**data)


class SessionsTable:
    def __init__(self, db: Database):
        self._db = db

    def add(self, session_id: str, tenant: str, info: dict[str, Any]) -> None:
        now = time.time()
        self._db.run(
            "INSERT INTO sessions VALUES (?, ?, ?, ?, NULL, NULL, ?)",
            (session_id, tenant, now, now, to_json(info)),
        )

    def get(self, session_id: str) -> SessionRow | None:
        row = self._db.one("SELECT * FROM sessions WHERE session_id=?", (session_id,))
        return None if row is None else _session(row)

    def heartbeat(self, session_id: str) -> None:
        self._db.run(
            "UPDATE sessions SET last_heartbeat=? WHERE session_id=?", (time.time(), session_id)
        )

    def finish(self, session_id: str, reason: str | None) -> None:
        """Only the first finish counts (its time and reason stay)."""
        self._db.run(
            "UPDATE sessions SET finished_at=?, finish_reason=? WHERE session_id=? AND finished_at IS NULL",
            (time.time(), reason, session_id),
        )

    def stale(self, heartbeat_before: float) -> list[SessionRow]:
        """Unfinished sessions whose last heartbeat is older than `heartbeat_before`."""
        rows = self._db.all(
            "SELECT session_id FROM sessions WHERE finished_at IS NULL AND last_heartbeat < ?",
            (heartbeat_before,),
        )
        return [s for s in (self.get(r["session_id"]) for r in rows) if s is not None]

    def set_info(self, session_id: str, info: dict[str, Any]) -> None:
        self._db.run("UPDATE sessions SET info=? WHERE session_id=?", (to_json(info), session_id))

    def page(self, tenant: str, limit: int, offset: int) -> tuple[list[SessionRow], int]:
        """A page of the tenant's sessions, newest first, and how many it has in all."""
        rows = self._db.all(
            "SELECT * FROM sessions WHERE tenant=? ORDER BY created_at DESC, session_id DESC "
            "LIMIT ? OFFSET ?",
            (tenant, limit, offset),
        )
        total = self._db.one("SELECT COUNT(*) AS n FROM sessions WHERE tenant=?", (tenant,))
        return [_session(r) for r in rows], int(total["n"]) if total else 0

    def before(self, tenant: str, cursor: tuple[float, str] | None, batch: int) -> list[SessionRow]:
        """One batch of the tenant's sessions, newest first, strictly after the cursor
        `(created_at, session_id)` in that order (None: from the newest)."""
        if cursor is None:
            rows = self._db.all(
                "SELECT * FROM sessions WHERE tenant=? ORDER BY created_at DESC, session_id DESC LIMIT ?",
                (tenant, batch),
            )
        else:
            rows = self._db.all(
                "SELECT * FROM sessions WHERE tenant=? AND (created_at < ? OR "
                "(created_at = ? AND session_id < ?)) ORDER BY created_at DESC, session_id DESC LIMIT ?",
                (tenant, cursor[0], cursor[0], cursor[1], batch),
            )
        return [_session(r) for r in rows]
