"""Fair share through the real SDK: a forward_backward far bigger than the round's token budget
runs in chunks over several rounds and gives what the same call gives unsplit (log-probs, loss,
the optimizer step after it and the weights it leaves), and another tenant's small step queued
beside it finishes in the first round instead of waiting for all of it."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest
import tinker
from tinker import types

from lorafleet.server.main import ServerThread
from tests.server.conftest import (
    KEY_A,
    KEY_B,
    VOCAB,
    connect,
    rl_datum,
    server_config,
    sl_datum,
    wait_pending,
)

BUDGET = 48  # tokens per round on the split server; the shared server's default runs BIG whole
_rng = random.Random(22)
BIG = [sl_datum([_rng.randrange(VOCAB) for _ in range(_rng.randrange(8, 24))]) for _ in range(24)]
BIG_TOKENS = sum(d.model_input.length for d in BIG)
PROBE = [sl_datum([7, 70, 170, 270, 370, 470, 9, 99]), sl_datum([300, 301, 302, 303])]
SMALL = [sl_datum([11, 22, 33, 44, 55])]
ADAM = types.AdamParams(learning_rate=1e-3)


@pytest.fixture(scope="module")
def split_server(tmp_path_factory) -> Iterator[ServerThread]:
    srv = ServerThread(  # small rounds, for a tenant alone too (no solo rounds)
        server_config(
            tmp_path_factory.mktemp("fair-share-data"),
            round_token_budget=BUDGET,
            solo_round_token_budget=0,
        )
    )
    yield srv
    srv.stop()


def _logprobs(out: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def _train_once(srv: ServerThread, base_model: str) -> dict:
    """forward_backward of BIG and an optim_step sent together (the step must wait for every
    chunk), then a forward-only BIG and PROBE on the new weights."""
    sc = connect(srv, KEY_A)
    try:
        tc = sc.create_lora_training_client(base_model=base_model, rank=8, seed=5).result()
        fb = tc.forward_backward(BIG, "cross_entropy")
        opt = tc.optim_step(ADAM)
        fb_out, opt_out = fb.result(), opt.result()
        after = tc.forward(BIG, "cross_entropy").result()
        probe = tc.forward(PROBE, "cross_entropy").result()
    finally:
        sc.close("success").result(timeout=30)
    return {"fb": fb_out, "opt": opt_out.metrics, "after": after, "probe": probe}


def test_a_split_call_equals_the_unsplit_call(server, split_server, base_model):
    assert BIG_TOKENS > 6 * BUDGET and server.config.round_token_budget > BIG_TOKENS
    stats = split_server.service.scheduler.stats
    split_before, chunks_before = stats.split_ops, stats.chunks
    whole_before = server.service.scheduler.stats.split_ops
    whole = _train_once(server, base_model)
    split = _train_once(split_server, base_model)
    # the big forward_backward (and the forward-only BIG after it) ran in chunks there, not here
    assert stats.split_ops - split_before == 2 and stats.chunks - chunks_before >= 2 * 6
    assert server.service.scheduler.stats.split_ops == whole_before

    for key in ("fb", "after", "probe"):
        assert len(whole[key].loss_fn_outputs) == len(split[key].loss_fn_outputs)
        for x, y in zip(_logprobs(whole[key]), _logprobs(split[key]), strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
        assert set(whole[key].metrics) == set(split[key].metrics)
        for name, value in whole[key].metrics.items():
            assert np.isclose(value, split[key].metrics[name], rtol=1e-5), name
    for name in ("grad_norm:mean", "param_norm:mean", "step:max"):
        assert np.isclose(whole["opt"][name], split["opt"][name], rtol=1e-5), name


def test_a_small_step_beside_a_split_call_finishes_in_the_first_round(split_server, base_model):
    scheduler = split_server.service.scheduler
    sa, sb = connect(split_server, KEY_A), connect(split_server, KEY_B)
    try:
        big = sa.create_lora_training_client(base_model=base_model, rank=8, seed=6).result()
        small = sb.create_lora_training_client(base_model=base_model, rank=4, seed=7).result()
        scheduler.pause()
        try:
            big_fb, big_opt = big.forward_backward(BIG, "cross_entropy"), big.optim_step(ADAM)
            small_fb, small_opt = (
                small.forward_backward(SMALL, "cross_entropy"),
                small.optim_step(ADAM),
            )
            wait_pending(split_server, 4)
            state = scheduler.state()
        finally:
            scheduler.resume()
        small_fb.result(), small_opt.result(), big_fb.result(), big_opt.result()
    finally:
        sa.close("success").result(timeout=30)
        sb.close("success").result(timeout=30)
    tenant_a = split_server.service.authenticate(KEY_A).id
    tenant_b = split_server.service.authenticate(KEY_B).id
    assert state["tenants"][tenant_a]["queued_train_tokens"] == BIG_TOKENS
    assert state["tenants"][tenant_b]["queued_ops"] == 2
    waits = scheduler.stats.train_wait_rounds
    assert waits[tenant_b] <= 1  # queued while paused: done in the first round after
    assert waits[tenant_a] >= 6  # the big call took at least BIG_TOKENS / BUDGET rounds
    stats = split_server.service.stats()
    assert stats["fair_share"]["round_token_budget"] == BUDGET
    assert stats["train_wait_rounds"][tenant_b] == waits[tenant_b]


def test_a_later_chunk_that_fails_says_what_earlier_chunks_applied(split_server, base_model):
    """An importance-sampling datum whose ratio overflows fails its chunk; the call fails, and
    since its earlier chunks' gradient is already in the slot, the error says so."""
    # distinct first tokens: fair share counts a datum past what earlier ones share with it
    good = [rl_datum([1 + i, 2, 3, 4], [5, 6, 7, 8, 9, 10], [-2.0] * 6, 1.0) for i in range(8)]
    bad = rl_datum([20, 2, 3, 4], [5, 6, 7, 8, 9, 10], [-200.0] * 6, 1.0)
    sc = connect(split_server, KEY_A)
    try:
        tc = sc.create_lora_training_client(base_model=base_model, rank=4, seed=8).result()
        with pytest.raises(
            tinker.RequestFailedError, match=r"gradient of its datums 0-\d+ was already accumulated"
        ):
            tc.forward_backward([*good, bad], "importance_sampling").result()
        tc.forward_backward(good, "importance_sampling").result()  # the model goes on
    finally:
        sc.close("success").result(timeout=30)
