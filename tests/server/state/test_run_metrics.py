"""The run_metrics table: a point posted again replaces the earlier one; what bounds a
client's posts. (The curves' thinning: tests/server/test_run_metrics_curves.py.)"""

from __future__ import annotations

import sqlite3

import pytest

from lorafleet.server.state.store import Store


def test_points_replace_by_step_and_the_stats_bound_a_run(store: Store):
    store.run_metrics.add(
        [
            ("t1", "m1", "loss", 0, 2.0, "server", 0.0),
            ("t1", "m1", "loss", 1, 1.5, "server", 0.0),
            ("t1", "m1", "acc", 3, 0.1, "client", 0.0),
            ("t1", "m2", "loss", 9, 0.0, "server", 0.0),
        ]
    )
    store.run_metrics.add([("t1", "m1", "acc", 3, 0.2, "client", 1.0)])  # a retried post
    assert store.run_metrics.points("t1", "m1") == [
        ("acc", "client", 3, 0.2, 1.0),
        ("loss", "server", 0, 2.0, 0.0),
        ("loss", "server", 1, 1.5, 0.0),
    ]
    assert store.run_metrics.points("t1", "m1", after_step=0, limit=1) == [
        ("acc", "client", 3, 0.2, 1.0)
    ]
    assert store.run_metrics.stats("t1", "m1") == ({"loss", "acc"}, 3, 3)
    assert store.run_metrics.stats("t1", "none") == (set(), 0, -1)
    assert store.run_metrics.max_step("t1", "m1", "loss", "server") == 1
    assert store.run_metrics.max_step("t1", "m1", "loss", "client") == -1
    assert store.run_metrics.curves("t1", "m1", -1, 1) == [
        ("acc", "client", 3, 0.2, 1.0),
        ("loss", "server", 1, 1.5, 0.0),
    ]


def test_a_batch_is_written_whole_or_not_at_all(store: Store):
    """Before, each row committed on its own: a batch failing midway left its first rows."""
    good = ("t1", "m1", "loss", 0, 2.0, "server", 0.0)
    bad = ("t1", "m1", "loss", 1, None, "server", 0.0)  # value NOT NULL
    with pytest.raises(sqlite3.IntegrityError):
        store.run_metrics.add([good, bad])  # type: ignore[list-item]
    assert store.run_metrics.points("t1", "m1") == []
