"""The models table: runs, their status, and the listing that other tenants' published runs
and a session's project filter."""

from __future__ import annotations

from lorafleet.server.state.store import Store
from tests.server.state.conftest import checkpoint, model


def test_a_run_reads_back_and_its_status_and_request_time_change(store: Store):
    row = model("m1", user_metadata={"k": "v"})
    store.models.add(row)
    assert store.models.get("m1") == row
    store.models.touch("m1")
    store.models.set_status("m1", "unloaded")
    got = store.models.get("m1")
    assert got is not None and got.status == "unloaded" and got.last_request_time > 0
    assert store.models.get("m2") is None


def test_at_start_up_the_active_runs_are_marked_and_registered_runs_counted(store: Store):
    for model_id, status in [("a", "active"), ("b", "active"), ("c", "unloaded"), ("d", "copy")]:
        store.models.add(model(model_id, status=status))
    assert store.models.count_registered("t1") == 2
    assert store.models.mark_active_as("lost") == 2
    assert {m.model_id: m.status for m in store.models.of_session("s1")} == {
        "a": "lost",
        "b": "lost",
        "c": "unloaded",
        "d": "copy",
    }
    assert store.models.count_registered("t1") == 0


def test_the_runs_page_adds_published_runs_and_keeps_a_project(store: Store):
    store.sessions.add("s1", "t1", {"project_id": "p"})
    store.sessions.add("s2", "t1", {})
    store.sessions.add("s3", "t2", {"project_id": "p"})
    store.models.add(model("mine-p", session_id="s1", created_at=1.0))
    store.models.add(model("mine", session_id="s2", created_at=2.0))
    store.models.add(model("theirs", tenant="t2", session_id="s3", created_at=3.0))
    store.models.add(model("hidden", tenant="t2", session_id="s3", created_at=4.0))
    store.checkpoints.put(
        checkpoint(store, "tinker://theirs/weights/a", "theirs", "t2", info={"public": True})
    )
    store.checkpoints.put(checkpoint(store, "tinker://hidden/weights/a", "hidden", "t2"))

    def ids(**filters) -> tuple[list[str], int]:
        rows, total = store.models.page("t1", 10, 0, **filters)
        return [r.model_id for r in rows], total

    assert ids() == (["mine", "mine-p"], 2)
    assert ids(accessible=True) == (["theirs", "mine", "mine-p"], 3)
    assert ids(accessible=True, project_id="p") == (["theirs", "mine-p"], 2)
    assert ids(project_id="p") == (["mine-p"], 1)
    rows, total = store.models.page("t1", 1, 1)
    assert [r.model_id for r in rows] == ["mine-p"] and total == 2
