"""Issue 34, item 5: concurrent copies and samples against one tenant's storage and token
quotas; the quotas reserve at admission, so exactly `room` of each pass and nothing overshoots
(on the code before, 20 concurrent copies stored three times the limit)."""

from __future__ import annotations

from tests.reliability.quota_race import run_quota_race


def test_concurrent_requests_do_not_overshoot_quotas(tmp_path):
    out = run_quota_race(
        tmp_path, copies=12, samples=12, room=2, max_tokens=16, log=lambda _m: None
    )
    assert out["unexpected"] == []
    assert out["quota_overshoot_bytes"] == 0 and out["quota_overshoot_tokens"] == 0
    assert out["copies_ok"] == 2 and out["copies_refused"] == 10
    assert out["samples_ok"] == 2 and out["samples_refused"] == 10
    assert out["sampled_tokens"] == 2 * 16
