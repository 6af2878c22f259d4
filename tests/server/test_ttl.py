"""Checkpoint TTLs are enforced (the outside tester's `ttl_seconds: 2` checkpoint was still
listed and still loaded 65 s later): an expired checkpoint is refused everywhere at once, as
not found, listed with its past `expires_at` until maintenance deletes it (files, row and
published sampler version) within its interval, on an idle server too."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from tinker import types

from lorafleet.sample import UnknownVersionError
from lorafleet.server.main import ServerThread
from lorafleet.server.service import Service
from tests.server.conftest import KEY_A, server_config, sl_datum

TTL_S = 2
MAINTENANCE_S = 0.5
PROMPT = types.ModelInput.from_ints([7, 14, 21])
GREEDY = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
Refused = (tinker.NotFoundError, tinker.RequestFailedError)


@pytest.fixture(scope="module")
def ttl_server(tmp_path_factory) -> Iterator[ServerThread]:
    config = server_config(
        tmp_path_factory.mktemp("ttl-data"), maintenance_interval_s=MAINTENANCE_S
    )
    server = ServerThread(config)
    yield server
    server.stop()


@pytest.fixture
def client(ttl_server: ServerThread) -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=ttl_server.base_url, api_key=KEY_A)
    yield sc
    sc.close("success").result(timeout=30)


def _trained(ttl_server: ServerThread, client: tinker.ServiceClient) -> tinker.TrainingClient:
    base_model = str(ttl_server.service.executor.base_path)
    tc = client.create_lora_training_client(base_model=base_model, rank=4, seed=5).result()
    tc.forward_backward([sl_datum([3, 6, 9, 12, 15])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return tc


def _on_disk(ttl_server: ServerThread, tinker_path: str) -> Path:
    row = ttl_server.service.store.checkpoints.get(tinker_path)
    assert row is not None
    return Path(row.dir)


def test_an_expired_checkpoint_is_refused_everywhere_before_maintenance(ttl_server, client):
    service = ttl_server.service
    tc = _trained(ttl_server, client)
    run = tc.model_id
    rest = tinker.RestClient(base_url=ttl_server.base_url, api_key=KEY_A)
    with service._maintenance_lock:  # maintenance cannot run: the refusal alone is tested
        state = tc.save_state("ttl-state", ttl_seconds=TTL_S).result().path
        sampler_path = tc.save_weights_for_sampler("ttl-sampler", ttl_seconds=TTL_S).result().path
        keep = tc.save_state("ttl-keep").result().path
        sampler = client.create_sampling_client(model_path=sampler_path).result()
        sampler.sample(PROMPT, 1, GREEDY).result()
        listed = {c.tinker_path: c for c in rest.list_checkpoints(run).result().checkpoints}
        assert listed[state].expires_at is not None and listed[keep].expires_at is None
        time.sleep(max(0.0, listed[state].expires_at.timestamp() - time.time()) + 0.2)

        # listed until maintenance deletes them, with their past expires_at
        listed = {c.tinker_path: c for c in rest.list_checkpoints(run).result().checkpoints}
        assert set(listed) == {state, sampler_path, keep}
        for path in (state, sampler_path):
            assert listed[path].expires_at.timestamp() <= time.time()
        mine = rest.list_user_checkpoints(limit=1000).result()
        assert {c.tinker_path for c in mine.checkpoints} >= {state, sampler_path}
        assert rest.get_training_run(run).result().last_sampler_checkpoint is None
        for call in (
            lambda: client.create_training_client_from_state(state).result(),
            lambda: tc.load_state(state).result(),
            lambda: rest.get_weights_info_by_tinker_path(state).result(),
            lambda: client.create_sampling_client(model_path=sampler_path).result(),
            lambda: sampler.sample(PROMPT, 1, GREEDY).result(),  # a session made before expiry
            lambda: rest.set_checkpoint_ttl_from_tinker_path(state, 3600).result(),  # no revival
        ):
            with pytest.raises(Refused, match=r"tinker://\S+ has expired"):
                call()
        assert _on_disk(ttl_server, state).is_dir()  # refused, not yet deleted
    client.create_training_client_from_state(keep).result()


def test_maintenance_deletes_an_expired_checkpoint_on_an_idle_server(ttl_server, client):
    service = ttl_server.service
    tc = _trained(ttl_server, client)
    state = tc.save_state("ttl-idle-state", ttl_seconds=TTL_S).result().path
    sampler_path = tc.save_weights_for_sampler("ttl-idle-sampler", ttl_seconds=TTL_S).result().path
    files = [_on_disk(ttl_server, state), _on_disk(ttl_server, sampler_path)]
    service.executor.versions.info((sampler_path, 0))  # published at save
    expires = service.store.checkpoints.get(state).expires_at
    deadline = expires + MAINTENANCE_S + 10.0
    while any(f.exists() for f in files) and time.time() < deadline:
        time.sleep(0.05)  # no requests: only the maintenance thread can delete them
    gone_after_s = time.time() - expires
    assert not any(f.exists() for f in files), f"still there {gone_after_s:.1f} s after expiry"
    assert service.store.checkpoints.get(state) is None
    assert service.store.checkpoints.get(sampler_path) is None
    with pytest.raises(UnknownVersionError):
        service.executor.versions.info((sampler_path, 0))
    assert gone_after_s < MAINTENANCE_S + 5.0
    assert service.maintenance_failures == 0


def test_the_owner_may_delete_an_expired_checkpoint_before_maintenance(ttl_server, client):
    """Before: the delete answered 404 "has expired", and the name stayed taken ("already
    exists") until maintenance came round; the owner could neither delete nor reuse it."""
    service = ttl_server.service
    tc = _trained(ttl_server, client)
    rest = tinker.RestClient(base_url=ttl_server.base_url, api_key=KEY_A)
    with service._maintenance_lock:  # maintenance cannot run: only the owner deletes it
        state = tc.save_state("ttl-owner-delete", ttl_seconds=1).result().path
        files = _on_disk(ttl_server, state)
        time.sleep(service.store.checkpoints.get(state).expires_at - time.time() + 0.1)
        rest.delete_checkpoint_from_tinker_path(state).result()
        assert service.store.checkpoints.get(state) is None and not files.exists()
        assert tc.save_state("ttl-owner-delete").result().path == state  # the name is free


def test_maintenance_runs_often_enough_for_a_minute(ttl_server):
    """The default interval deletes a checkpoint within about a minute of its expiry."""
    assert server_config(ttl_server.config.data_dir).maintenance_interval_s <= 60.0


@pytest.mark.parametrize("interval", [0, -1.0, float("nan"), float("inf")])
def test_a_maintenance_interval_that_is_not_a_positive_time_is_refused(tmp_path, interval):
    with pytest.raises(ValueError, match=f"maintenance_interval_s .* got {interval!r}"):
        Service(server_config(tmp_path / "data", maintenance_interval_s=interval))
    assert not (tmp_path / "data").exists()  # refused before anything was made
