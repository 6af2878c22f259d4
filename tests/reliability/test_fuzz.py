"""Malformed and hostile input: >= 1000 generated requests, zero 5xx, the server stays up, and a
tenant training through the attack gets the same results as without it."""

from __future__ import annotations

import pytest

from tests.reliability.fuzz import run_fuzz


@pytest.mark.slow
def test_hostile_requests_get_clear_4xx_and_disturb_nobody(tmp_path):
    report = run_fuzz(tmp_path, examples=1000, seed=0, victim_max_steps=10)
    assert report.requests >= 1000
    assert report.server_5xx == 0, report.examples
    assert report.unclear_errors == 0, report.examples
    assert report.forbidden_403 == 0 and report.foreign_2xx == 0, report.examples
    assert report.futures_unresolved == 0 and not report.server_down
    assert report.by_status[400] > 0 and report.by_status[404] > 0 and report.by_status[413] > 0
    assert report.futures_checked > 0  # hostile payloads that took a seq_id place were judged too
    slow = report.slow_clients
    assert slow["trickled_body_status"] == 408 and slow["others_ok_while_stuck"], slow
    victim = report.victim
    assert victim["steps"] >= 2 and victim["failed"] == []
    assert victim["cross_tenant_diffs"] == 0, victim["diffs"]
