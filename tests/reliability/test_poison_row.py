"""Issue 34, item 1: hostile sampling parameters in the same engine steps as other tenants'
samples fail none of them, change none of their tokens, and are never a server error."""

from __future__ import annotations

from tests.reliability.poison_row import run_poison_row


def test_one_bad_request_fails_no_other_tenant(tmp_path):
    out = run_poison_row(
        tmp_path, victims=2, requests_per_victim=2, max_tokens=12, log=lambda _m: None
    )
    assert out["poison_row_failed_others"] == 0, out["failures"]
    assert out["poison_row_solo_diffs"] == 0
    assert out["poison_row_attacker_5xx"] == 0, out["attacker_statuses"]
    assert out["attacker_statuses"].count(400) == 6  # the three refused values, both routes
