"""The `checkpoints` table: saved weights (training states and sampler adapters), where their
files are, their TTL and `info` (base model, LoRA config, the published flag, a copy's key).

`dir` is absolute in memory and stored relative to the data dir: converted here on the way in
and out, and a stored path that would lead outside the data dir is refused when read.

The gauges over checkpoints (sizes per run, per session, per project; the next save's likely
size) live here too, though some join `models` and `sessions`: they count checkpoints. An
expired checkpoint is gone for clients (the `LIVE` filter) but still on disk until maintenance
deletes it, so the storage gauges count it.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.server.state.store.database import (
    Database,
    StoreError,
    from_json,
    relative_dir,
    to_json,
)

LIVE = "(c.expires_at IS NULL OR c.expires_at > ?)"
"""SQL over `checkpoints c`: not expired at the time bound to its `?`."""
PUBLIC = "json_extract(c.info, '$.public') = 1"
"""SQL over `checkpoints c`: published (a flag in `info`, no schema change)."""


@dataclass
class CheckpointRow:
    tinker_path: str
    tenant: str
    model_id: str
    kind: str  # "training" | "sampler" | "external" (save_weights_external)
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


class CheckpointsTable:
    def __init__(self, db: Database):
        self._db = db

    def _stored_dir(self, row: CheckpointRow) -> str:
        where = Path(row.dir)
        try:
            relative = where.relative_to(self._db.data_dir)
        except ValueError:
            raise StoreError(
                f"checkpoint {row.tinker_path}: dir {where} is not inside the data dir {self._db.data_dir}"
            ) from None
        return str(relative_dir(relative.as_posix(), row.tinker_path))

    def _absolute_dir(self, stored: str, tinker_path: str) -> str:
        """The stored dir under this data dir; refused if it (through a symlink, say) leads
        outside it."""
        where = self._db.data_dir / relative_dir(stored, tinker_path)
        real = os.path.realpath(where)
        if os.path.commonpath([real, self._db.real_root]) != self._db.real_root:
            raise StoreError(
                f"checkpoint {tinker_path}: stored dir {stored!r} resolves to {real}, outside the data dir"
            )
        return str(where)

    def _checkpoint(self, row: sqlite3.Row) -> CheckpointRow:
        data = dict(row)
        data["dir"] = self._absolute_dir(data["dir"], data["tinker_path"])
        data["user_metadata"] = from_json(data["user_metadata"])
        data["info"] = from_json(data["info"])
        return CheckpointRow(**data)

    # ------------------------------------------------------------------ rows
    def put(self, row: CheckpointRow) -> None:
        """Inserts or replaces (an overwrite keeps the tinker path)."""
        self._db.run(
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
                to_json(row.user_metadata),
                row.expires_at,
                to_json(row.info),
            ),
        )

    def get(self, tinker_path: str) -> CheckpointRow | None:
        """Expired rows too: the caller tells the client it expired rather than that it never was."""
        row = self._db.one("SELECT * FROM checkpoints WHERE tinker_path=?", (tinker_path,))
        return None if row is None else self._checkpoint(row)

    def set_info(self, tinker_path: str, info: dict[str, Any]) -> bool:
        """Updates only `info` (a row deleted meanwhile stays deleted); False if there is none."""
        return (
            self._db.run(
                "UPDATE checkpoints SET info=? WHERE tinker_path=?", (to_json(info), tinker_path)
            )
            > 0
        )

    def delete(self, tinker_path: str) -> None:
        self._db.run("DELETE FROM checkpoints WHERE tinker_path=?", (tinker_path,))

    def find_copy(self, tenant: str, idempotency_key: str) -> CheckpointRow | None:
        """The copy an earlier attempt of the same copy_weights call made, if any."""
        row = self._db.one(
            "SELECT * FROM checkpoints c WHERE c.tenant=? "
            "AND json_extract(c.info, '$.copy_key') = ?",
            (tenant, idempotency_key),
        )
        return None if row is None else self._checkpoint(row)

    # ------------------------------------------------------------------ listings
    def page(
        self, tenant: str, model_id: str | None = None, limit: int = 1000, offset: int = 0
    ) -> tuple[list[CheckpointRow], int]:
        """A page of the tenant's checkpoints (of one run, or all), and how many in all.
        Expired ones too, until maintenance deletes them: the listing shows their past
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
        rows = self._db.all(
            f"SELECT * FROM checkpoints WHERE {where} ORDER BY {order} LIMIT ? OFFSET ?",
            (*args, limit, offset),
        )
        total = self._db.one(f"SELECT COUNT(*) AS n FROM checkpoints WHERE {where}", tuple(args))
        return [self._checkpoint(r) for r in rows], int(total["n"]) if total else 0

    def all_rows(self) -> list[CheckpointRow]:
        """Every row, expired ones too: what start-up recovery must not delete."""
        return [
            self._checkpoint(r)
            for r in self._db.all("SELECT * FROM checkpoints ORDER BY tinker_path", ())
        ]

    def expired(self, now: float, limit: int) -> list[CheckpointRow]:
        """The oldest-expired first, at most `limit` (maintenance deletes them in bounded rounds)."""
        rows = self._db.all(
            "SELECT * FROM checkpoints WHERE expires_at IS NOT NULL AND expires_at <= ? "
            "ORDER BY expires_at, tinker_path LIMIT ?",
            (now, limit),
        )
        return [self._checkpoint(r) for r in rows]

    def latest(self, model_id: str, kind: str) -> CheckpointRow | None:
        """The run's newest unexpired checkpoint of this kind."""
        row = self._db.one(
            "SELECT * FROM checkpoints WHERE model_id=? AND kind=? "
            "AND (expires_at IS NULL OR expires_at > ?) ORDER BY created_at DESC LIMIT 1",
            (model_id, kind, time.time()),
        )
        return None if row is None else self._checkpoint(row)

    def sampler_paths(self, tenant: str, limit: int) -> list[tuple[str, float]]:
        """(tinker_path, created_at) of the tenant's unexpired sampler checkpoints, newest first."""
        rows = self._db.all(
            "SELECT tinker_path, created_at FROM checkpoints WHERE tenant=? AND kind='sampler' "
            "AND (expires_at IS NULL OR expires_at > ?) "
            "ORDER BY created_at DESC, tinker_path DESC LIMIT ?",
            (tenant, time.time(), limit),
        )
        return [(str(r["tinker_path"]), float(r["created_at"])) for r in rows]

    # ------------------------------------------------------------------ published (unexpired only)
    def has_public(self, model_id: str) -> bool:
        row = self._db.one(
            f"SELECT 1 FROM checkpoints c WHERE c.model_id=? AND {PUBLIC} AND {LIVE} LIMIT 1",
            (model_id, time.time()),
        )
        return row is not None

    def public_page(
        self, model_id: str, limit: int, offset: int
    ) -> tuple[list[CheckpointRow], int]:
        """A page of the run's published checkpoints, oldest first, and how many in all."""
        where = f"c.model_id=? AND {PUBLIC} AND {LIVE}"
        args = (model_id, time.time())
        rows = self._db.all(
            f"SELECT * FROM checkpoints c WHERE {where} ORDER BY c.created_at, c.tinker_path LIMIT ? OFFSET ?",
            (*args, limit, offset),
        )
        total = self._db.one(f"SELECT COUNT(*) AS n FROM checkpoints c WHERE {where}", args)
        return [self._checkpoint(r) for r in rows], int(total["n"]) if total else 0

    def latest_public(self, model_id: str, kind: str) -> CheckpointRow | None:
        row = self._db.one(
            f"SELECT * FROM checkpoints c WHERE c.model_id=? AND c.kind=? AND {PUBLIC} "
            f"AND {LIVE} ORDER BY c.created_at DESC LIMIT 1",
            (model_id, kind, time.time()),
        )
        return None if row is None else self._checkpoint(row)

    # ------------------------------------------------------------------ sizes (quotas, usage)
    def session_usage(self, session_id: str) -> tuple[int, int]:
        """(count, bytes) of the live checkpoints of the session's runs (joins `models`)."""
        row = self._db.one(
            "SELECT COUNT(*) AS n, COALESCE(SUM(c.size_bytes), 0) AS b FROM checkpoints c "
            f"JOIN models m ON m.model_id = c.model_id WHERE m.session_id=? AND {LIVE}",
            (session_id, time.time()),
        )
        return (int(row["n"]), int(row["b"])) if row else (0, 0)

    def usage_by_project(
        self, tenant: str, project_id: str | None
    ) -> list[tuple[str | None, int, int]]:
        """(project_id, count, bytes) of the tenant's live checkpoints, per project (a run's
        project is its session's: joins `models` and `sessions`); `project_id` keeps one."""
        where = f"c.tenant=? AND {LIVE}"
        args: list[Any] = [tenant, time.time()]
        if project_id is not None:
            where += " AND json_extract(s.info, '$.project_id') = ?"
            args.append(project_id)
        rows = self._db.all(
            "SELECT json_extract(s.info, '$.project_id') AS project, COUNT(*) AS n, "
            "COALESCE(SUM(c.size_bytes), 0) AS b FROM checkpoints c "
            "LEFT JOIN models m ON m.model_id = c.model_id "
            "LEFT JOIN sessions s ON s.session_id = m.session_id "
            f"WHERE {where} GROUP BY project ORDER BY project",
            tuple(args),
        )
        return [(r["project"], int(r["n"]), int(r["b"])) for r in rows]

    def bytes_per_run(self, tenant: str | None = None) -> list[tuple[str, str, int]]:
        """(tenant, run, bytes) of stored checkpoints, a tenant's (None: everyone's), expired
        ones not yet deleted included (they are on disk until maintenance deletes them)."""
        where, args = ("tenant=?", (tenant,)) if tenant is not None else ("1=1", ())
        rows = self._db.all(
            f"SELECT tenant, model_id, COALESCE(SUM(size_bytes), 0) FROM checkpoints WHERE {where} "
            "GROUP BY tenant, model_id ORDER BY tenant, model_id",
            args,
        )
        return [(r[0], r[1], int(r[2])) for r in rows]

    def size_estimate(self, model_id: str, kinds: tuple[str, ...], rank: int) -> int:
        """What the next save of these kinds will likely take: the run's largest such
        checkpoint, else the largest of any run of the same rank (sizes follow the LoRA shape;
        joins `models` for the rank), else 0."""
        marks = ", ".join("?" for _ in kinds)
        row = self._db.one(
            f"SELECT MAX(size_bytes) AS b FROM checkpoints WHERE model_id=? AND kind IN ({marks})",
            (model_id, *kinds),
        )
        if row is not None and row["b"] is not None:
            return int(row["b"])
        row = self._db.one(
            f"SELECT MAX(c.size_bytes) AS b FROM checkpoints c JOIN models m "
            f"ON m.model_id = c.model_id WHERE c.kind IN ({marks}) AND m.lora_rank=?",
            (*kinds, rank),
        )
        return int(row["b"]) if row is not None and row["b"] is not None else 0
