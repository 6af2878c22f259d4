"""The sessions table: heartbeats, a finish that counts once, stale sessions, and the two
ways to page through a tenant's sessions (offset and cursor)."""

from __future__ import annotations

import time

from lorafleet.server.state.store import Store


def test_a_session_finishes_once_and_only_unfinished_silent_ones_are_stale(store: Store):
    store.sessions.add("s1", "t1", {"tags": ["a"]})
    store.sessions.add("s2", "t1", {})
    store.sessions.add("s3", "t1", {})
    store.sessions.finish("s3", "done")
    store.sessions.finish("s3", "again")
    row = store.sessions.get("s3")
    assert row is not None and row.finish_reason == "done"
    later = time.time() + 1
    store.database.run("UPDATE sessions SET last_heartbeat=? WHERE session_id='s2'", (later,))
    assert [s.session_id for s in store.sessions.stale(later)] == ["s1"]
    store.sessions.heartbeat("s1")
    assert store.sessions.get("s1").last_heartbeat > store.sessions.get("s1").created_at - 1
    store.sessions.set_info("s1", {"project_id": "p"})
    assert store.sessions.get("s1").info == {"project_id": "p"}
    assert store.sessions.get("nope") is None


def test_sessions_page_by_offset_and_by_cursor_newest_first(store: Store):
    for i, session_id in enumerate(["a", "b", "c", "d"]):
        store.sessions.add(session_id, "t1", {})
        store.database.run(
            "UPDATE sessions SET created_at=? WHERE session_id=?",
            (1.0 if session_id in "bc" else float(i), session_id),
        )
    store.sessions.add("other", "t2", {})
    rows, total = store.sessions.page("t1", 2, 1)
    assert [r.session_id for r in rows] == ["c", "b"] and total == 4
    first = store.sessions.before("t1", None, 2)
    assert [r.session_id for r in first] == ["d", "c"]
    last = first[-1]
    rest = store.sessions.before("t1", (last.created_at, last.session_id), 10)
    assert [r.session_id for r in rest] == ["b", "a"]
