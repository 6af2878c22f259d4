"""Quotas (issue 22, item 4): a request over one is refused with 403, through the real SDK,
naming the quota, the limit and the usage, and changes nothing; within the quota it works.
Each quota belongs to its own tenant here, so that the tests do not spend each other's."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import tinker
from tinker import types

from lorafleet.server.main import ServerThread
from tests.server.conftest import sl_datum
from tests.server.tenant_files import tenants_server_config, write_tenants

KEYS = {
    name: f"tml-quota-{name}-0123456789abcdef"
    for name in ("rank", "runs", "trained", "sampled", "storage")
}
QUOTAS = {
    "rank": {"max_lora_rank": 8},
    "runs": {"registered_runs": 2},
    "trained": {"trained_tokens_per_day": 20},
    "sampled": {"sampled_tokens_per_day": 20},
    "storage": {"storage_bytes": 1},
}
Refused = tinker.PermissionDeniedError


@pytest.fixture(scope="module")
def quota_server(tmp_path_factory) -> Iterator[ServerThread]:
    root = tmp_path_factory.mktemp("quotas")
    path = write_tenants(
        root / "tenants.toml",
        {name: {"keys": [KEYS[name]], "quotas": QUOTAS[name]} for name in KEYS},
    )
    server = ServerThread(tenants_server_config(root / "data", path))
    yield server
    server.stop()


@pytest.fixture
def connect(quota_server) -> Iterator:
    clients: list[tinker.ServiceClient] = []

    def make(name: str) -> tinker.ServiceClient:
        clients.append(tinker.ServiceClient(base_url=quota_server.base_url, api_key=KEYS[name]))
        return clients[-1]

    yield make
    for client in clients:
        client.close("success").result(timeout=30)


def _base(server: ServerThread) -> str:
    return str(server.service.executor.base_path)


def _models(server: ServerThread, tenant: str) -> int:
    return server.service.store.models.page(tenant, 100, 0)[1]


def test_a_rank_over_max_lora_rank_is_refused_at_create(quota_server, connect):
    client = connect("rank")
    with pytest.raises(Refused, match=r"quota max_lora_rank .* limit 8, used 16") as caught:
        client.create_lora_training_client(base_model=_base(quota_server), rank=16).result()
    assert caught.value.status_code == 403
    assert _models(quota_server, "rank") == 0  # nothing was created
    client.create_lora_training_client(base_model=_base(quota_server), rank=8).result()


def test_registered_runs_past_the_quota_are_refused(quota_server, connect):
    client = connect("runs")
    for seed in (1, 2):
        client.create_lora_training_client(
            base_model=_base(quota_server), rank=4, seed=seed
        ).result()
    with pytest.raises(
        Refused, match=r"quota registered_runs .* limit 2, used 2, this request needs 1"
    ):
        client.create_lora_training_client(base_model=_base(quota_server), rank=4).result()
    assert _models(quota_server, "runs") == 2


def test_trained_tokens_per_day_refuse_the_call_that_would_pass_them(quota_server, connect):
    service = quota_server.service
    tc = (
        connect("trained")
        .create_lora_training_client(base_model=_base(quota_server), rank=4)
        .result()
    )
    tc.forward_backward([sl_datum(list(range(3, 15)))], "cross_entropy").result()  # 11 tokens
    ran = service.scheduler.stats.requests["forward_backward"]
    with pytest.raises(
        Refused,
        match=r"quota trained_tokens_per_day .* limit 20, used 11 today, this request needs 11",
    ) as caught:
        tc.forward_backward([sl_datum(list(range(3, 15)))], "cross_entropy").result()
    assert caught.value.response.headers["retry-after"].isdigit()  # seconds to 00:00 UTC
    assert service.metering.today("trained", "trained_tokens") == 11
    # the refusal took its seq_id's place: the next call runs at once, not after a gap timeout
    began = time.monotonic()
    tc.forward_backward([sl_datum(list(range(3, 12)))], "cross_entropy").result()  # 8 tokens
    assert time.monotonic() - began < 10
    assert service.metering.today("trained", "trained_tokens") == 19
    # the refused call never reached the engine: only the two accepted ones ran
    assert service.scheduler.stats.requests["forward_backward"] == ran + 1


def test_sampled_tokens_per_day_bound_a_sample_by_its_max_tokens(quota_server, connect):
    client = connect("sampled")
    sampler = client.create_sampling_client(base_model=_base(quota_server)).result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    with pytest.raises(
        Refused,
        match=r"quota sampled_tokens_per_day .* limit 20, used 0 today, this request needs 32",
    ):
        sampler.sample(prompt, 2, types.SamplingParams(max_tokens=16, stop=[])).result()
    out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=8, stop=[])).result()
    assert [len(s.tokens) for s in out.sequences] == [8, 8]
    with pytest.raises(Refused, match=r"used 16 today, this request needs 8"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, stop=[])).result()


def test_storage_bytes_refuse_a_save_and_a_deletion_gives_them_back(quota_server, connect):
    client = connect("storage")
    tc = client.create_lora_training_client(base_model=_base(quota_server), rank=4).result()
    first = tc.save_state("first").result().path  # nothing stored yet: within the quota
    store = quota_server.service.store
    stored = sum(size for _t, _r, size in store.checkpoints.bytes_per_run("storage"))
    assert stored > 1
    with pytest.raises(
        Refused, match=rf"quota storage_bytes .* limit 1, used {stored} in checkpoints"
    ):
        tc.save_state("second").result()
    assert [c.name for c in store.checkpoints.page("storage")[0]] == ["first"]
    rest = tinker.RestClient(base_url=quota_server.base_url, api_key=KEYS["storage"])
    with pytest.raises(Refused, match=rf"quota storage_bytes .* used {stored} .* needs {stored}"):
        rest.copy_weights(first, "archive").result()  # a copy is a checkpoint too
    rest.delete_checkpoint_from_tinker_path(first).result()
    assert store.checkpoints.bytes_per_run("storage") == []
    tc.save_state("third").result()  # the deletion gave the bytes back
