"""Sampler-version lifecycle operations while the version is being sampled, through the SDK:
each succeeds whole (or, for a slot shortage, is refused with nothing created), the client is
told the truth, running samples finish on the weights they started with, and the old version
is dropped (its files gone) once they end."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from lorafleet.sample import UnknownVersionError
from lorafleet.server.main import ServerThread
from tests.server.conftest import KEY_A, KEY_B, sl_datum

DATA = [sl_datum([8, 16, 24, 32, 40, 48, 56, 64, 72, 80])]
PROMPT = types.ModelInput.from_ints([10, 20, 30, 40])
SHORT = types.SamplingParams(max_tokens=12, temperature=0.0, stop=[])
# Long enough to still be running after the operation under test, which waits at most one
# sampling slice (shortened to SLICE_S here) plus a step; each test checks that it was (the
# version is still pinned when the operation returns).
LONG = types.SamplingParams(max_tokens=800, temperature=0.0, stop=[])
SLICE_S = 0.05


@pytest.fixture(autouse=True)
def short_slice(server: ServerThread):
    """Operations wait for the running sample's slice; a short one keeps them well inside LONG
    on any machine."""
    scheduler = server.service.scheduler
    saved, scheduler.sample_slice_s = scheduler.sample_slice_s, SLICE_S
    yield
    scheduler.sample_slice_s = saved


def _train(tc, lr: float = 2e-2) -> None:
    fwd = tc.forward_backward(DATA, "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=lr))
    fwd.result()
    opt.result()


def _versions(server: ServerThread):
    return server.service.executor.versions


def _wait_pinned(server: ServerThread, key: tuple[str, int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _versions(server).info(key).pins == 0:
        assert time.monotonic() < deadline, f"{key} was never pinned by a running sample"
        time.sleep(0.005)


def _gone(server: ServerThread, key: tuple[str, int]) -> bool:
    try:
        _versions(server).info(key)
    except UnknownVersionError:
        return True
    return False


def _greedy(sampler) -> tuple[list[int], list[float]]:
    seq = sampler.sample(PROMPT, 1, SHORT).result().sequences[0]
    return seq.tokens, seq.logprobs


def test_delete_while_sampled_succeeds_and_running_samples_finish(client_a, base_model, server):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=31).result()
    _train(tc)
    path = tc.save_weights_for_sampler("in-use").result().path
    directory = Path(server.service.store.checkpoints.get(path).dir)
    sampler = client_a.create_sampling_client(model_path=path).result()
    reference = _greedy(sampler)
    key = _versions(server).latest(path)
    running = sampler.sample(PROMPT, 1, LONG)
    _wait_pinned(server, key)

    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    rest.delete_checkpoint_from_tinker_path(path).result()  # before: HTTP 500, "in use"
    assert _versions(server).info(key).pins == 1  # answered while the sample still runs
    assert key in _versions(server).retiring()  # it was still running: deletion is scheduled
    stats = httpx.get(f"{server.base_url}/api/v1/lorafleet/stats", headers={"X-API-Key": KEY_A})
    assert stats.json()["sampler_versions_retiring"] >= 1  # listed as being deleted
    assert not directory.exists()
    assert path not in {
        c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints
    }
    with pytest.raises(tinker.RequestFailedError, match="deleted"):
        sampler.sample(PROMPT, 1, SHORT).result()

    out = running.result().sequences[0]
    assert out.tokens[: len(reference[0])] == reference[0]  # finished on the old weights
    assert _gone(server, key)


def test_overwrite_while_sampled_serves_new_weights_to_new_samples(client_a, base_model, server):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=32).result()
    _train(tc)
    path = tc.save_state("ow").result().path
    sampler = client_a.create_sampling_client(model_path=path).result()
    old = _greedy(sampler)
    old_key = _versions(server).latest(path)
    created = server.service.store.checkpoints.get(path).created_at
    _train(tc, lr=5e-2)  # the trainer moves on; the checkpoint still holds the old weights
    running = sampler.sample(PROMPT, 1, LONG)
    _wait_pinned(server, old_key)

    # before: the future failed with a server error, yet the files had been replaced
    assert tc.save_state("ow", overwrite=True).result().path == path
    assert old_key in _versions(server).retiring()
    assert server.service.store.checkpoints.get(path).created_at > created  # the row follows
    new = _greedy(sampler)
    check = client_a.create_sampling_client(
        model_path=tc.save_weights_for_sampler("ow-check").result().path
    ).result()
    # new samples get the new weights: the same tokens, and log-probs within fp32 rounding (two
    # versions of the same weights sample in different batches, whose reductions may differ)
    same = _greedy(check)
    assert new[0] == same[0]
    np.testing.assert_allclose(new[1], same[1], rtol=0, atol=1e-5)
    assert not np.allclose(new[1], old[1], atol=1e-4)

    out = running.result().sequences[0]
    assert out.tokens[: len(old[0])] == old[0]
    np.testing.assert_allclose(out.logprobs[: len(old[1])], old[1], atol=1e-4)
    assert _gone(server, old_key)
    assert _versions(server).latest(path) != old_key


def test_retention_past_a_version_in_use_succeeds_and_cleans_up(client_a, base_model, server):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=33).result()
    _train(tc)
    keep = server.service.executor.publisher.ephemeral_limit
    first = tc.save_weights_and_get_sampling_client().result()
    reference = _greedy(first)
    live = _versions(server).latest(tc.model_id + "#live")
    directory = server.service.executor.publisher.retention.directory(tc.model_id, live[1])
    assert directory is not None and directory.is_dir()
    for _ in range(keep - 1):
        tc.save_weights_and_get_sampling_client().result()
    assert directory.is_dir()  # still kept
    running = first.sample(PROMPT, 1, LONG)
    _wait_pinned(server, live)

    newest = tc.save_weights_and_get_sampling_client().result()  # before: a server error
    assert live in _versions(server).retiring()
    assert not directory.exists()
    with pytest.raises(tinker.RequestFailedError, match="newest"):
        first.sample(PROMPT, 1, SHORT).result()
    assert _greedy(newest)[0] == reference[0]  # same weights, still served

    out = running.result().sequences[0]
    assert out.tokens[: len(reference[0])] == reference[0]
    assert _gone(server, live)


def test_slot_shortage_refuses_before_creating_anything_and_a_retry_succeeds(
    client_a, client_b, base_model, server
):
    slots = server.service.executor.config.sampler_slots
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=34).result()
    _train(tc)
    paths = [tc.save_weights_for_sampler(f"slot-{i}").result().path for i in range(slots)]
    samplers = [client_a.create_sampling_client(model_path=p).result() for p in paths]
    tb = client_b.create_lora_training_client(base_model=base_model, rank=4, seed=35).result()
    running = [s.sample(PROMPT, 1, LONG) for s in samplers]
    for p in paths:
        _wait_pinned(server, _versions(server).latest(p))

    path_b = f"tinker://{tb.model_id}/sampler_weights/b1"
    # before: NoFreeSlotError after "b1" was written, and the retry found "already exists"
    with pytest.raises(tinker.RequestFailedError, match="retry"):
        tb.save_weights_for_sampler("b1").result()
    assert server.service.store.checkpoints.get(path_b) is None
    rest_b = tinker.RestClient(base_url=server.base_url, api_key=KEY_B)
    assert path_b not in {
        c.tinker_path for c in rest_b.list_user_checkpoints().result().checkpoints
    }
    assert all(_versions(server).info(_versions(server).latest(p)).pins for p in paths)
    for future in running:
        future.result()
    assert tb.save_weights_for_sampler("b1").result().path == path_b
    sampled = client_b.create_sampling_client(model_path=path_b).result()
    assert len(_greedy(sampled)[0]) == SHORT.max_tokens
