"""A store in a fresh data dir, and rows to put in it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafleet.server.state.store import CheckpointRow, ModelRow, Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    (tmp_path / "data").mkdir()
    opened = Store(tmp_path / "data" / "lorafleet.db")
    try:
        yield opened
    finally:
        opened.close()


def model(model_id: str, tenant: str = "t1", session_id: str = "s1", **fields) -> ModelRow:
    row = ModelRow(model_id, tenant, session_id, "base", 8, {"rank": 8}, None, 0.0, 0.0, "active")
    for name, value in fields.items():
        setattr(row, name, value)
    return row


def checkpoint(
    store: Store, tinker_path: str, model_id: str = "m1", tenant: str = "t1", **fields
) -> CheckpointRow:
    """A row whose dir is under the store's data dir."""
    name = tinker_path.rsplit("/", 1)[1]
    row = CheckpointRow(
        tinker_path,
        tenant,
        model_id,
        "training",
        name,
        str(store.data_dir / "tenants" / tenant / "runs" / model_id / "weights" / name),
        time.time(),
        100,
        None,
        None,
        {},
    )
    for field, value in fields.items():
        setattr(row, field, value)
    return row
