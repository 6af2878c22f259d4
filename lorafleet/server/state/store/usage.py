"""The `usage` table (metering and quotas): one total per tenant, run, UTC day and counter
(tokens, steps, compute- and resident adapter-seconds)."""

from __future__ import annotations

import sqlite3

from lorafleet.server.state.store.database import Database


class UsageTable:
    def __init__(self, db: Database):
        self._db = db

    def add(self, rows: list[tuple[str, str, str, str, float]]) -> None:
        """Adds (tenant, run, day, counter, amount) to the stored totals, all in one
        transaction (metering flushes its counts in batches, not per request)."""
        if not rows:
            return

        def add(_db: sqlite3.Connection) -> None:
            with self._db.tx() as db:
                db.executemany(
                    "INSERT INTO usage VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, run, "
                    "day, counter) DO UPDATE SET value = value + excluded.value",
                    rows,
                )

        self._db.write(add)

    def by_day(
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
        rows = self._db.all(
            f"SELECT tenant, run, day, counter, value FROM usage WHERE {where} "
            "ORDER BY tenant, day, run, counter",
            tuple(args),
        )
        return [(r[0], r[1], r[2], r[3], float(r[4])) for r in rows]

    def totals(self, tenant: str | None) -> list[tuple[str, str, str, float]]:
        """(tenant, run, counter, value) over all days, a tenant's (None: everyone's)."""
        where, args = ("tenant=?", (tenant,)) if tenant is not None else ("1=1", ())
        rows = self._db.all(
            f"SELECT tenant, run, counter, SUM(value) FROM usage WHERE {where} "
            "GROUP BY tenant, run, counter ORDER BY tenant, run, counter",
            args,
        )
        return [(r[0], r[1], r[2], float(r[3])) for r in rows]

    def of_day(self, day: str) -> list[tuple[str, str, float]]:
        """(tenant, counter, value) of one day, summed over runs (the per-day quotas)."""
        rows = self._db.all(
            "SELECT tenant, counter, SUM(value) FROM usage WHERE day=? GROUP BY tenant, counter",
            (day,),
        )
        return [(r[0], r[1], float(r[2])) for r in rows]
