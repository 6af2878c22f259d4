"""Training through the real SDK: SL lowers the loss, an RL loop runs, every built-in loss and
forward_backward_custom work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from tests.server.conftest import rl_datum, sl_datum

TEXT = [5, 17, 33, 8, 90, 41, 12, 77, 230, 19, 64, 3 + 100, 250, 11, 9, 301]


def test_supervised_loop_lowers_the_loss(client_a, base_model):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=8, seed=0).result()
    data = [sl_datum(TEXT), sl_datum(TEXT[3:] + TEXT[:3])]
    losses = []
    for _ in range(6):
        fwd = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        result = fwd.result()
        assert opt.result().metrics["step:max"] >= 1
        losses.append(result.metrics["loss:sum"])
        out = result.loss_fn_outputs
        assert len(out) == 2 and out[0]["logprobs"].shape == [len(TEXT) - 1]
        # loss:sum is -sum(weights * logprobs) over the request's datums
        total = -sum(float(np.sum(o["logprobs"].to_numpy())) for o in out)
        assert total == pytest.approx(result.metrics["loss:sum"], rel=1e-5)
    assert losses[-1] < 0.8 * losses[0], losses
    # forward (no gradient) agrees with what the last step would see next
    before = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    again = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert before == again


def test_rl_loop_sample_then_importance_sampling(client_a, base_model):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=1).result()
    prompt = [7, 21, 44, 9]
    target = 42  # reward: how often this token was sampled
    for step in range(3):
        sampler = tc.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=100 + step, stop=[])
        response = sampler.sample(
            types.ModelInput.from_ints(prompt), num_samples=4, sampling_params=params
        ).result()
        assert len(response.sequences) == 4
        assert len({s.sequence_id for s in response.sequences}) == 4
        rewards = [
            sum(t == target for t in s.tokens) + 0.1 * s.tokens[0] / 512 for s in response.sequences
        ]
        mean = sum(rewards) / len(rewards)
        data = [
            rl_datum(prompt, list(s.tokens), list(s.logprobs), r - mean)
            for s, r in zip(response.sequences, rewards, strict=True)
        ]
        fwd = tc.forward_backward(data, "importance_sampling")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        metrics = fwd.result().metrics
        assert opt.result().metrics["skipped:max"] == 0.0
        # the sampler's log-probs are the trainer's: the policy ratio is 1 before the update
        assert abs(metrics["log_ratio:sum"]) / metrics["active_tokens:sum"] < 1e-4
        assert metrics["active_tokens:sum"] == 24
    # a reference sampler on the base model (the cookbook's KL penalty) differs from the policy
    reference = client_a.create_sampling_client(base_model=base_model).result()
    policy = tc.save_weights_and_get_sampling_client().result()
    sequence = types.ModelInput.from_ints([*prompt, 42, 42, 7])
    ref_lp, pol_lp = (
        reference.compute_logprobs(sequence).result(),
        policy.compute_logprobs(sequence).result(),
    )
    assert ref_lp[0] is None and len(ref_lp) == 7
    assert not np.allclose(ref_lp[1:], pol_lp[1:], atol=1e-6)


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo", "dro"])
def test_rl_losses_are_accepted(client_a, base_model, loss_fn):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=2).result()
    prompt, sampled = [3, 4, 5], [60, 61, 62, 63]
    data = [
        rl_datum(prompt, sampled, [-1.5, -2.0, -1.0, -3.0], 1.0),
        rl_datum(prompt, sampled[::-1], [-2.0] * 4, -1.0),
    ]
    config = (
        {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
        if loss_fn != "dro"
        else {"beta": 0.1}
    )
    result = tc.forward_backward(data, loss_fn, loss_fn_config=config).result()
    assert np.isfinite(result.metrics["loss:sum"])
    assert (
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm:mean"] > 0
    )


def test_forward_backward_custom(client_a, base_model):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=3).result()
    data = [sl_datum(TEXT[:8]), sl_datum(TEXT[8:])]

    def neg_mean_logprob(batch, logprobs_list):
        loss = -torch.stack([lp.mean() for lp in logprobs_list]).sum()
        return loss, {"custom_term:sum": float(loss.detach())}

    result = tc.forward_backward_custom(data, neg_mean_logprob).result()
    assert "surrogate_loss:sum" in result.metrics and "custom_term:sum" in result.metrics
    assert result.metrics["loss:sum"] == pytest.approx(result.metrics["custom_term:sum"])
    assert (
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm:mean"] > 0
    )


def test_2d_sparse_targets_cross_entropy(client_a, base_model):
    """Top-k distillation style [T, K] targets, sent by the SDK as sparse CSR."""
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=4).result()
    tokens = TEXT[:7]
    targets = torch.zeros(6, 8, dtype=torch.int64)
    weights = torch.zeros(6, 8)
    targets[:, 0] = torch.tensor(tokens[1:])
    weights[:, 0] = 1.0
    targets[2, 1], weights[2, 1] = 99, 0.5
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_torch_sparse(targets),
            "weights": types.TensorData.from_torch_sparse(weights),
        },
    )
    assert datum.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    out = tc.forward([datum, sl_datum(tokens)], "cross_entropy").result()
    sparse_lp = out.loss_fn_outputs[0]["logprobs"]
    dense_lp = out.loss_fn_outputs[1]["logprobs"].to_numpy()
    assert sparse_lp.shape == [6, 8]
    np.testing.assert_allclose(sparse_lp.to_numpy()[:, 0], dense_lp, rtol=1e-6)
