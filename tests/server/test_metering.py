"""Metering (issue 22, item 5): what each tenant and run used, counted from the requests the
real SDK sends, read back by the tenant (its own only) and by an operator (everyone's, and
Prometheus text at /metrics), kept in SQLite across a restart."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from lorafleet.server.main import ServerThread
from lorafleet.server.ops.metering import COUNTERS, utc_day
from tests.server.conftest import KEY_A, KEY_B, sl_datum
from tests.server.tenant_files import tenants_server_config, write_tenants

KEY_OP = "tml-operator-0123456789abcdef"
TENANTS = {
    "alice": {"keys": [KEY_A]},
    "bob": {"keys": [KEY_B]},
    "ops": {"keys": [KEY_OP], "operator": True},
}
FLUSH_S = 0.2


class Servers:
    """The module's server, restarted in place by the restart test."""

    def __init__(self, root: Path):
        self.tenants = write_tenants(root / "tenants.toml", TENANTS)
        self.data = root / "data"
        self.server = self.start()
        self.model_id = ""
        self.expected: dict[str, float] = {}

    def start(self) -> ServerThread:
        # a round of at most 6 tokens, alone too: the 10-token call below runs in two chunks
        config = tenants_server_config(
            self.data,
            self.tenants,
            usage_flush_s=FLUSH_S,
            round_token_budget=6,
            solo_round_token_budget=0,
        )
        return ServerThread(config)

    def usage(self, key: str, **params: str) -> httpx.Response:
        return httpx.get(
            f"{self.server.base_url}/api/v1/lorafleet/usage",
            headers={"X-API-Key": key},
            params=params,
        )


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[Servers]:
    servers = Servers(tmp_path_factory.mktemp("metering"))
    yield servers
    servers.server.stop()


def test_usage_counts_the_tokens_steps_and_time_of_the_requests(servers):
    server = servers.server
    base = str(server.service.executor.base_path)
    client = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A)
    try:
        tc = client.create_lora_training_client(base_model=base, rank=4, seed=2).result()
        servers.model_id = tc.model_id
        two = [sl_datum(list(range(3, 9))), sl_datum(list(range(20, 26)))]  # 5 + 5 inputs
        split = server.service.scheduler.stats.split_ops
        tc.forward_backward(two, "cross_entropy").result()
        assert server.service.scheduler.stats.split_ops == split + 1  # counted once all the same
        tc.forward([sl_datum([4, 5, 6, 7, 8])], "cross_entropy").result()  # 4 inputs
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = client.create_sampling_client(base_model=base).result()
        out = sampler.sample(
            types.ModelInput.from_ints([5, 6, 7]),
            2,
            types.SamplingParams(max_tokens=4, temperature=0.0, stop=[]),
        ).result()
        assert sum(len(s.tokens) for s in out.sequences) == 8
        time.sleep(3 * FLUSH_S)  # resident time is collected at each flush
    finally:
        client.close("success").result(timeout=30)

    mine = servers.usage(KEY_A).json()
    assert mine["tenant"] == "alice"
    run, totals = mine["runs"][tc.model_id], mine["totals"]
    assert run["trained_tokens"] == 10 and run["prefill_tokens"] == 4
    assert run["optimizer_steps"] == 1 and run["compute_seconds"] > 0
    assert run["resident_adapter_seconds"] > 0
    assert mine["runs"][""]["sampled_tokens"] == 8  # the base model: no run
    assert mine["runs"][""]["prefill_tokens"] == 3
    assert totals["trained_tokens"] == 10 and totals["prefill_tokens"] == 7
    assert totals["sampled_tokens"] == 8 and totals["optimizer_steps"] == 1
    today = mine["days"][utc_day(time.time())]
    assert today["totals"]["trained_tokens"] == 10
    assert today["runs"][tc.model_id]["optimizer_steps"] == 1
    servers.expected = {k: totals[k] for k in ("trained_tokens", "sampled_tokens")}

    theirs = servers.usage(KEY_B).json()
    assert theirs["tenant"] == "bob" and theirs["totals"] == dict.fromkeys(COUNTERS, 0.0)


def test_a_tenant_reads_only_its_own_usage_and_an_operator_everyones(servers):
    for key, who in ((KEY_B, "alice"), (KEY_A, "*")):
        refused = servers.usage(key, tenant=who)
        assert refused.status_code == 403 and "operator" in refused.json()["error"]
    everyone = servers.usage(KEY_OP, tenant="*").json()["tenants"]
    assert {"alice", "bob", "ops"} <= set(everyone)
    assert everyone["alice"]["totals"]["trained_tokens"] == 10
    assert servers.usage(KEY_OP, tenant="alice").json()["totals"]["sampled_tokens"] == 8
    assert servers.usage(KEY_A, days="0").status_code == 400


def test_metrics_are_prometheus_text_for_operators_only(servers):
    url = f"{servers.server.base_url}/metrics"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"X-API-Key": KEY_A}).status_code == 403
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 403
    # a Prometheus scrape config sends the key as a bearer token
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY_OP}"}).status_code == 200
    reply = httpx.get(url, headers={"X-API-Key": KEY_OP})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(reply.text)
        for s in family.samples
    }
    usage = "lorafleet_usage_total"
    assert samples[(usage, (("counter", "trained_tokens"), ("tenant", "alice")))] == 10
    assert samples[(usage, (("counter", "sampled_tokens"), ("tenant", "alice")))] == 8
    assert samples[(usage, (("counter", "trained_tokens"), ("tenant", "bob")))] == 0
    assert samples[("lorafleet_max_queued_ops", ())] == servers.server.config.max_queued_ops


def test_checkpoint_storage_is_reported_and_given_back_on_deletion(servers):
    server = servers.server
    client = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_B)
    try:
        tc = client.create_lora_training_client(
            base_model=str(server.service.executor.base_path), rank=4
        ).result()
        path = tc.save_weights_for_sampler("metered").result().path
        size = server.service.store.checkpoints.get(path).size_bytes
        stored = servers.usage(KEY_B).json()["storage"]
        assert size > 0 and stored == {"checkpoint_bytes": size, "runs": {tc.model_id: size}}
        tinker.RestClient(
            base_url=server.base_url, api_key=KEY_B
        ).delete_checkpoint_from_tinker_path(path).result()
        assert servers.usage(KEY_B).json()["storage"]["checkpoint_bytes"] == 0
    finally:
        client.close("success").result(timeout=30)


def test_usage_survives_a_restart(servers):
    servers.server.stop()  # flushes what is still in memory
    servers.server = servers.start()
    totals = servers.usage(KEY_A).json()["totals"]
    for counter, value in servers.expected.items():
        assert totals[counter] == value
    runs = servers.usage(KEY_A).json()["runs"]
    assert runs[servers.model_id]["optimizer_steps"] == 1
