"""`save_weights_and_get_sampling_client(kind="inflight")` keeps the SDK's inflight contract:
every inflight sampling client of a model follows the model's newest inflight save (a later
one moves the clients already handed out), a snapshot save does not move them, and snapshot
clients stay on the weights they were made from."""

from __future__ import annotations

import math

import pytest
import tinker
from tinker import types

from lorafleet.server.errors import UserError
from lorafleet.server.http import parse, schemas
from tests.server.conftest import sl_datum

PROMPT = types.ModelInput.from_ints([5, 6, 7, 8, 9, 10, 11, 12])


def _logprobs(client: tinker.SamplingClient) -> list[float]:
    out = client.compute_logprobs(PROMPT).result(timeout=60)
    return [lp for lp in out if lp is not None]


def _same(a: list[float], b: list[float]) -> bool:
    return all(math.isclose(x, y, abs_tol=1e-5) for x, y in zip(a, b, strict=True))


def _train(tc: tinker.TrainingClient) -> None:
    for _ in range(2):
        tc.forward_backward([sl_datum([5, 6, 7, 8, 9, 10, 11, 12])], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=60)


def test_inflight_clients_follow_the_newest_inflight_save(
    client_a: tinker.ServiceClient, base_model: str
) -> None:
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=1).result(
        timeout=60
    )
    first = tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=60)
    snapshot_before = tc.save_weights_and_get_sampling_client().result(timeout=60)
    before = _logprobs(first)
    assert _same(_logprobs(snapshot_before), before)

    _train(tc)
    snapshot_after = tc.save_weights_and_get_sampling_client().result(timeout=60)
    after = _logprobs(snapshot_after)
    assert not _same(after, before), "training did not change the weights"
    assert _same(_logprobs(first), before), "a snapshot save moved an inflight client"

    second = tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=60)
    assert _same(_logprobs(second), after)
    assert _same(_logprobs(first), after), "the older inflight client did not follow"
    assert _same(_logprobs(snapshot_before), before), "a snapshot client moved"


def test_a_named_sampler_checkpoint_cannot_be_inflight() -> None:
    body = {"model_id": "m", "seq_id": 1, "path": "final", "kind": "inflight"}
    with pytest.raises(UserError, match="kind 'inflight' is for save_weights_and_get_sampling"):
        parse.save_sampler_args(schemas.parse(schemas.SaveWeightsForSampler, body))
    with pytest.raises(UserError, match="kind must be 'snapshot' or 'inflight', got 'live'"):
        parse.save_sampler_args(
            schemas.parse(
                schemas.SaveWeightsForSampler,
                {"model_id": "m", "seq_id": 1, "sampling_session_seq_id": 0, "kind": "live"},
            )
        )
