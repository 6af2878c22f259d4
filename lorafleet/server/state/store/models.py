"""The `models` table: one row per training run (a LoRA adapter on a base model), with its
config and whether its weights are live. `page` also reads `checkpoints` and `sessions` (a
run's published checkpoints, its session's project) because it returns runs."""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from typing import Any

from lorafleet.server.state.store.checkpoints import LIVE, PUBLIC
from lorafleet.server.state.store.database import Database, from_json, to_json

_IN_PROJECT = (
    "EXISTS (SELECT 1 FROM sessions s WHERE s.session_id = m.session_id "
    "AND json_extract(s.info, '$.project_id') = ?)"
)
"""A model's project is its session's (kept in the session's `info`, no schema change)."""


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
    status: str  # "active" | "unloaded" | "lost" | "copy" (made by copy_weights, never trained)


def _model(row: sqlite3.Row) -> ModelRow:
    data = dict(row)
    data["lora"] = from_json(data["lora"])
    data["user_metadata"] = from_json(data["user_metadata"])
    return ModelRow(**data)


class ModelsTable:
    def __init__(self, db: Database):
        self._db = db

    def add(self, row: ModelRow) -> None:
        self._db.run(
            "INSERT INTO models VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row.model_id,
                row.tenant,
                row.session_id,
                row.base_model,
                row.lora_rank,
                to_json(row.lora),
                to_json(row.user_metadata),
                row.created_at,
                row.last_request_time,
                row.status,
            ),
        )

    def get(self, model_id: str) -> ModelRow | None:
        row = self._db.one("SELECT * FROM models WHERE model_id=?", (model_id,))
        return None if row is None else _model(row)

    def set_status(self, model_id: str, status: str) -> None:
        self._db.run("UPDATE models SET status=? WHERE model_id=?", (status, model_id))

    def touch(self, model_id: str) -> None:
        """Records a request now (`last_request_time`)."""
        self._db.run(
            "UPDATE models SET last_request_time=? WHERE model_id=?", (time.time(), model_id)
        )

    def of_session(self, session_id: str) -> list[ModelRow]:
        return [
            _model(r)
            for r in self._db.all("SELECT * FROM models WHERE session_id=?", (session_id,))
        ]

    def mark_active_as(self, status: str) -> int:
        """At start-up: models whose weights lived only in the old process's memory."""
        return self._db.run("UPDATE models SET status=? WHERE status='active'", (status,))

    def count_registered(self, tenant: str) -> int:
        """The tenant's runs that hold or may page back into a slot: not unloaded, lost (a
        restart), or the idle run a copy_weights made."""
        row = self._db.one(
            "SELECT COUNT(*) AS n FROM models WHERE tenant=? "
            "AND status NOT IN ('unloaded', 'lost', 'copy')",
            (tenant,),
        )
        return int(row["n"]) if row else 0

    def page(
        self,
        tenant: str,
        limit: int,
        offset: int,
        *,
        accessible: bool = False,
        project_id: str | None = None,
    ) -> tuple[list[ModelRow], int]:
        """A page of the tenant's runs, newest first, and how many there are in all;
        `accessible` adds other tenants' runs with a published checkpoint; `project_id` keeps
        those whose session is in that project."""
        where = "m.tenant=?"
        args: list[Any] = [tenant]
        if accessible:
            where = (
                f"({where} OR EXISTS (SELECT 1 FROM checkpoints c WHERE c.model_id = m.model_id "
                f"AND {PUBLIC} AND {LIVE}))"
            )
            args.append(time.time())
        if project_id is not None:
            where += f" AND {_IN_PROJECT}"
            args.append(project_id)
        rows = self._db.all(
            f"SELECT * FROM models m WHERE {where} ORDER BY m.created_at DESC, m.model_id LIMIT ? OFFSET ?",
            (*args, limit, offset),
        )
        total = self._db.one(f"SELECT COUNT(*) AS n FROM models m WHERE {where}", tuple(args))
        return [_model(r) for r in rows], int(total["n"]) if total else 0
