"""The usage table: metering's batches add up per tenant, run, day and counter."""

from __future__ import annotations

from lorafleet.server.state.store import Store


def test_usage_adds_up_and_reads_by_day_totals_and_one_day(store: Store):
    store.usage.add(
        [
            ("t1", "m1", "2026-12-01", "steps", 1.0),
            ("t1", "m2", "2026-12-01", "steps", 2.0),
            ("t1", "m1", "2026-12-02", "steps", 4.0),
            ("t2", "m9", "2026-12-02", "tokens", 8.0),
        ]
    )
    store.usage.add([("t1", "m1", "2026-12-01", "steps", 0.5)])
    store.usage.add([])
    assert store.usage.by_day("t1", "2026-12-02") == [("t1", "m1", "2026-12-02", "steps", 4.0)]
    assert len(store.usage.by_day(None)) == 4
    assert store.usage.totals("t1") == [("t1", "m1", "steps", 5.5), ("t1", "m2", "steps", 2.0)]
    assert sorted(store.usage.of_day("2026-12-02")) == [("t1", "steps", 4.0), ("t2", "tokens", 8.0)]
