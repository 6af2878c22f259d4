"""The `run_metrics` table: per-step points of a run's curves for the console (the server's
own loss of each forward_backward, and what clients post)."""

from __future__ import annotations

import sqlite3

from lorafleet.server.state.store.database import Database


class RunMetricsTable:
    def __init__(self, db: Database):
        self._db = db

    def add(self, rows: list[tuple[str, str, str, int, float, str, float]]) -> None:
        """(tenant, run, name, step, value, source, at) rows, all in one transaction (one
        commit, not one per row); a point posted again for the same step replaces the earlier
        one (a client retrying its post)."""
        if not rows:
            return

        def add(_db: sqlite3.Connection) -> None:
            with self._db.tx() as db:
                db.executemany(
                    "INSERT OR REPLACE INTO run_metrics VALUES (?, ?, ?, ?, ?, ?, ?)", rows
                )

        self._db.write(add)

    def points(
        self, tenant: str, run: str, after_step: int = -1, limit: int = 10000
    ) -> list[tuple[str, str, int, float, float]]:
        """(name, source, step, value, at) of one run, by name, source and step."""
        rows = self._db.all(
            "SELECT name, source, step, value, at FROM run_metrics WHERE tenant=? AND run=? "
            "AND step>? ORDER BY name, source, step LIMIT ?",
            (tenant, run, after_step, limit),
        )
        return [(r[0], r[1], int(r[2]), float(r[3]), float(r[4])) for r in rows]

    def curves(
        self, tenant: str, run: str, after_step: int, per_curve: int
    ) -> list[tuple[str, str, int, float, float]]:
        """Like `points`, but at most `per_curve` points of each (name, source) past
        `after_step`: every `k`-th step counted back from the name's newest, `k` spread over its
        steps. Every curve shows however many points another has (one LIMIT over them all
        dropped whole curves), and the cost follows the index: the names one lookup each
        (a run has at most a few dozen), their step ranges from the index's ends."""
        out: list[tuple[str, str, int, float, float]] = []
        name = ""
        while True:
            found = self._db.one(
                "SELECT name FROM run_metrics WHERE tenant=? AND run=? AND name>? "
                "ORDER BY name LIMIT 1",
                (tenant, run, name),
            )
            if found is None:
                return out
            name = str(found["name"])
            where = "FROM run_metrics WHERE tenant=? AND run=? AND name=? AND step>?"
            args = (tenant, run, name, after_step)
            low = self._db.one(f"SELECT MIN(step) AS s {where}", args)
            high = self._db.one(f"SELECT MAX(step) AS s {where}", args)
            if low is None or high is None or low["s"] is None:
                continue
            stride = max(1, -(-(int(high["s"]) - int(low["s"]) + 1) // per_curve))
            rows = self._db.all(
                f"SELECT source, step, value, at {where} AND (? - step) % ? = 0 "
                "ORDER BY source, step",
                (*args, int(high["s"]), stride),
            )
            out.extend((name, r[0], int(r[1]), float(r[2]), float(r[3])) for r in rows)

    def stats(self, tenant: str, run: str) -> tuple[set[str], int, int]:
        """The names a run has points under, its number of points and its highest step (-1
        when none): what bounds a client's posts."""
        names = {
            r[0]
            for r in self._db.all(
                "SELECT DISTINCT name FROM run_metrics WHERE tenant=? AND run=?", (tenant, run)
            )
        }
        row = self._db.one(
            "SELECT COUNT(*) AS n, COALESCE(MAX(step), -1) AS s FROM run_metrics "
            "WHERE tenant=? AND run=?",
            (tenant, run),
        )
        return names, int(row["n"]) if row else 0, int(row["s"]) if row else -1

    def max_step(self, tenant: str, run: str, name: str, source: str) -> int:
        """The highest step of one curve, -1 when it has none."""
        row = self._db.one(
            "SELECT COALESCE(MAX(step), -1) AS s FROM run_metrics "
            "WHERE tenant=? AND run=? AND name=? AND source=?",
            (tenant, run, name, source),
        )
        return int(row["s"]) if row else -1
