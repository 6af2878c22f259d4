"""The `aliases` table: names a tenant gives its sampler paths (the OpenAI routes' `model`)."""

from __future__ import annotations

from lorafleet.server.state.store.database import Database


class AliasesTable:
    def __init__(self, db: Database):
        self._db = db

    def put(self, tenant: str, alias: str, target: str, at: float, max_aliases: int) -> bool:
        """Creates or repoints an alias; False (nothing written) when the tenant already has
        `max_aliases` others. One statement, so concurrent puts cannot pass the bound."""
        return (
            self._db.run(
                "INSERT OR REPLACE INTO aliases SELECT ?, ?, ?, ? WHERE "
                "(SELECT COUNT(*) FROM aliases WHERE tenant=? AND alias<>?) < ?",
                (tenant, alias, target, at, tenant, alias, max_aliases),
            )
            > 0
        )

    def get(self, tenant: str, alias: str) -> tuple[str, float] | None:
        """(target, created_at)."""
        row = self._db.one(
            "SELECT target, created_at FROM aliases WHERE tenant=? AND alias=?", (tenant, alias)
        )
        return None if row is None else (str(row["target"]), float(row["created_at"]))

    def of_tenant(self, tenant: str, limit: int) -> list[tuple[str, str, float]]:
        """(alias, target, created_at), newest first."""
        rows = self._db.all(
            "SELECT alias, target, created_at FROM aliases WHERE tenant=? "
            "ORDER BY created_at DESC, alias LIMIT ?",
            (tenant, limit),
        )
        return [(str(r["alias"]), str(r["target"]), float(r["created_at"])) for r in rows]

    def delete(self, tenant: str, alias: str) -> bool:
        """False if there was none."""
        return self._db.run("DELETE FROM aliases WHERE tenant=? AND alias=?", (tenant, alias)) > 0
