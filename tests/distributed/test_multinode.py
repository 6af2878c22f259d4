"""`lorafleet serve --ray` on a real two-node Ray cluster built on this machine.

`ray start --head` (resource `lorafleet_trainer`) plus a second `ray start --address ...`
(resource `lorafleet_sampler`): each node is its own raylet with its own resources, as on two
machines. The server, started as a command, puts its trainer rank on the first node and its
sampler replica on the second (`--trainer-resource`, `--sampler-resource`). Through the SDK: a
trained version is published across nodes and verified by the canary on the replica; then the
sampler node is killed (every process of it at once). The server notices without a request
(the pool's health check), replaces the replica on the surviving node, re-syncs and
re-verifies the version there, and the same seeded request samples the same tokens. A newer
version published afterwards reaches the new replica and passes its canary.

Slow (a minute or two on 2 cores: two Ray nodes, three processes loading the base). Skipped,
with the reason, where Ray or its `ray` command is missing or a second node cannot start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("ray")

from tests.distributed._ray_nodes import RAY, LocalCluster, free_port

pytestmark = pytest.mark.slow

KEY = "tml-multinode-0123456789abcdef"
TRAINER, SAMPLER = "lorafleet_trainer", "lorafleet_sampler"
TEXT = [5, 17, 33, 8, 90, 41, 12, 77, 230, 19, 64, 103, 250, 11, 9, 301]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[LocalCluster, dict[str, str]]]:
    if not RAY.exists():
        pytest.skip(f"Ray's `ray` command is not installed beside {sys.executable}")
    cluster = LocalCluster(tmp_path_factory.mktemp("two-nodes"))
    try:
        cluster.start_head({TRAINER: 1}, num_cpus=2)
        cluster.wait_for_nodes(1)  # a head that does not start is a failure, not a skip
        cluster.add_node("sampler-node", {SAMPLER: 1}, num_cpus=2)
        try:
            nodes = cluster.wait_for_nodes(2)
        except RuntimeError as exc:
            pytest.skip(f"Ray could not start a second node on this machine: {exc}")
        yield cluster, nodes
    finally:
        cluster.stop()


def _stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/api/v1/lorafleet/stats", headers={"X-API-Key": KEY}, timeout=30).json()


def _wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"lorafleet serve exited:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"lorafleet serve not ready:\n{log.read_text()[-4000:]}")
        time.sleep(1)


@pytest.fixture(scope="module")
def server(cluster, tmp_path_factory) -> Iterator[str]:
    ray_cluster, _ = cluster
    root = tmp_path_factory.mktemp("multinode-server")
    keys = root / "keys"
    keys.write_text(KEY + "\n")
    keys.chmod(0o600)
    port = free_port()
    log = root / "serve.log"
    env = {
        **ray_cluster.env(),
        "LORAFLEET_CACHE": os.environ.get("LORAFLEET_CACHE", ""),
        "TINKER_TELEMETRY": "0",
    }
    command = [
        sys.executable,
        "-m",
        "lorafleet.cli",
        "serve",
        "--base-model=tiny-qwen3",
        f"--data-dir={root / 'data'}",
        f"--api-key-file={keys}",
        f"--port={port}",
        "--device=cpu",
        "--dtype=float32",
        f"--ray={ray_cluster.address}",
        "--trainer-ranks=1",
        "--sampler-replicas=1",
        f"--trainer-resource={TRAINER}",
        f"--sampler-resource={SAMPLER}",
        "--torch-threads=1",
        "--max-adapters=2",
        "--sampler-slots=4",
        "--max-lora-rank=8",
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process, log, timeout_s=300)
        yield url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


def _replica(url: str) -> dict[str, Any]:
    (replica,) = _stats(url)["rollout"]["replicas"]
    return replica


def test_trainer_and_sampler_on_two_nodes_survive_losing_the_sampler_node(cluster, server):
    import tinker
    from tinker import types

    from tests.server.conftest import sl_datum

    ray_cluster, nodes = cluster
    stats = _stats(server)
    assert stats["rollout"]["engine"] == "ray"
    trainer_nodes = stats["device"]["trainer_nodes"]
    assert [n["node_id"] for n in trainer_nodes] == [nodes[TRAINER]]
    replica = _replica(server)
    assert replica["state"] == "healthy" and replica["node"]["node_id"] == nodes[SAMPLER]

    sc = tinker.ServiceClient(base_url=server, api_key=KEY)
    try:
        tc = sc.create_lora_training_client(base_model="tiny-qwen3", rank=8, seed=0).result()

        def step() -> None:
            tc.forward_backward([sl_datum(TEXT), sl_datum(TEXT[3:] + TEXT[:3])], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()

        step()
        sampler = tc.save_weights_and_get_sampling_client().result()
        # published across nodes: the replica on the sampler node passed the canary
        canary = _replica(server)["last_canary"]
        assert canary is not None and canary["ok"] and canary["max_abs_diff"] is not None
        params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[])
        prompt = types.ModelInput.from_ints(TEXT[:5])
        before = sampler.sample(prompt, num_samples=2, sampling_params=params).result()

        ray_cluster.nodes[1].kill()  # the sampler node: raylet, workers, all at once

        # noticed without a request (the pool's health check), replaced on the trainer node,
        # re-synced and re-verified there
        deadline = time.monotonic() + 240
        while True:
            replica = _replica(server)
            if replica["state"] == "healthy" and replica["node"]["node_id"] == nodes[TRAINER]:
                break
            assert time.monotonic() < deadline, replica
            time.sleep(2)
        assert replica["restarts"] >= 1
        assert replica["last_canary"]["at"] > canary["at"]  # checked again on the new node
        assert replica["last_canary"]["ok"]

        after = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
        assert [s.tokens for s in after.sequences] == [s.tokens for s in before.sequences]

        step()  # a newer version reaches the replacement and passes its canary there
        newer = tc.save_weights_and_get_sampling_client().result()
        latest = _replica(server)["last_canary"]
        assert latest["at"] > replica["last_canary"]["at"]
        assert latest["ok"]
        assert newer.sample(prompt, num_samples=1, sampling_params=params).result().sequences
    finally:
        sc.close("success").result(timeout=30)
