"""Trainer slots are a cache (live_models.py), seen through the real `tinker` SDK against a
server with two slots: creating a run never fails for lack of one, and a run paged out to host
memory or disk (between a forward_backward and its optim_step, pending gradient and all) comes
back bit for bit: it continues exactly like the same run on a server that never paged it."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
import torch
from tinker import types

from lorafleet.adapters.checkpoint import read_training_state
from lorafleet.server.main import ServerThread
from lorafleet.server.state.paths import run_dir_name
from tests.server.conftest import KEY_A, KEY_B, connect, server_config, sl_datum

SLOTS = 2
ADAM = types.AdamParams(learning_rate=2e-2, weight_decay=0.05, grad_clip_norm=1.0)


def _data(seed: int) -> list[types.Datum]:
    gen = torch.Generator().manual_seed(seed)
    return [sl_datum(torch.randint(3, 500, (9,), generator=gen).tolist()) for _ in range(2)]


@pytest.fixture(scope="module")
def paged_server(server, tmp_path_factory) -> Iterator[ServerThread]:
    """Two trainer slots, and host memory for one paged-out run (a run's state is three or
    four rows of the bank: weights, moments, a pending gradient), so a second goes to disk."""
    row_bytes = server.service.executor.trainer.bank.row_size * 4  # same layout (r_max 16)
    config = server_config(tmp_path_factory.mktemp("paged-data"))
    engine = dataclasses.replace(config.engine, max_adapters=SLOTS, warm_bytes=4 * row_bytes + 1)
    srv = ServerThread(dataclasses.replace(config, engine=engine))
    yield srv
    srv.stop()


def _paging(srv: ServerThread) -> dict:
    return srv.service.stats()["paging"]["training"]


def _checkpoint(srv: ServerThread, model_id: str, name: str) -> Path:
    (path,) = srv.service.data_dir.glob(f"tenants/*/runs/{run_dir_name(model_id)}/weights/{name}")
    return path


def _assert_same_state(a: Path, b: Path) -> None:
    """Weights, moments and step of two checkpoints, bit for bit."""
    sa, sb = read_training_state(a), read_training_state(b)
    assert sa.step == sb.step and sa.hparams == sb.hparams and sa.optimizer == sb.optimizer
    assert sa.moments is not None and sb.moments is not None
    pairs = [(sa.weights, sb.weights)] + [(sa.moments[k], sb.moments[k]) for k in sa.moments]
    for x, y in pairs:
        assert x.keys() == y.keys()
        for path in x:
            for tx, ty in zip(x[path], y[path], strict=True):
                assert torch.equal(tx.view(torch.int32), ty.view(torch.int32)), path


def _steps(tc: tinker.TrainingClient, seed: int, n: int) -> None:
    for i in range(n):
        tc.forward_backward(_data(seed + i), "cross_entropy").result()
        tc.optim_step(ADAM).result()


def test_run_paged_to_disk_with_a_pending_gradient_equals_one_never_paged(
    server, paged_server, base_model
):
    """(a) + (d) + the warm -> cold -> hot path: the run is paged out between its
    forward_backward and its optim_step, pushed on to disk, and paged back in by the step."""
    reference = connect(server, KEY_B)
    paged = connect(paged_server, KEY_A)
    try:
        ref = reference.create_lora_training_client(base_model=base_model, rank=4, seed=77).result()
        run = paged.create_lora_training_client(base_model=base_model, rank=4, seed=77).result()
        for tc in (ref, run):
            _steps(tc, 10, 2)
            tc.forward_backward(_data(20), "cross_entropy").result()  # pending until the step
        before = _paging(paged_server)
        # Three other runs take the two slots: `run` goes to host memory, then to disk when
        # the next one is paged out after it (host memory holds one).
        others = [
            paged.create_lora_training_client(base_model=base_model, rank=2, seed=s).result()
            for s in (1, 2, 3)
        ]
        for i, tc in enumerate(others):
            _steps(tc, 30 + i, 1)
        now = _paging(paged_server)
        assert now["runs"] == {"hot": 2, "warm": 1, "cold": 1}
        assert now["page_outs"]["cold"] > before["page_outs"]["cold"]
        # the step pages it back in from disk, with the gradient it had accumulated
        ref_metrics = ref.optim_step(ADAM).result().metrics
        metrics = run.optim_step(ADAM).result().metrics
        assert _paging(paged_server)["page_ins"]["cold"] == now["page_ins"]["cold"] + 1
        assert metrics == ref_metrics  # grad_norm, param_norm, step: the same floats
        # the next step's loss, the weights' logprobs, and the saved state: bit for bit
        ref_out = ref.forward_backward(_data(40), "cross_entropy").result()
        out = run.forward_backward(_data(40), "cross_entropy").result()
        assert out.metrics == ref_out.metrics
        for tc in (ref, run):
            tc.optim_step(ADAM).result()
        ref_lp = ref.forward(_data(50), "cross_entropy").result().loss_fn_outputs
        lp = run.forward(_data(50), "cross_entropy").result().loss_fn_outputs
        assert [o["logprobs"].tolist() for o in lp] == [o["logprobs"].tolist() for o in ref_lp]
        ref.save_state("after").result()
        run.save_state("after").result()
        _assert_same_state(
            _checkpoint(paged_server, run.model_id, "after"),
            _checkpoint(server, ref.model_id, "after"),
        )
    finally:
        reference.close("success").result(timeout=30)
        paged.close("success").result(timeout=30)
    deadline = time.monotonic() + 10  # closing unloads the session's runs on the engine
    while _paging(paged_server)["runs"] != {"hot": 0, "warm": 0, "cold": 0}:
        assert time.monotonic() < deadline, _paging(paged_server)["runs"]
        time.sleep(0.05)
    assert _paging(paged_server)["bytes_held"] == {"hot": 0, "warm": 0, "cold": 0}
    assert not any((paged_server.service.data_dir / "paged").iterdir())  # disk given back


def test_six_runs_on_two_slots_all_create_and_train_at_once(paged_server, base_model):
    """(b) Creating a run never fails for lack of a slot, and six runs stepping at the same
    time all finish: a round takes at most as many runs as there are slots, the rest wait."""
    client = connect(paged_server, KEY_A)
    try:
        runs = [
            client.create_lora_training_client(base_model=base_model, rank=4, seed=100 + i).result()
            for i in range(6)
        ]
        before = _paging(paged_server)
        steps = [tc.forward_backward(_data(60 + i), "cross_entropy") for i, tc in enumerate(runs)]
        results = [f.result() for f in steps]
        optims = [tc.optim_step(ADAM) for tc in runs]
        metrics = [f.result().metrics for f in optims]
        assert all(m["step:max"] == 1.0 and m["skipped:max"] == 0.0 for m in metrics)
        assert all(r.loss_fn_outputs for r in results)
        stats = paged_server.service.stats()
        assert stats["models_loaded"] >= 6
        assert stats["max_batch_clients"].get("forward_backward", 0) <= SLOTS
        after = stats["paging"]["training"]
        assert after["misses"] > before["misses"]  # runs really were paged in and out
        assert after["runs"]["hot"] == SLOTS
    finally:
        client.close("success").result(timeout=30)
