"""The checkpoints table: dirs stored relative to the data dir and never resolving outside
it, the listings' orders, expiry and publication as filters, and the size gauges that join
runs and sessions."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from lorafleet.server.state.store import CheckpointRow, Store, StoreError
from tests.server.state.conftest import checkpoint, model

WEIGHTS = "tenants/t1/runs/m1/weights"


def _row(path: str, directory: Path | str) -> CheckpointRow:
    return CheckpointRow(
        path, "t1", "m1", "training", path.rsplit("/", 1)[1], str(directory), 0.0, 1, None, None, {}
    )


@pytest.mark.parametrize("stored", ["../elsewhere/a", "/etc/passwd", "tenants/../../a", "escape"])
def test_a_stored_dir_never_resolves_outside_the_data_dir(tmp_path, stored):
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", data / "escape")  # a symlink out of the data dir
    store = Store(data / "lorafleet.db")
    try:
        store.checkpoints.put(_row("tinker://m1/weights/a", data / WEIGHTS / "a"))
        store.database.run("UPDATE checkpoints SET dir=?", (stored,))
        with pytest.raises(StoreError, match="tinker://m1/weights/a"):
            store.checkpoints.get("tinker://m1/weights/a")
    finally:
        store.close()


def test_a_row_outside_the_data_dir_is_not_written(tmp_path):
    (tmp_path / "data").mkdir()
    store = Store(tmp_path / "data" / "lorafleet.db")
    try:
        with pytest.raises(StoreError, match="not inside the data dir"):
            store.checkpoints.put(_row("tinker://m1/weights/a", tmp_path / "elsewhere" / "a"))
        assert store.checkpoints.get("tinker://m1/weights/a") is None
    finally:
        store.close()


def test_a_row_reads_back_as_written_with_its_dir_stored_relative(store: Store):
    row = checkpoint(store, "tinker://m1/weights/a", user_metadata={"k": "v"}, info={"x": 1})
    store.checkpoints.put(row)
    assert store.checkpoints.get(row.tinker_path) == row
    stored = store.database.one("SELECT dir FROM checkpoints", ())
    assert stored is not None and stored["dir"] == f"{WEIGHTS}/a"
    assert store.checkpoints.set_info(row.tinker_path, {"public": True})
    assert store.checkpoints.get(row.tinker_path).info == {"public": True}
    store.checkpoints.delete(row.tinker_path)
    assert store.checkpoints.get(row.tinker_path) is None
    assert not store.checkpoints.set_info(row.tinker_path, {})  # deleted stays deleted


def test_one_runs_listing_is_oldest_first_and_a_tenants_newest_first(store: Store):
    for i, (run, name) in enumerate([("m1", "a"), ("m2", "b"), ("m1", "c")]):
        store.checkpoints.put(
            checkpoint(store, f"tinker://{run}/weights/{name}", model_id=run, created_at=float(i))
        )
    store.checkpoints.put(checkpoint(store, "tinker://o/weights/z", model_id="o", tenant="t2"))
    rows, total = store.checkpoints.page("t1", "m1")
    assert [r.name for r in rows] == ["a", "c"] and total == 2
    rows, total = store.checkpoints.page("t1", limit=2, offset=0)
    assert [r.name for r in rows] == ["c", "b"] and total == 3
    assert [r.name for r in store.checkpoints.all_rows()] == ["a", "c", "b", "z"]  # by path


def test_expired_rows_are_listed_but_not_latest_and_come_oldest_expired_first(store: Store):
    now = time.time()
    store.checkpoints.put(checkpoint(store, "tinker://m1/weights/a", created_at=1.0))
    store.checkpoints.put(
        checkpoint(store, "tinker://m1/weights/b", created_at=2.0, expires_at=now - 10)
    )
    store.checkpoints.put(
        checkpoint(store, "tinker://m1/weights/c", created_at=3.0, expires_at=now - 20)
    )
    assert store.checkpoints.page("t1", "m1")[1] == 3
    latest = store.checkpoints.latest("m1", "training")
    assert latest is not None and latest.name == "a"
    assert [r.name for r in store.checkpoints.expired(now, 10)] == ["c", "b"]
    assert [r.name for r in store.checkpoints.expired(now, 1)] == ["c"]
    assert store.checkpoints.get("tinker://m1/weights/b").expired(now)


def test_published_means_flagged_and_unexpired(store: Store):
    now = time.time()
    store.checkpoints.put(checkpoint(store, "tinker://m1/weights/a", created_at=1.0))
    store.checkpoints.put(
        checkpoint(store, "tinker://m1/weights/b", created_at=2.0, info={"public": True})
    )
    store.checkpoints.put(
        checkpoint(
            store,
            "tinker://m1/weights/c",
            created_at=3.0,
            info={"public": True},
            expires_at=now - 1,
        )
    )
    assert store.checkpoints.has_public("m1") and not store.checkpoints.has_public("m2")
    rows, total = store.checkpoints.public_page("m1", 10, 0)
    assert [r.name for r in rows] == ["b"] and total == 1
    latest = store.checkpoints.latest_public("m1", "training")
    assert latest is not None and latest.name == "b"


def test_sampler_paths_and_a_copys_key(store: Store):
    store.checkpoints.put(
        checkpoint(store, "tinker://m1/sampler_weights/s", kind="sampler", created_at=5.0)
    )
    store.checkpoints.put(
        checkpoint(store, "tinker://m1/weights/w", created_at=6.0, info={"copy_key": "k1"})
    )
    assert store.checkpoints.sampler_paths("t1", 10) == [("tinker://m1/sampler_weights/s", 5.0)]
    found = store.checkpoints.find_copy("t1", "k1")
    assert found is not None and found.name == "w"
    assert store.checkpoints.find_copy("t2", "k1") is None


def test_the_size_gauges_count_runs_sessions_and_projects(store: Store):
    now = time.time()
    store.sessions.add("s1", "t1", {"project_id": "p"})
    store.sessions.add("s2", "t1", {})
    store.models.add(model("m1", session_id="s1"))
    store.models.add(model("m2", session_id="s2", lora_rank=4))
    store.checkpoints.put(checkpoint(store, "tinker://m1/weights/a", size_bytes=100))
    store.checkpoints.put(
        checkpoint(store, "tinker://m1/weights/b", size_bytes=50, expires_at=now - 1)
    )
    store.checkpoints.put(checkpoint(store, "tinker://m2/weights/c", model_id="m2", size_bytes=7))
    # live ones only, through the run's session
    assert store.checkpoints.session_usage("s1") == (1, 100)
    assert store.checkpoints.usage_by_project("t1", None) == [(None, 1, 7), ("p", 1, 100)]
    assert store.checkpoints.usage_by_project("t1", "p") == [("p", 1, 100)]
    # on disk: the expired one until maintenance deletes it
    assert store.checkpoints.bytes_per_run("t1") == [("t1", "m1", 150), ("t1", "m2", 7)]
    assert store.checkpoints.bytes_per_run("t2") == []
    # the run's own largest, else the largest of the same rank, else 0
    assert store.checkpoints.size_estimate("m1", ("training",), 8) == 100
    assert store.checkpoints.size_estimate("new", ("training",), 4) == 7
    assert store.checkpoints.size_estimate("new", ("sampler",), 4) == 0
