"""Security: keys on every route, 404 isolation, body limits, file modes, names confined to the
data dir, loopback by default."""

from __future__ import annotations

from tests.reliability.security import WRONG_KEYS, run_security


def test_security_battery(tmp_path):
    report = run_security(tmp_path)
    assert report.routes >= 25
    assert report.auth_probes == report.routes * len(WRONG_KEYS)
    assert report.auth_bypasses == 0, report.failures
    assert report.isolation_probes >= 25
    assert report.isolation_leaks == 0 and report.forbidden_403 == 0, report.failures
    assert report.message_leaks == 0 and report.owner_denied == 0, report.failures
    assert report.limit_failures == 0, report.limit_checks
    assert report.permission_problems == []
    assert report.escaped_files == []
    assert report.loopback["ok"], report.loopback
