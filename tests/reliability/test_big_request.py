"""Big requests: a sample request at the caps stays within its memory budget, and requests over
the caps are refused before any work (see tests/reliability/big_request.py)."""

from __future__ import annotations

from tests.reliability.big_request import run_big_request

SMALL_CAPS = {"max_response_bytes": 512 << 10}


def test_a_request_at_the_caps_is_served_and_one_over_them_is_refused(tmp_path):
    report = run_big_request(tmp_path, overrides=SMALL_CAPS, max_tokens=64)
    assert report["problems"] == [] and report["over_cap_refused"], report
    assert report["complete"], report
    shape = report["shape"]
    assert shape["topk"] == report["limits"]["max_topk_logprobs"]
    # the largest request the budget allows: one more sample would not fit
    assert report["estimated_response_bytes"] <= SMALL_CAPS["max_response_bytes"]
    per_sample = report["estimated_response_bytes"] // shape["num_samples"]
    assert report["estimated_response_bytes"] + per_sample > SMALL_CAPS["max_response_bytes"]
    assert report["peak_rss_growth_mb"] <= 200, report
    assert report["refused_growth_mb"] <= 16, report
    assert set(report["refusals"]) == {
        "topk_sample_logprobs",
        "bytes",
        "user_metadata_keys",
        "user_metadata_bytes",
    }
