"""What a key reads about tenants on a shared server. `GET /api/v1/lorafleet/stats`: a tenant
sees the server-wide counts and its own fair-share entries, never another tenant's name, queue
or deficit; an operator sees all. `GET /api/v1/lorafleet/usage?tenant=`: an operator's typo is
a 404 naming it, not a report of zeros."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import tinker

from lorafleet.server.main import ServerThread
from tests.server.conftest import KEY_A, KEY_B, sl_datum, wait_pending
from tests.server.tenant_files import tenants_server_config, write_tenants

KEY_OP = "tml-operator-0123456789abcdef"


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Iterator[ServerThread]:
    root = tmp_path_factory.mktemp("stats-privacy")
    tenants = write_tenants(
        root / "tenants.toml",
        {
            "alice": {"keys": [KEY_A]},
            "bob": {"keys": [KEY_B], "weight": 2},
            "ops": {"keys": [KEY_OP], "operator": True},
        },
    )
    server = ServerThread(tenants_server_config(root / "data", tenants))
    yield server
    server.stop()


def _stats(server: ServerThread, key: str) -> httpx.Response:
    response = httpx.get(
        f"{server.base_url}/api/v1/lorafleet/stats", headers={"X-API-Key": key}, timeout=30
    )
    response.raise_for_status()
    return response


def test_a_tenant_sees_only_its_own_fair_share_entries(shared):
    base = str(shared.service.executor.base_path)
    bob = tinker.ServiceClient(base_url=shared.base_url, api_key=KEY_B)
    try:
        tc = bob.create_lora_training_client(base_model=base, rank=4, seed=1).result()
        tc.forward_backward([sl_datum([3, 4, 5, 6])], "cross_entropy").result()
        shared.service.scheduler.pause()
        try:
            queued = tc.forward_backward([sl_datum([3, 4, 5, 6, 7])], "cross_entropy")
            wait_pending(shared, 1)
            as_alice, as_bob, as_ops = (_stats(shared, k) for k in (KEY_A, KEY_B, KEY_OP))
        finally:
            shared.service.scheduler.resume()
        queued.result()
    finally:
        bob.close("success").result(timeout=30)

    assert "bob" not in as_alice.text  # not its name, queue, deficit or waits
    alice = as_alice.json()
    assert alice["fair_share"]["tenants"] == {} and alice["train_wait_rounds"] == {}
    assert alice["pending_ops"] == 1  # the server-wide counts stay
    mine = as_bob.json()
    assert mine["fair_share"]["tenants"]["bob"]["queued_ops"] == 1
    assert set(mine["train_wait_rounds"]) == {"bob"}
    everyone = as_ops.json()
    assert everyone["fair_share"]["tenants"]["bob"]["weight"] == 2.0
    assert "bob" in everyone["train_wait_rounds"]


def test_an_operator_asking_for_an_unknown_tenant_gets_404_not_zeros(shared):
    def usage(tenant: str) -> httpx.Response:
        return httpx.get(
            f"{shared.base_url}/api/v1/lorafleet/usage",
            headers={"X-API-Key": KEY_OP},
            params={"tenant": tenant},
            timeout=30,
        )

    for typo in ("alcie", "../x", ""):
        reply = usage(typo)
        assert reply.status_code == 404, reply.text
        assert repr(typo) in reply.json()["error"]
    assert usage("alice").status_code == 200  # in the tenants file, even without usage yet
