"""SDK 0.38's losses and optimizers through the real `tinker` client: cross_entropy without
weights, gspo, the refused server-side custom, forward_backward_custom on
weightless data, and the dimuon optimizer (training, the fixed-family rule, checkpoints)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.types.optimizer import OptimizerConfigBase

from tests.server.conftest import KEY_A, rl_datum, sl_datum

TEXT = [5, 17, 33, 8, 90, 41, 12, 77, 230, 19, 64, 103, 250, 11, 9, 301]


def bare_datum(tokens: list[int]) -> types.Datum:
    """The SDK docstring's datum: target_tokens and nothing else."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:]},
    )


def test_cross_entropy_without_weights_weighs_every_target(client_a, base_model):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=10).result()
    bare = tc.forward([bare_datum(TEXT)], "cross_entropy").result()
    weighted = tc.forward([sl_datum(TEXT)], "cross_entropy").result()
    logprobs = bare.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert bare.metrics["loss:sum"] == pytest.approx(-float(logprobs.sum()), rel=1e-6)
    assert bare.metrics["loss:sum"] == weighted.metrics["loss:sum"]
    result = tc.forward_backward([bare_datum(TEXT)], "cross_entropy").result()
    assert result.metrics["loss:sum"] == bare.metrics["loss:sum"]
    assert (
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm:mean"] > 0
    )


def test_cross_entropy_without_weights_2d_targets(client_a, base_model):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=11).result()
    targets = torch.tensor([[t, 7] for t in TEXT[1:8]], dtype=torch.int64)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TEXT[:7]),
        loss_fn_inputs={"target_tokens": types.TensorData.from_torch(targets)},
    )
    out = tc.forward([datum], "cross_entropy").result()
    logprobs = out.loss_fn_outputs[0]["logprobs"]
    assert logprobs.shape == [7, 2]
    assert out.metrics["loss:sum"] == pytest.approx(-float(logprobs.to_numpy().sum()), rel=1e-6)


def gspo_datum(prompt, sampled, sampler_logprobs, advantage) -> types.Datum:
    base = rl_datum(prompt, sampled, sampler_logprobs, advantage)
    pad = len(prompt) - 1
    inputs = dict(base.loss_fn_inputs)
    inputs["sequence_ratio_mask"] = types.TensorData(
        data=[0.0] * pad + [1.0] * len(sampled), dtype="float32", shape=[pad + len(sampled)]
    )
    return types.Datum(model_input=base.model_input, loss_fn_inputs=inputs)


def test_gspo_value_matches_the_documented_formula(client_a, base_model):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=12).result()
    prompt, sampled = [3, 4, 5], [60, 61, 62, 63]
    logq = [-1.5, -2.0, -1.0, -3.0]
    data = [gspo_datum(prompt, sampled, logq, 1.0), gspo_datum(prompt, sampled[::-1], logq, -0.5)]
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    out = tc.forward(data, "gspo", loss_fn_config=config).result()
    expected = 0.0
    for output, adv in zip(out.loss_fn_outputs, (1.0, -0.5), strict=True):
        logp = output["logprobs"].to_numpy()[len(prompt) - 1 :]
        s = math.exp(float(np.mean(logp - np.array(logq))))
        expected -= len(sampled) * min(s * adv, min(max(s, 0.9), 1.1) * adv)
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    assert out.metrics["active_tokens:sum"] == 8 and "clipped_tokens:sum" in out.metrics
    tc.forward_backward(data, "gspo", loss_fn_config=config).result()
    assert (
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm:mean"] > 0
    )


@pytest.mark.parametrize(
    ("loss_fn", "config", "reason"),
    [
        ("custom", {"loss_id": 3.0}, "forward_backward_custom"),
    ],
)
def test_refused_losses_fail_cleanly_and_say_why(client_a, base_model, loss_fn, config, reason):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=13).result()
    data = [rl_datum([3, 4, 5], [60, 61], [-1.0, -1.0], 1.0)]
    with pytest.raises(tinker.RequestFailedError) as info:
        tc.forward_backward(data, loss_fn, loss_fn_config=config).result()
    message = str(info.value)
    assert f"loss_fn {loss_fn!r} is not supported" in message and reason in message
    # the model is untouched and keeps serving
    assert np.isfinite(tc.forward([sl_datum(TEXT)], "cross_entropy").result().metrics["loss:sum"])


def test_forward_backward_custom_on_weightless_data(client_a, base_model):
    """The SDK's custom path adds zero weights to the forward and sends -dC/dlogp as weights."""
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=14).result()
    data = [bare_datum(TEXT[:8]), bare_datum(TEXT[8:])]

    def neg_logprob(batch, logprobs_list):
        return -torch.stack([lp.sum() for lp in logprobs_list]).sum(), {}

    result = tc.forward_backward_custom(data, neg_logprob).result()
    before = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert result.metrics["loss:sum"] == pytest.approx(before, rel=1e-5)
    assert result.metrics["surrogate_loss:sum"] == pytest.approx(before, rel=1e-5)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert after < before


def test_create_custom_loss_runs_on_the_client_and_trains(server, client_a, base_model):
    """The server does not offer server-side custom losses (`custom_loss_server_side` stays off
    in its client config), so the SDK traces the loss and runs it on the client, sending plain
    cross_entropy weights: the loss value comes back, and a step on it lowers the loss."""
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=15).result()
    data = [sl_datum(TEXT[:9]), sl_datum(TEXT[7:])]

    def neg_ll(logprobs, weights):
        loss = -(logprobs * weights).sum()
        return loss, {"custom/neg_ll:sum": loss}

    handle = client_a.create_custom_loss(neg_ll, input_ranks={"logprobs": 1, "weights": 1}).result()
    result = tc.forward_backward_custom(data, handle).result()
    before = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert result.metrics["custom/neg_ll:sum"] == pytest.approx(before, rel=1e-5)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert tc.forward(data, "cross_entropy").result().metrics["loss:sum"] < before


# --------------------------------------------------------------------------- dimuon

DIMUON = types.DimuonOptimizerConfig()


def test_dimuon_training_lowers_the_loss(client_a, base_model):
    tc = client_a.create_lora_training_client(
        base_model=base_model, rank=8, seed=20, optimizer=DIMUON
    ).result()
    data = [sl_datum(TEXT), sl_datum(TEXT[3:] + TEXT[:3])]
    losses = []
    for _ in range(5):
        fwd = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.DimuonParams(learning_rate=5e-2, grad_clip_norm=1.0))
        losses.append(fwd.result().metrics["loss:sum"])
        metrics = opt.result().metrics
        assert metrics["skipped:max"] == 0.0 and metrics["grad_norm:mean"] > 0
    assert losses[-1] < 0.8 * losses[0], losses


def test_optimizer_family_is_fixed_at_creation(client_a, base_model):
    dimuon = client_a.create_lora_training_client(
        base_model=base_model, rank=4, seed=21, optimizer=DIMUON
    ).result()
    adam = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=22).result()
    for tc, wrong, right in (
        (dimuon, types.AdamParams(learning_rate=1e-3), types.DimuonParams(learning_rate=1e-3)),
        (adam, types.DimuonParams(learning_rate=1e-3), types.AdamParams(learning_rate=1e-3)),
    ):
        tc.forward_backward([sl_datum(TEXT)], "cross_entropy").result()
        with pytest.raises(tinker.RequestFailedError, match="was created with the"):
            tc.optim_step(wrong).result()
        assert tc.optim_step(right).result().metrics["skipped:max"] == 0.0


def test_unknown_optimizer_is_refused_at_create(client_a, base_model):
    with pytest.raises(tinker.BadRequestError, match="'lion' is not supported"):
        client_a.create_lora_training_client(
            base_model=base_model, rank=4, optimizer=OptimizerConfigBase(type="lion")
        ).result()


def test_dimuon_state_round_trips_bit_for_bit(server, client_a, base_model):
    tc = client_a.create_lora_training_client(
        base_model=base_model, rank=4, seed=23, optimizer=DIMUON
    ).result()
    data = [sl_datum(TEXT)]
    params = types.DimuonParams(learning_rate=1e-2, beta1=0.8)
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(params).result()
    path = tc.save_state("dimuon-ckpt").result().path
    # one more step here, and the same step on the restored copy: momentum must carry over
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(params).result()
    expected = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    restored = client_a.create_training_client_from_state_with_optimizer(path).result()
    restored.forward_backward(data, "cross_entropy")
    assert restored.optim_step(params).result().metrics["step:max"] == 3.0
    got = restored.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_array_equal(got, expected)
    with pytest.raises(tinker.RequestFailedError, match="was created with the dimuon"):
        restored.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    # the family is reported where the SDK shows it, for the run and for its checkpoint
    assert restored.get_info().optimizer_config.model_dump() == DIMUON.model_dump()
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert info.optimizer_config.model_dump() == DIMUON.model_dump()


def test_dimuon_checkpoint_into_another_family(client_a, base_model):
    dimuon = client_a.create_lora_training_client(
        base_model=base_model, rank=4, seed=24, optimizer=DIMUON
    ).result()
    dimuon.forward_backward([sl_datum(TEXT)], "cross_entropy")
    dimuon.optim_step(types.DimuonParams(learning_rate=1e-2)).result()
    path = dimuon.save_state("dimuon-other").result().path
    adam = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=25).result()
    before = adam.forward([sl_datum(TEXT)], "cross_entropy").result().metrics["loss:sum"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(tinker.RequestFailedError, match="holds dimuon optimizer state"):
            adam.load_state_with_optimizer(path).result()
    # refused before anything changed
    assert adam.forward([sl_datum(TEXT)], "cross_entropy").result().metrics["loss:sum"] == before
    # weights only, under the default (adamw) optimizer: allowed, like the hosted service
    fresh = client_a.create_training_client_from_state(path).result()
    fresh.forward_backward([sl_datum(TEXT)], "cross_entropy")
    assert fresh.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["step:max"] == 1
