"""The server path changes nothing the engine computes: a multi-turn RL call (each turn's datum
the whole history, past actions re-rendered, as the cookbook's guess_number sends them) through
the SDK leaves in the adapter's gradient row what the same datums handed to the server's own
trainer leave there, and returns the same log-probs and loss, whether a lone tenant's call runs
in one solo round or, beside another tenant's queued work, in chunks over small rounds."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tinker import types

from lorafleet.server.main import ServerThread
from lorafleet.train.engine import TrainItem
from tests.server.conftest import KEY_A, KEY_B, VOCAB, connect, server_config, wait_pending

BUDGET = 40  # tokens per shared round; the call below counts ~190 after sharing
HEADER, ACTION, OBSERVATION, PROMPT = 2, 4, 3, 12
RTOL, ATOL = 1e-5, 1e-6  # fp32


def _turns(episodes: int = 4, turns: int = 4, seed: int = 31) -> list[dict[str, torch.Tensor]]:
    """Each turn: its history and sampled action, the action re-rendered under another header in
    the next turn's history (so a turn is not a prefix of the next: a stem)."""
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    game, assistant, player = draw(PROMPT - HEADER), draw(HEADER), draw(HEADER)
    out = []
    for _ in range(episodes):
        advantage = rng.uniform(-1, 1)
        history = game + assistant
        for _ in range(turns):
            action = draw(ACTION)
            sampled = history + action
            start = len(history) - 1
            n = len(sampled) - 1
            out.append(
                {
                    "tokens": torch.tensor(sampled[:-1]),
                    "target_tokens": torch.tensor(sampled[1:]),
                    "logprobs": torch.tensor(
                        [-rng.uniform(0, 3) if i >= start else 0.0 for i in range(n)]
                    ),
                    "advantages": torch.tensor(
                        [advantage if i >= start else 0.0 for i in range(n)]
                    ),
                }
            )
            history = history[:-HEADER] + player + action + draw(OBSERVATION) + assistant
    return out


TURNS = _turns()
INPUTS = ("target_tokens", "logprobs", "advantages")


def _datums() -> list[types.Datum]:
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(t["tokens"].tolist()),
            loss_fn_inputs={k: types.TensorData.from_torch(t[k]) for k in INPUTS},
        )
        for t in TURNS
    ]


@pytest.fixture(scope="module")
def parity_server(tmp_path_factory) -> Iterator[ServerThread]:
    srv = ServerThread(
        server_config(tmp_path_factory.mktemp("parity-data"), round_token_budget=BUDGET)
    )
    yield srv
    srv.stop()


def _on_worker(srv: ServerThread, fn: Any) -> Any:
    return srv.service.scheduler.call(fn).result(timeout=120)


def _engine_side(srv: ServerThread, slot: int) -> tuple[list[torch.Tensor], float, torch.Tensor]:
    """The same turns straight into the server's trainer, on the model's slot: log-probs, loss
    and the gradient row it leaves (zeroed again after)."""
    trainer = srv.service.executor.trainer

    def run() -> tuple[list[torch.Tensor], float, torch.Tensor]:
        grads = trainer.bank.grads
        grads[slot].zero_()
        items = [
            TrainItem(slot, t["tokens"], "importance_sampling", {k: t[k] for k in INPUTS})
            for t in TURNS
        ]
        out = trainer.forward_backward(items)
        row = grads[slot].clone()
        grads[slot].zero_()
        return [o.logprobs for o in out.items], out.metrics["loss:sum"], row

    return _on_worker(srv, run)


def _grad_row(srv: ServerThread, slot: int) -> torch.Tensor:
    def take() -> torch.Tensor:
        grads = srv.service.executor.trainer.bank.grads
        row = grads[slot].clone()
        grads[slot].zero_()
        return row

    return _on_worker(srv, take)


def _check(server_out: types.ForwardBackwardOutput, server_grad, engine) -> None:
    logprobs, loss, grad = engine
    assert grad.abs().max() > 0  # the comparison is not of two zero rows
    torch.testing.assert_close(server_grad, grad, rtol=RTOL, atol=ATOL)
    assert server_out.metrics["loss:sum"] == pytest.approx(loss, rel=RTOL, abs=ATOL)
    served = [o["logprobs"].to_torch() for o in server_out.loss_fn_outputs]
    assert len(served) == len(logprobs)
    for a, b in zip(served, logprobs, strict=True):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=RTOL, atol=ATOL)


def test_a_lone_tenants_call_runs_in_one_round_and_equals_the_engine(parity_server):
    """Runs first on its module's server: no other tenant has been there."""
    scheduler = parity_server.service.scheduler
    base_model = str(parity_server.service.executor.base_path)
    sc = connect(parity_server, KEY_A)
    try:
        tc = sc.create_lora_training_client(base_model=base_model, rank=8, seed=3).result()
        slot = _on_worker(
            parity_server, lambda: parity_server.service.executor.live.get(tc.model_id).slot
        )
        # a trained-looking adapter (B is zero at creation, and A's gradient with it)
        tc.forward_backward(_datums(), "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        engine = _engine_side(parity_server, slot)
        split_before, solo_before = scheduler.stats.split_ops, scheduler.stats.solo_rounds
        out = tc.forward_backward(_datums(), "importance_sampling").result()
        assert scheduler.stats.split_ops == split_before  # one chunk: the whole call
        assert scheduler.stats.solo_rounds > solo_before
        _check(out, _grad_row(parity_server, slot), engine)
    finally:
        sc.close("success").result(timeout=30)


def test_beside_another_tenant_the_call_is_split_and_still_equals_the_engine(
    parity_server,
):
    scheduler = parity_server.service.scheduler
    base_model = str(parity_server.service.executor.base_path)
    sa, sb = connect(parity_server, KEY_A), connect(parity_server, KEY_B)
    try:
        tc = sa.create_lora_training_client(base_model=base_model, rank=8, seed=4).result()
        other = sb.create_lora_training_client(base_model=base_model, rank=4, seed=5).result()
        slot = _on_worker(
            parity_server, lambda: parity_server.service.executor.live.get(tc.model_id).slot
        )
        tc.forward_backward(_datums(), "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        engine = _engine_side(parity_server, slot)
        split_before = scheduler.stats.split_ops
        scheduler.pause()  # both queued before the first round: not alone
        try:
            fb = tc.forward_backward(_datums(), "importance_sampling")
            small = other.forward_backward(_datums()[:1], "importance_sampling")
            wait_pending(parity_server, 2)
        finally:
            scheduler.resume()
        out = fb.result()
        small.result()
        assert scheduler.stats.split_ops > split_before  # ran in chunks
        _check(out, _grad_row(parity_server, slot), engine)
    finally:
        sa.close("success").result(timeout=30)
        sb.close("success").result(timeout=30)
