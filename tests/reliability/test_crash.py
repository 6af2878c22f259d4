"""Crash safety: kill -9 at named points of every durable operation, restart, verify (CI runs 5
cycles, one per operation; bench/reliability.py runs 20)."""

from __future__ import annotations

import pytest

from tests.reliability.crash import CRASH_OPS, make_plans, run_crash


def test_plans_cover_every_operation_and_are_reproducible():
    plans = make_plans(20, seed=3)
    assert plans == make_plans(20, seed=3)
    assert {p.op for p in plans} == set(CRASH_OPS)
    assert all(sum(p.op == op for p in plans) == 4 for op in CRASH_OPS)
    assert {p.mode for p in plans} == {"pause_begin", "pause_end", "delay"}


@pytest.mark.slow
def test_kill_9_during_each_operation_loses_no_reported_save(tmp_path):
    report = run_crash(tmp_path, cycles=5, seed=7)
    summary = report.summary()
    assert {c["op"] for c in summary["per_cycle"]} == set(CRASH_OPS)
    assert summary["problems"] == []
    assert summary["torn_files_seen"] == 0
    assert summary["hung_futures"] == 0
    assert summary["crash_restarts_survived"] == 5, summary["per_cycle"]
    assert summary["saves_verified"] > 0 and summary["loads_verified_bit_exact"] >= 5
