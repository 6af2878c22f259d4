"""Quotas that 0 would make meaningless are refused at load, naming the line: `queued_ops = 0`
answered every request of the tenant with 429, which the tinker SDK retries for minutes
instead of failing; `resident_runs = 0` cannot hold (a run trains only in a slot)."""

from __future__ import annotations

import pytest

from lorafleet.server.state.tenants import TenantsFileError, parse_tenants
from tests.server.tenant_files import key_hash


@pytest.mark.parametrize("quota", ["queued_ops", "resident_runs"])
def test_a_quota_that_needs_at_least_one_refuses_zero(quota):
    text = (
        f'[tenants.alice]\nkey_sha256 = ["{key_hash("tml-a-0123456789")}"]\n'
        f"[tenants.alice.quotas]\nregistered_runs = 0\n{quota} = 0\n"
    )
    with pytest.raises(
        TenantsFileError, match=rf"line 5: \[tenants.alice.quotas\] {quota}: .*>= 1"
    ):
        parse_tenants(text, "tenants.toml")
    ok = parse_tenants(text.replace(f"{quota} = 0", f"{quota} = 1"), "tenants.toml")
    assert getattr(ok.quotas("alice"), quota) == 1
    assert ok.quotas("alice").registered_runs == 0  # 0 still shuts out what it counts
