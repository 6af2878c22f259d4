"""Load: concurrent official-SDK tenants lose and duplicate nothing, and each ends where a solo
replay of its own requests ends (within float32 rounding: see tests/reliability/load.py)."""

from __future__ import annotations

from tests.reliability.load import CALLS, run_load


def test_concurrent_tenants_lose_nothing_and_match_their_solo_replays(tmp_path):
    report = run_load(tmp_path, tenants=4, steps=3, seed=1)
    assert report.failed_requests == []
    assert report.lost_requests == 0 and report.duplicated_requests == 0
    assert report.executed == report.sent  # every operation ran exactly once on the server
    assert report.cross_tenant_diffs == 0, report.diff_examples
    assert report.max_rel_weight_diff <= 1e-2 and report.max_logprob_diff <= 1e-3
    # the comparison is not blind: another tenant's run is flagged
    assert report.control_problems and report.control_problems > 0
    assert report.control_metric_rel_diff > 100 * report.max_metric_rel_diff
    # the tenants did share engine batches (the point of the exercise)
    assert sum(report.mixed_batches.values()) > 0, report.mixed_batches
    for call in CALLS:
        expected = 4 if call == "create" else 12
        assert report.latency_ms[call]["n"] == expected
        assert report.latency_ms[call]["p50"] <= report.latency_ms[call]["p99"]
