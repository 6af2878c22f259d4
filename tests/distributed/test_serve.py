"""`lorafleet serve --trainer-ranks 2` and `--ray`: the Tinker API is unchanged for the SDK."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import httpx
import pytest
from tinker import types

from lorafleet.distributed.placement import DistConfig
from lorafleet.sample.canary_probe import version_name
from lorafleet.server.main import ServerThread
from tests.server.conftest import KEY_A, connect, server_config, sl_datum

TEXT = [5, 17, 33, 8, 90, 41, 12, 77, 230, 19, 64, 103, 250, 11, 9, 301]


def dist_server(tmp_path, dist: DistConfig) -> ServerThread:
    config = server_config(tmp_path)
    engine = dataclasses.replace(config.engine, max_adapters=4, sampler_slots=4, dist=dist)
    return ServerThread(dataclasses.replace(config, engine=engine))


def sdk_round_trip(server: ServerThread) -> None:
    """SL steps lower the loss, the trained adapter samples, and a saved state resumes."""
    base_model = str(server.service.executor.base_path)
    sc = connect(server, KEY_A)
    try:
        tc = sc.create_lora_training_client(base_model=base_model, rank=8, seed=0).result()
        data = [sl_datum(TEXT), sl_datum(TEXT[5:] + TEXT[:5])]
        losses = []
        for _ in range(4):
            fwd = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
            losses.append(fwd.result().metrics["loss:sum"])
        assert losses[-1] < 0.9 * losses[0], losses
        sampler = tc.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=1, stop=[])
        response = sampler.sample(
            types.ModelInput.from_ints(TEXT[:4]), num_samples=2, sampling_params=params
        ).result()
        assert [len(s.tokens) for s in response.sequences] == [6, 6]
        path = tc.save_state("ckpt").result().path
        loss = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
        resumed = sc.create_training_client_from_state_with_optimizer(path).result()
        assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
            loss, rel=1e-6
        )
    finally:
        sc.close("success").result(timeout=30)


@pytest.fixture
def torchrun_server(tmp_path, one_torch_thread) -> Iterator[ServerThread]:
    server = dist_server(tmp_path, DistConfig(trainer_ranks=2, torch_threads=1))
    yield server
    server.stop()


def test_serve_with_two_trainer_ranks(torchrun_server):
    assert torchrun_server.service.executor.trainer.world == 2
    sdk_round_trip(torchrun_server)


def test_serve_on_ray_with_two_sampler_replicas(ray_cluster, tmp_path, one_torch_thread):
    server = dist_server(
        tmp_path, DistConfig(trainer_ranks=1, ray="auto", sampler_replicas=2, torch_threads=1)
    )
    try:
        pool = server.service.executor.sampler
        sdk_round_trip(server)
        # every version the server published reached both replicas
        keys = set(pool.versions.resident())
        assert keys and all(keys <= set(pool.known_on(i)) for i in range(2))
        check_replicas_reported(server, ray_cluster, {version_name(k) for k in keys})
    finally:
        server.stop()


def healthz(server: ServerThread) -> tuple[int, dict[str, str]]:
    response = httpx.get(f"{server.base_url}/api/v1/healthz", timeout=10)
    return response.status_code, response.json()


def check_replicas_reported(server: ServerThread, ray, versions: set[str]) -> None:
    """The stats and /healthz report the Ray replicas themselves (not an in-process sampler):
    each one's state, where it runs and the versions it holds; a replica whose actor is killed
    shows as not healthy and /healthz as degraded until it is back."""
    pool = server.service.executor.sampler
    rollout = server.service.stats()["rollout"]  # the operator's view
    assert rollout["engine"] == "ray" and rollout["sync"] == "tensor"
    assert [r["name"] for r in rollout["replicas"]] == ["sampler replica 0", "sampler replica 1"]
    for replica in rollout["replicas"]:
        assert replica["state"] == "healthy" and replica["url"].startswith("ray actor on ")
        assert set(replica["versions"]) == versions and replica["restarts"] == 0
    # a tenant reads each replica's state and how many versions it holds
    shown = httpx.get(
        f"{server.base_url}/api/v1/lorafleet/stats", headers={"X-API-Key": KEY_A}, timeout=30
    ).json()
    assert [(r["state"], r["versions"]) for r in shown["rollout"]["replicas"]] == [
        ("healthy", len(versions))
    ] * 2
    assert server.service.stats()["prefix_cache"]["max_bytes"] > 0  # the replicas', summed
    assert shown["prefix_cache"]["enabled"] and "max_bytes" not in shown["prefix_cache"]
    assert healthz(server) == (200, {"status": "ok", "engine": "ok", "disk": "ok", "rollout": "ok"})

    ray.kill(pool.replica_handle(1), no_restart=True)
    deadline = time.monotonic() + 120
    while (answer := healthz(server))[1]["rollout"] == "ok":  # found by the liveness check
        assert time.monotonic() < deadline, "/healthz never noticed the killed replica"
        time.sleep(0.1)
    assert answer == (
        200,
        {"status": "degraded", "engine": "ok", "disk": "ok", "rollout": "degraded"},
    )
    down = server.service.stats()["rollout"]["replicas"]
    assert down[0]["state"] == "healthy"
    assert down[1]["state"] in ("restarting", "unhealthy") and down[1]["error"], down[1]
    pool.wait_ready(timeout_s=300)
    assert healthz(server)[1]["rollout"] == "ok"
    back = server.service.stats()["rollout"]["replicas"][1]
    assert back["state"] == "healthy" and back["restarts"] == 1 and back["error"] is None
    assert set(back["versions"]) == versions and back["url"] != rollout["replicas"][1]["url"]
