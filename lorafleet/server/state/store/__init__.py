"""SQLite persistence for what must outlive the process: sessions, models, futures,
checkpoints, sampling sessions, usage, aliases, run metrics and stability records.

Adapter weights live in files (state/paths.py); this database only says who owns what and
where it is. `Store` opens the one connection (database.py: schema, migrations, the lock and
the full-disk write path) and hands it to one object per table, which callers reach as
attributes: `store.models.get(model_id)`, `store.checkpoints.put(row)`,
`store.futures.find(scope, seq_id)`. A query that joins tables lives with the table whose rows
(or counts) it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lorafleet.server.state.store.aliases import AliasesTable
from lorafleet.server.state.store.checkpoints import CheckpointRow, CheckpointsTable
from lorafleet.server.state.store.database import SCHEMA_VERSION, Database, StoreError
from lorafleet.server.state.store.futures import FutureRow, FuturesTable
from lorafleet.server.state.store.models import ModelRow, ModelsTable
from lorafleet.server.state.store.run_metrics import RunMetricsTable
from lorafleet.server.state.store.sampling_sessions import SamplingSessionRow, SamplingSessionsTable
from lorafleet.server.state.store.sessions import SessionRow, SessionsTable
from lorafleet.server.state.store.stability_records import StabilityRecordsTable
from lorafleet.server.state.store.usage import UsageTable

__all__ = [
    "SCHEMA_VERSION",
    "CheckpointRow",
    "FutureRow",
    "ModelRow",
    "SamplingSessionRow",
    "SessionRow",
    "Store",
    "StoreError",
]


class Store:
    """The database and its tables, all over one connection and one lock."""

    def __init__(self, path: str | Path, *, on_disk_full: Callable[[], bool] | None = None):
        """`path` is the database file; its directory is the data dir stored paths are
        relative to. `on_disk_full` (DiskGuard.release) makes room when a write finds the
        disk full; True if it did."""
        self.database = Database(path, on_disk_full=on_disk_full)
        self.sessions = SessionsTable(self.database)
        self.models = ModelsTable(self.database)
        self.futures = FuturesTable(self.database)
        self.checkpoints = CheckpointsTable(self.database)
        self.sampling_sessions = SamplingSessionsTable(self.database)
        self.usage = UsageTable(self.database)
        self.aliases = AliasesTable(self.database)
        self.run_metrics = RunMetricsTable(self.database)
        self.stability_records = StabilityRecordsTable(self.database)

    @property
    def path(self) -> Path:
        return self.database.path

    @property
    def data_dir(self) -> Path:
        return self.database.data_dir

    def close(self) -> None:
        self.database.close()
