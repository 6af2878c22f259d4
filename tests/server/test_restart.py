"""Persistence across a server restart: saved checkpoints load, sampler paths sample the same
tokens, and a request that was still pending fails cleanly instead of hanging its client."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from lorafleet.server.main import ServerThread
from tests.server.conftest import KEY_A, server_config, sl_datum, wait_pending

DATA = [sl_datum([12, 24, 36, 48, 60, 72, 84, 96])]
PROMPT = types.ModelInput.from_ints([7, 14, 21])
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])


def test_restart_keeps_checkpoints_and_fails_pending_requests(tmp_path):
    config = server_config(tmp_path / "data")
    first = ServerThread(config)
    try:
        base_model = str(first.service.executor.base_path)
        client = tinker.ServiceClient(base_url=first.base_url, api_key=KEY_A)
        tc = client.create_lora_training_client(base_model=base_model, rank=8, seed=41).result()
        for _ in range(2):
            tc.forward_backward(DATA, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        state = tc.save_state("before-restart").result().path
        sampler_path = tc.save_weights_for_sampler("before-restart").result().path
        ephemeral = tc.save_weights_and_get_sampling_client().result()
        sampler = client.create_sampling_client(model_path=sampler_path).result()
        tokens_before = sampler.sample(PROMPT, 1, GREEDY).result().sequences[0].tokens
        logprobs_before = (
            tc.forward(DATA, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        )
        # a request that is still queued when the process goes away
        first.service.scheduler.pause()
        pending = tc.forward_backward(DATA, "cross_entropy")
        wait_pending(first, 1)
    finally:
        first.stop()

    second = ServerThread(config)  # same data dir, same port: the old client keeps polling
    try:
        assert second.service.recovered["failed_futures"] == 1
        with pytest.raises(
            tinker.RequestFailedError, match="server restarted before this request finished"
        ):
            pending.result(timeout=60)

        client2 = tinker.ServiceClient(base_url=second.base_url, api_key=KEY_A)
        resumed = client2.create_training_client_from_state_with_optimizer(state).result()
        after = (
            resumed.forward(DATA, "cross_entropy")
            .result()
            .loss_fn_outputs[0]["logprobs"]
            .to_numpy()
        )
        np.testing.assert_array_equal(after, logprobs_before)
        resumed.forward_backward(DATA, "cross_entropy").result()
        resumed.optim_step(types.AdamParams(learning_rate=2e-2)).result()

        sampler2 = client2.create_sampling_client(model_path=sampler_path).result()
        assert sampler2.sample(PROMPT, 1, GREEDY).result().sequences[0].tokens == tokens_before
        # the old sampling client (same session, durable path) also still works
        assert sampler.sample(PROMPT, 1, GREEDY).result().sequences[0].tokens == tokens_before
        with pytest.raises(tinker.RequestFailedError, match="never across a server restart"):
            ephemeral.sample(PROMPT, 1, GREEDY).result()
        with pytest.raises(
            tinker.RequestFailedError, match="not loaded any more .the server restarted"
        ):
            tc.forward(DATA, "cross_entropy").result()

        rest = tinker.RestClient(base_url=second.base_url, api_key=KEY_A)
        paths = {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
        assert paths == {state, sampler_path}
        client2.close("success").result()
        client.close("success").result()
    finally:
        second.stop()
