"""`lorafleet rl` and the console: it prints its embedded server's console URL, the run's own key
(from the run dir) signs in there, and each step's rewards arrive as the run's client curves
beside the server's loss, and so do its held-out evaluations."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx

from lorafleet.rl.loop import run_rl
from lorafleet.server.state.store import Store
from tests.rl.test_rl_fast import config, short_env, tenants  # noqa: F401 - short_env: autouse


def test_rl_prints_the_console_url_and_posts_its_rewards(tmp_path, capsys):
    run_dir = tmp_path / "run"
    seen: dict[str, Any] = {}

    def on_step(name: str, row: dict[str, Any]) -> None:
        if "overview" in seen:
            return
        url = re.search(r"console: (http://\S+/console) ", capsys.readouterr().out)
        assert url is not None
        key = json.loads((run_dir / "api_keys.json").read_text())[name]
        with httpx.Client(base_url=url.group(1).removesuffix("/console")) as client:
            assert client.post("/console/api/session", json={"key": key}).status_code == 200
            seen["overview"] = client.get("/console/api/overview").json()

    results = run_rl(config(run_dir, tenants("a"), steps=2), on_step=on_step)
    assert results["a"].error is None
    [run] = seen["overview"]["runs"]  # the run's key saw its run in the console
    store = Store(run_dir / "server-data" / "lorafleet.db")
    try:
        points = store.run_metrics.points(seen["overview"]["tenant"], run["id"])
    finally:
        store.close()
    client = {(name, step) for name, source, step, _v, _at in points if source == "client"}
    assert {("reward_mean", 0), ("reward_mean", 1), ("tag_rate", 1)} <= client
    rows = [json.loads(line) for line in (run_dir / "a" / "metrics.jsonl").read_text().splitlines()]
    posted = {step: v for name, _s, step, v, _at in points if name == "reward_mean"}
    assert posted == {row["step"]: row["reward_mean"] for row in rows if "reward_mean" in row}
    # held-out evaluations (steps 0 and 2, the last a row of its own) reach the console too
    evaluated = {step: v for name, _s, step, v, _at in points if name == "eval_accuracy"}
    assert evaluated == {
        row["step"]: row["eval_accuracy"] for row in rows if "eval_accuracy" in row
    }
    assert sorted(evaluated) == [0, 2]
    if any(row.get("trained_rows") for row in rows):  # a step with a gradient has a loss point
        assert any(name == "loss" and source == "server" for name, source, *_ in points)
