"""Adapter slots are a server resource: runs past them are paged, and closing a ServiceClient
unloads its models (in-place load_state, the deprecated path, also works)."""

from __future__ import annotations

import time
import warnings

import numpy as np
from tinker import types

from tests.server.conftest import KEY_A, connect, sl_datum

DATA = [sl_datum([30, 31, 32, 33, 34, 35, 36])]


def _loaded(server) -> int:
    return server.service.stats()["models_loaded"]


def test_full_server_and_close_frees_slots(server, base_model):
    deadline = time.monotonic() + 10
    while _loaded(server) and time.monotonic() < deadline:  # earlier tests' clients closing
        time.sleep(0.05)
    assert _loaded(server) == 0
    client = connect(server, KEY_A)
    capacity = server.service.executor.config.max_adapters
    clients = [
        client.create_lora_training_client(base_model=base_model, rank=2, seed=i).result()
        for i in range(capacity)
    ]
    # slots are a cache (live_models.py): one run more than slots is created, not refused
    clients.append(client.create_lora_training_client(base_model=base_model, rank=2).result())
    assert _loaded(server) == capacity + 1
    client.close("success").result()
    deadline = time.monotonic() + 10
    while _loaded(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _loaded(server) == 0
    assert clients  # the SDK objects outlive the session, but their models are gone server-side


def test_deprecated_in_place_load_state(client_a, base_model):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=51).result()
    tc.forward_backward(DATA, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    saved = tc.save_state("snap").result().path
    expected = tc.forward(DATA, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    tc.forward_backward(DATA, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    moved = tc.forward(DATA, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert not np.array_equal(moved, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert tc.load_state_with_optimizer(saved).result().path == saved
    back = tc.forward(DATA, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_array_equal(back, expected)


def test_ephemeral_sampler_survives_eviction_from_the_sampler_bank(server, client_a, base_model):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=52).result()
    tc.forward_backward(DATA, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([30, 31, 32])
    expected = sampler.compute_logprobs(prompt).result()
    versions = server.service.executor.versions
    key = next(k for k in versions.resident() if k[0] == tc.model_id + "#live")
    other = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=53).result()
    for i in range(
        server.service.executor.config.sampler_slots + 1
    ):  # every slot taken by newer versions
        other.save_weights_for_sampler(f"evict-{i}").result()
    assert key not in versions.resident()
    assert sampler.compute_logprobs(prompt).result() == expected  # reloaded from its files
