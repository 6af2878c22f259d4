"""The `sampling_sessions` table: a sampling client's base model or adapter version, fixed at
creation (a later save under the same path does not change what it samples)."""

from __future__ import annotations

from dataclasses import dataclass

from lorafleet.server.state.store.database import Database


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


class SamplingSessionsTable:
    def __init__(self, db: Database):
        self._db = db

    def add(self, row: SamplingSessionRow) -> None:
        self._db.run(
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

    def get(self, sampling_session_id: str) -> SamplingSessionRow | None:
        row = self._db.one(
            "SELECT * FROM sampling_sessions WHERE sampling_session_id=?", (sampling_session_id,)
        )
        return None if row is None else SamplingSessionRow(**dict(row))

    def ids_of_session(self, session_id: str) -> list[str]:
        """The ids of the session's sampling sessions, oldest first."""
        rows = self._db.all(
            "SELECT sampling_session_id FROM sampling_sessions WHERE session_id=? "
            "ORDER BY created_at, sampling_session_id",
            (session_id,),
        )
        return [r["sampling_session_id"] for r in rows]
