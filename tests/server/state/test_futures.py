"""The futures table: a request found again by `(scope, seq_id)`, results kept by age and by
bytes, and the pending ones a restart fails."""

from __future__ import annotations

import sqlite3

import pytest

from lorafleet.server.state.store import Store


def test_a_future_is_found_by_its_scope_and_seq_id_and_finishes_once_written(store: Store):
    store.futures.add("r1", "t1", "m1", 0, "forward_backward", "fp")
    store.futures.add("r2", "t1", None, None, "sample", None)
    found = store.futures.find("m1", 0)
    assert found is not None and found.request_id == "r1" and found.state == "pending"
    assert store.futures.find("m1", 1) is None
    with pytest.raises(sqlite3.IntegrityError):  # one future per (scope, seq_id)
        store.futures.add("r3", "t1", "m1", 0, "forward_backward", "fp")
    store.futures.finish("r1", "done", "application/json", b"{}")
    row = store.futures.get("r1")
    assert row is not None and (row.state, row.body) == ("done", b"{}")
    assert store.futures.result_bytes() == 2
    assert store.futures.fail_pending("application/json", b"lost") == 1
    row = store.futures.get("r2")
    assert row is not None and (row.state, row.body) == ("failed", b"lost")


def test_scopes_futures_come_oldest_first(store: Store):
    for i, (request_id, scope) in enumerate([("a", "m1"), ("b", "x"), ("c", "ss1"), ("d", "m1")]):
        store.futures.add(request_id, "t1", scope, i, "sample", None)
    ids = [f.request_id for f in store.futures.of_scopes(["m1", "ss1"], 10)]
    assert ids == ["a", "c", "d"]
    assert [f.request_id for f in store.futures.of_scopes(["m1", "ss1"], 2)] == ["a", "c"]
    assert store.futures.of_scopes([], 10) == []


def test_results_are_pruned_by_age_and_by_bytes_never_pending_ones(store: Store):
    for i in range(4):
        store.futures.add(f"r{i}", "t1", None, None, "sample", None)
        store.futures.finish(f"r{i}", "done", "application/octet-stream", b"x" * 10)
        store.database.run(
            "UPDATE futures SET finished_at=? WHERE request_id=?", (float(i + 1), f"r{i}")
        )
    store.futures.add("pending", "t1", None, None, "sample", None)
    assert store.futures.prune(older_than=2.0) == 1  # r0
    assert store.futures.prune_to_bytes(20) == 1  # r1: r3 and r2 are the newest 20 bytes
    assert [store.futures.get(f"r{i}") is not None for i in range(4)] == [False, False, True, True]
    assert store.futures.get("pending") is not None
    assert store.futures.result_bytes() == 20
