"""A tenant's console lists the rollout replicas, but not what they did for other tenants: a
replica's last canary names the version it checked (`<run>@<version>`), and another tenant's
is shown without that name, as `/api/v1/lorafleet/stats` shows it to a tenant."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from lorafleet.server.console.views import ConsoleViews
from lorafleet.server.state.keys import Tenant, hash_key
from lorafleet.server.state.store import ModelRow, Store
from lorafleet.server.state.tenants import Tenancy, TenantsConfig, TenantSpec


def _canary(version: str) -> dict[str, Any]:
    return {"version": version, "ok": True, "max_abs_diff": 0.001, "at": 1.0}


def test_another_tenants_canary_version_is_not_shown(tmp_path: Path):
    store = Store(tmp_path / "state.db")
    now = time.time()
    store.models.add(
        ModelRow("mine:train:0", "a", "s", "tiny-qwen3", 4, {}, None, now, now, "active")
    )
    replicas = [
        {
            "name": "r0",
            "versions": ["theirs:train:0@3"],
            "last_canary": _canary("theirs:train:0@3"),
        },
        {"name": "r1", "versions": ["mine:train:0@1"], "last_canary": _canary("mine:train:0@1")},
    ]
    stats = {"rollout": {"engine": "vllm", "sync": "files", "replicas": replicas}}
    tenancy = Tenancy(
        TenantsConfig.from_specs([TenantSpec("a", (hash_key("tml-a-0123456789"),))], "t")
    )
    sources = SimpleNamespace(
        store=store,
        usage=SimpleNamespace(report=lambda *_: {"totals": {}}),
        tenancy=tenancy,
        run_ops=lambda _tenant: {},
        run_tiers=lambda _tenant: {},
        stats=lambda: stats,
    )
    shown = ConsoleViews(cast(Any, sources)).overview(Tenant("a"))["rollout"]["replicas"]
    assert [r["versions"] for r in shown] == [[], ["mine:train:0@1"]]
    assert shown[0]["last_canary"] == {"ok": True, "max_abs_diff": 0.001, "at": 1.0}
    assert shown[1]["last_canary"] == _canary("mine:train:0@1")  # its own run: all of it
    assert "theirs" not in repr(shown)
