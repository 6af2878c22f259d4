"""save_state / load (with and without optimizer), sampler checkpoints, REST listing and deletion."""

from __future__ import annotations

import stat
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tests.server.conftest import KEY_A, sl_datum

DATA = [
    sl_datum([8, 16, 24, 32, 40, 48, 56, 64, 72, 80]),
    sl_datum([1 + 300, 2 + 300, 3 + 300, 4 + 300]),
]
PROMPT = types.ModelInput.from_ints([10, 20, 30, 40])


def _lp(tc) -> list[np.ndarray]:
    return [
        o["logprobs"].to_numpy() for o in tc.forward(DATA, "cross_entropy").result().loss_fn_outputs
    ]


def _train(tc, steps: int = 2, lr: float = 1e-2) -> None:
    for _ in range(steps):
        fwd = tc.forward_backward(DATA, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=lr, weight_decay=0.01))
        fwd.result()
        opt.result()


def test_state_round_trip_with_and_without_optimizer(client_a, base_model):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=8, seed=21).result()
    _train(tc)
    path = tc.save_state("step2", user_metadata={"note": "two steps"}).result().path
    assert path == f"tinker://{tc.model_id}/weights/step2"

    with_opt = client_a.create_training_client_from_state_with_optimizer(path).result()
    without_opt = client_a.create_training_client_from_state(path).result()
    assert with_opt.get_info().lora_rank == 8
    for x, y, z in zip(_lp(tc), _lp(with_opt), _lp(without_opt), strict=True):
        np.testing.assert_array_equal(x, y)  # identical weights
        np.testing.assert_array_equal(x, z)
    # the same next step: identical with the optimizer state, different without it
    for client in (tc, with_opt, without_opt):
        _train(client, steps=1)
    for x, y, z in zip(_lp(tc), _lp(with_opt), _lp(without_opt), strict=True):
        np.testing.assert_array_equal(x, y)
        assert not np.allclose(x, z, rtol=0, atol=1e-6)

    # an existing name is refused unless overwrite=True
    with pytest.raises(tinker.RequestFailedError, match="already exists"):
        tc.save_state("step2").result()
    assert tc.save_state("step2", overwrite=True).result().path == path


def test_sampler_checkpoint_samples_what_the_trainer_computes(client_a, base_model, server):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=22).result()
    _train(tc)
    saved = tc.save_weights_for_sampler("final").result().path
    assert saved == f"tinker://{tc.model_id}/sampler_weights/final"
    sampler = client_a.create_sampling_client(model_path=saved).result()
    assert sampler.get_tokenizer().vocab_size == 512  # base_model is a local dir: loads offline
    tokens = [*DATA[0].model_input.to_ints(), 80]
    prompt_lp = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert prompt_lp[0] is None
    np.testing.assert_allclose(prompt_lp[1:], _lp(tc)[0], rtol=1e-4, atol=1e-4)
    greedy = types.SamplingParams(max_tokens=5, temperature=0.0, stop=[])
    first = sampler.sample(PROMPT, 2, greedy).result()
    assert first.sequences[0].tokens == first.sequences[1].tokens
    # the files: a PEFT adapter, owner-only
    row = server.service.store.checkpoints.get(saved)
    directory = Path(row.dir)
    assert (directory / "adapter_config.json").is_file()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in directory.iterdir())


def test_rest_listing_weights_info_and_delete(client_a, base_model, server):
    tc = client_a.create_lora_training_client(
        base_model=base_model, rank=4, seed=23, user_metadata={"run": "rest"}
    ).result()
    _train(tc, steps=1)
    state = tc.save_state("s1").result().path
    sampler_path = tc.save_weights_for_sampler("w1").result().path
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)

    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert {c.checkpoint_id for c in listed} == {"weights/s1", "sampler_weights/w1"}
    assert {c.checkpoint_type for c in listed} == {"training", "sampler"}
    assert any(c.tinker_path == state for c in rest.list_user_checkpoints().result().checkpoints)

    run = rest.get_training_run(tc.model_id).result()
    assert (
        run.lora_rank == 4 and run.base_model == base_model and run.user_metadata == {"run": "rest"}
    )
    assert run.last_checkpoint.tinker_path == state
    assert any(
        r.training_run_id == tc.model_id
        for r in rest.list_training_runs(limit=100).result().training_runs
    )

    info = rest.get_weights_info_by_tinker_path(state).result()
    assert info.lora_rank == 4 and info.base_model == base_model and info.train_attn

    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    assert [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [
        "weights/s1"
    ]
    with pytest.raises(tinker.NotFoundError):
        client_a.create_sampling_client(model_path=sampler_path).result()
    rest.delete_checkpoint_from_tinker_path(state).result()
    with pytest.raises(tinker.NotFoundError):
        client_a.create_training_client_from_state(state).result()


def test_deleting_a_runs_last_checkpoint_frees_its_directory(client_a, base_model, server):
    """The run's directory goes with its last checkpoint (and comes back with the next save)."""
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=24).result()
    state = tc.save_state("only").result().path
    sampler_path = tc.save_weights_for_sampler("only-w").result().path
    store = server.service.store
    run_dir = Path(store.checkpoints.get(state).dir).parent.parent
    assert run_dir.is_dir()
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    rest.delete_checkpoint_from_tinker_path(state).result()
    assert run_dir.is_dir()  # the sampler checkpoint still lives there
    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    assert not run_dir.exists()
    again = tc.save_state("again").result().path
    assert Path(store.checkpoints.get(again).dir).is_dir()
