"""The sampling_sessions table."""

from __future__ import annotations

from lorafleet.server.state.store import SamplingSessionRow, Store


def test_a_sampling_session_reads_back_and_a_sessions_ids_come_oldest_first(store: Store):
    rows = [
        SamplingSessionRow("ss-b", "t1", "s1", "base", None, None, None, 1.0),
        SamplingSessionRow(
            "ss-a", "t1", "s1", "base", "tinker://m1/sampler_weights/x", "k", 3, 2.0
        ),
        SamplingSessionRow("ss-c", "t1", "s2", "base", None, None, None, 0.0),
    ]
    for row in rows:
        store.sampling_sessions.add(row)
    assert store.sampling_sessions.get("ss-a") == rows[1]
    assert store.sampling_sessions.get("nope") is None
    assert store.sampling_sessions.ids_of_session("s1") == ["ss-b", "ss-a"]
