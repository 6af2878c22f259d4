"""A run's curves as the console reads them: one curve with many points must not push the
others out of the read (one LIMIT over all points dropped whole curves, the server's own
loss first when a client's name sorted before it), and a long curve comes back thinned to
MAX_CURVE_POINTS with its newest point."""

from __future__ import annotations

from pathlib import Path

from lorafleet.server.ops.run_metrics import MAX_CURVE_POINTS, RunMetrics
from lorafleet.server.state.store import Store


def test_a_long_curve_leaves_the_others_whole_and_is_thinned(tmp_path: Path):
    store = Store(tmp_path / "state.db")
    long = [("t", "r", "acc", step, 0.5, "client", 0.0) for step in range(25_000)]
    loss = [("t", "r", "loss", step, 2.0 - step / 10, "server", 0.0) for step in range(10)]
    other_run = [("t", "r2", "acc", step, 1.0, "client", 0.0) for step in range(5)]
    store.run_metrics.add(long + loss + other_run)
    series = {(s["name"], s["source"]): s["points"] for s in RunMetrics(store).series("t", "r")}
    assert set(series) == {("acc", "client"), ("loss", "server")}
    assert series["loss", "server"] == [[step, 2.0 - step / 10] for step in range(10)]
    acc = [step for step, _ in series["acc", "client"]]
    assert len(acc) <= MAX_CURVE_POINTS and acc[-1] == 24_999 and acc == sorted(acc)
    assert acc[0] < 25_000 / MAX_CURVE_POINTS  # spread over the whole run, not its tail only
    later = RunMetrics(store).series("t", "r", after_step=24_990)
    assert [(s["name"], [p[0] for p in s["points"]]) for s in later] == [
        ("acc", list(range(24_991, 25_000)))
    ]
