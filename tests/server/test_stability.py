"""Stability records and provenance through the real `tinker` SDK: a `record_stability_info`
sample is recorded and trained with `stable_reinforce` on the server's own log-probs; every
provenance refusal (wrong token, foreign session, another tenant's id, expired, spans not
tiling, no spans, an unrecorded sequence) fails naming what is wrong and trains nothing;
records are bounded by the tenant quota, expire unused and go with their session."""

from __future__ import annotations

import math
import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from lorafleet.server.main import ServerThread
from lorafleet.server.ops.stability import StabilityPolicy
from tests.server.conftest import KEY_A, connect, server_config

PROMPT = [5, 17, 33, 8, 90, 41]
PARAMS = types.SamplingParams(max_tokens=5, temperature=1.0, seed=3, stop=[])
ADAM = types.AdamParams(learning_rate=1e-2)


def sample(sampler: tinker.SamplingClient, n: int = 2, prompt: list[int] = PROMPT):
    return sampler.sample(types.ModelInput.from_ints(prompt), n, PARAMS).result().sequences


def provenance_datum(
    seq, advantage: float, prompt: list[int] = PROMPT, logprobs: list[float] | None = None
) -> types.Datum:
    """The cookbook's rl_loop layout with its provenance: input = prompt + sampled[:-1]."""
    sampled = list(seq.tokens)
    pad = len(prompt) - 1
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + sampled[:-1]),
        loss_fn_inputs={
            "target_tokens": [0] * pad + sampled,
            "logprobs": [0.0] * pad + (logprobs if logprobs is not None else list(seq.logprobs)),
            "advantages": [0.0] * pad + [advantage] * len(sampled),
        },
    )
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(prompt)),
            types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(sampled) - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=pad),
            types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(sampled)),
        ],
    )


def recording_sampler(sc: tinker.ServiceClient, base_model: str) -> tinker.SamplingClient:
    return sc.create_sampling_client(base_model=base_model, record_stability_info=True).result()


def expect_refused(tc: tinker.TrainingClient, data, *needles: str) -> None:
    """The call fails naming every needle, and nothing was trained: the next optimizer step
    finds no gradient and is skipped."""
    with pytest.raises(tinker.RequestFailedError) as info:
        tc.forward_backward(data, "stable_reinforce").result()
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    assert tc.optim_step(ADAM).result().metrics["skipped:max"] == 1.0


@pytest.fixture
def run(client_a, base_model):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=21).result()
    return tc, recording_sampler(client_a, base_model)


def test_recorded_samples_train_on_the_servers_logprobs(run, server):
    tc, sampler = run
    seqs = sample(sampler)
    assert all(s.sequence_id for s in seqs) and len({s.sequence_id for s in seqs}) == 2
    honest = [provenance_datum(s, a) for s, a in zip(seqs, (1.0, -1.0), strict=True)]
    # the client's own log-probs are ignored: garbage ones give the same loss
    garbage = [
        provenance_datum(s, a, logprobs=[-9.0] * len(s.tokens))
        for s, a in zip(seqs, (1.0, -1.0), strict=True)
    ]
    out = tc.forward(honest, "stable_reinforce").result()
    assert tc.forward(garbage, "stable_reinforce").result().metrics == out.metrics
    # the documented objective, on-policy: ratios are 1 (up to the sampler/trainer numerics)
    expected = 0.0
    for o, s, adv in zip(out.loss_fn_outputs, seqs, (1.0, -1.0), strict=True):
        logp = o["logprobs"].to_numpy()[len(PROMPT) - 1 :]
        ratio = np.exp(logp - np.array(s.logprobs))
        np.testing.assert_allclose(ratio, 1.0, atol=1e-3)
        expected -= float(np.sum(np.minimum(ratio, 2.0) * adv * logp))
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
    assert out.metrics["sequences:sum"] == 2 and out.metrics["masked_sequences:sum"] == 0
    assert out.metrics["active_tokens:sum"] == sum(len(s.tokens) for s in seqs)
    tc.forward_backward(honest, "stable_reinforce").result()
    step = tc.optim_step(ADAM).result().metrics
    assert step["skipped:max"] == 0.0 and step["grad_norm:mean"] > 0
    # the records were renewed by the training requests
    store = server.service.store.stability_records
    record = store.get(seqs[0].sequence_id.rpartition(":")[0])
    assert record is not None and record.last_used > record.created_at


def test_wrong_tokens_are_refused_naming_datum_position_and_tokens(run):
    tc, sampler = run
    (seq,) = sample(sampler, 1)
    good = provenance_datum(seq, 1.0)
    # a target token changed: position len(PROMPT) - 1 + 2 is sampled token 2
    targets = good.loss_fn_inputs["target_tokens"].tolist()
    pos = len(PROMPT) - 1 + 2
    given = (targets[pos] + 1) % 500
    targets[pos] = given
    bad_target = types.Datum(
        model_input=good.model_input,
        loss_fn_inputs={**good.loss_fn_inputs, "target_tokens": targets},
        model_input_spans=good.model_input_spans,
        loss_fn_input_spans=good.loss_fn_input_spans,
    )
    expect_refused(
        tc,
        [good, bad_target],
        "data[1]",
        f"target_tokens position {pos}",
        f"expected {seq.tokens[2]}, given {given}",
    )
    # a prompt token changed in the model input
    tokens = good.model_input.to_ints()
    tokens[1] = (tokens[1] + 1) % 500
    bad_input = types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs=good.loss_fn_inputs,
        model_input_spans=good.model_input_spans,
        loss_fn_input_spans=good.loss_fn_input_spans,
    )
    expect_refused(
        tc, [bad_input], "data[0]", "model_input position 1", f"expected {PROMPT[1]}, given"
    )


def test_spans_that_do_not_tile_are_refused(run):
    tc, sampler = run
    (seq,) = sample(sampler, 1)
    good = provenance_datum(seq, 1.0)
    short = list(good.model_input_spans or [])[:-1]
    datum = types.Datum(
        model_input=good.model_input,
        loss_fn_inputs=good.loss_fn_inputs,
        model_input_spans=short,
        loss_fn_input_spans=good.loss_fn_input_spans,
    )
    expect_refused(tc, [datum], "data[0].model_input_spans cover", "must tile")


def test_no_spans_and_unrecorded_sequences_are_refused(run, client_a, base_model):
    tc, sampler = run
    (seq,) = sample(sampler, 1)
    plain = provenance_datum(seq, 1.0)
    bare = types.Datum(model_input=plain.model_input, loss_fn_inputs=plain.loss_fn_inputs)
    expect_refused(tc, [bare], "data[0] has no provenance spans")
    # sampled without record_stability_info: its sequence_id names nothing recorded
    unrecorded = client_a.create_sampling_client(base_model=base_model).result()
    (other,) = sample(unrecorded, 1)
    expect_refused(tc, [provenance_datum(other, 1.0)], "has no stability record for this tenant")


def test_another_sessions_and_another_tenants_sequences_are_refused(
    run, server, client_b, base_model
):
    tc, _ = run
    # the same tenant, another session
    other_session = connect(server, KEY_A)
    try:
        (foreign,) = sample(recording_sampler(other_session, base_model), 1)
        expect_refused(
            tc, [provenance_datum(foreign, 1.0)], "was sampled in session", "not in this model's"
        )
    finally:
        other_session.close("success").result(timeout=30)
    # another tenant's record answers as an unknown id, disclosing nothing
    (theirs,) = sample(recording_sampler(client_b, base_model), 1)
    expect_refused(tc, [provenance_datum(theirs, 1.0)], "has no stability record for this tenant")


def test_expired_records_are_refused_then_swept(run, server):
    tc, sampler = run
    (seq,) = sample(sampler, 1)
    request_id = seq.sequence_id.rpartition(":")[0]
    store = server.service.store
    two_days_ago = time.time() - 2 * 24 * 3600
    store.database.run(
        "UPDATE stability_records SET last_used=? WHERE request_id=?", (two_days_ago, request_id)
    )
    expect_refused(tc, [provenance_datum(seq, 1.0)], "has expired", "last used")
    server.service.maintain()
    assert store.stability_records.get(request_id) is None


def test_records_are_bounded_per_tenant(run, server, monkeypatch):
    _, sampler = run
    store = server.service.store.stability_records
    (first,) = sample(sampler, 1)
    record = store.get(first.sequence_id.rpartition(":")[0])
    assert record is not None
    tenant = record.tenant
    used = store.bytes_of_tenant(tenant)
    one = 256 + 4 * len(PROMPT) + 8 * 5 + 4 * 2  # record_bytes of a 1-sample, 5-token record
    policy = StabilityPolicy(quota_bytes=used + one)
    monkeypatch.setattr(server.service.sampling, "stability_policy", policy)
    sample(sampler, 1)  # fits exactly
    with pytest.raises(tinker.APIStatusError) as info:
        sample(sampler, 1)
    assert info.value.status_code == 403
    assert "stability records" in str(info.value) and "quota" in str(info.value)
    assert store.bytes_of_tenant(tenant) <= policy.quota_bytes


def test_a_finished_session_takes_its_records(server, base_model):
    sc = connect(server, KEY_A)
    (seq,) = sample(recording_sampler(sc, base_model), 1)
    request_id = seq.sequence_id.rpartition(":")[0]
    assert server.service.store.stability_records.get(request_id) is not None
    sc.close("success").result(timeout=30)
    assert server.service.store.stability_records.get(request_id) is None


def test_spans_with_other_losses_are_accepted_unrecorded(run, client_a, base_model):
    """The cookbook attaches provenance to every datum, recorded or not: other losses train on
    the data as sent."""
    tc, _ = run
    unrecorded = client_a.create_sampling_client(base_model=base_model).result()
    (seq,) = sample(unrecorded, 1)
    out = tc.forward_backward([provenance_datum(seq, 1.0)], "importance_sampling").result()
    assert math.isfinite(out.metrics["loss:sum"])
    assert tc.optim_step(ADAM).result().metrics["skipped:max"] == 0.0


def test_a_restart_keeps_a_live_sessions_records(tmp_path):
    config = server_config(tmp_path / "data")
    first = ServerThread(config)
    try:
        base_model = str(first.service.executor.base_path)
        client = tinker.ServiceClient(base_url=first.base_url, api_key=KEY_A)
        seqs = sample(recording_sampler(client, base_model), 2)
    finally:
        first.stop()
    second = ServerThread(config)  # same data dir and port; the session lives on
    try:
        tc = client.create_lora_training_client(base_model=base_model, rank=4, seed=5).result()
        data = [provenance_datum(s, a) for s, a in zip(seqs, (1.0, -1.0), strict=True)]
        out = tc.forward_backward(data, "stable_reinforce").result()
        assert out.metrics["sequences:sum"] == 2
        client.close("success").result(timeout=30)
    finally:
        second.stop()


# --------------------------------------------------------------------------- JSON bodies


def json_datum(seq, span_style: str) -> dict:
    """provenance_datum as a JSON forward_backward body's datum."""
    sampled = list(seq.tokens)
    pad = len(PROMPT) - 1

    def span(kind: str, offset: int, length: int) -> dict:
        body = {"sequence_id": seq.sequence_id, "offset": offset, "length": length}
        return {"type": kind, **body} if span_style == "type" else {f"{kind}_tokens": body}

    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": PROMPT + sampled[:-1]}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": [0] * pad + sampled, "dtype": "int64"},
            "logprobs": {"data": [0.0] * (pad + len(sampled)), "dtype": "float32"},
            "advantages": {"data": [0.0] * pad + [1.0] * len(sampled), "dtype": "float32"},
        },
        "model_input_spans": [span("prompt", 0, len(PROMPT)), span("sampled", 0, len(sampled) - 1)],
        "loss_fn_input_spans": [span("prompt", 1, pad), span("sampled", 0, len(sampled))],
    }


def post_json_forward(server, model_id: str, seq_id: int, data: list[dict]) -> httpx.Response:
    """A JSON forward (stable_reinforce) and its result, polled as the SDK polls."""
    headers = {"X-API-Key": KEY_A}
    body = {
        "model_id": model_id,
        "seq_id": seq_id,
        "forward_input": {"data": data, "loss_fn": "stable_reinforce"},
    }
    url = f"{server.base_url}/api/v1"
    promise = httpx.post(f"{url}/forward_backward", json=body, headers=headers, timeout=30)
    assert promise.status_code == 200, promise.text
    while True:
        out = httpx.post(
            f"{url}/retrieve_future",
            json={"request_id": promise.json()["request_id"]},
            headers=headers,
            timeout=60,
        )
        is_json = out.headers["content-type"].startswith("application/json")
        if not (is_json and out.json().get("type") == "try_again"):
            return out


@pytest.mark.parametrize("span_style", ["type", "proto"])
def test_json_bodies_carry_provenance_and_are_checked(client_a, base_model, server, span_style):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=22).result()
    (seq,) = sample(recording_sampler(client_a, base_model), 1)
    ok = post_json_forward(server, tc.model_id, 1, [json_datum(seq, span_style)])
    assert ok.headers["content-type"] == "application/x-protobuf"
    metrics = pb.ForwardBackwardOutput.FromString(ok.content).metrics
    assert metrics["sequences:sum"] == 1 and metrics["active_tokens:sum"] == len(seq.tokens)
    bad = json_datum(seq, span_style)
    bad["model_input"]["chunks"][0]["tokens"][len(PROMPT)] += 1  # the first sampled token
    refused = post_json_forward(server, tc.model_id, 2, [json_datum(seq, span_style), bad])
    error = refused.json()
    assert error["category"] == "user"
    assert f"data[1]: model_input position {len(PROMPT)}" in error["error"]
    assert f"expected {seq.tokens[0]}, given {seq.tokens[0] + 1}" in error["error"]


# --------------------------------------------------------------------------- odd input


def test_odd_spans_are_refused_naming_them(client_a, base_model, server):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=23).result()
    (seq,) = sample(recording_sampler(client_a, base_model), 1)
    cases = []
    past_end = json_datum(seq, "type")
    past_end["loss_fn_input_spans"][1]["offset"] = 3  # sampled positions [3, 3 + n) do not exist
    cases.append((past_end, "do not exist (it has"))
    negative = json_datum(seq, "type")
    negative["model_input_spans"][0]["offset"] = -1
    cases.append((negative, "offset must be an integer >= 0"))
    malformed = json_datum(seq, "proto")
    malformed["model_input_spans"][1]["sampled_tokens"]["sequence_id"] = "no-colon"
    cases.append((malformed, "has no stability record for this tenant"))
    reserved = json_datum(seq, "type")
    reserved["loss_fn_inputs"]["sampled_sequence"] = {
        "data": [1.0] * len(reserved["loss_fn_inputs"]["advantages"]["data"]),
        "dtype": "float32",
    }
    cases.append((reserved, "is set by this server from the provenance spans"))
    one_sided = json_datum(seq, "type")
    del one_sided["loss_fn_input_spans"]
    cases.append((one_sided, "provenance comes as a pair"))
    flood = json_datum(seq, "type")
    empty = {"type": "sampled", "sequence_id": seq.sequence_id, "offset": 0, "length": 0}
    flood["model_input_spans"] += [empty] * 100  # cost bound: more runs than positions
    cases.append((flood, "at most"))
    for seq_id, (datum, needle) in enumerate(cases, start=1):
        out = post_json_forward(server, tc.model_id, seq_id, [datum])
        assert needle in out.json()["error"], (needle, out.text)


def test_recording_needs_a_sampling_session(server, base_model):
    body = {
        "base_model": base_model,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 2},
        "num_samples": 1,
        "record_stability_info": True,
    }
    out = httpx.post(
        f"{server.base_url}/api/v1/asample", json=body, headers={"X-API-Key": KEY_A}, timeout=30
    )
    assert out.status_code == 400 and "sampling client of a session" in out.json()["error"]


def test_concurrent_recording_samples_never_pass_the_quota(run, server, monkeypatch):
    _, sampler = run
    store = server.service.store.stability_records
    (first,) = sample(sampler, 1)
    record = store.get(first.sequence_id.rpartition(":")[0])
    assert record is not None
    one = 256 + 4 * len(PROMPT) + 8 * 5 + 4 * 2
    quota = store.bytes_of_tenant(record.tenant) + 3 * one
    monkeypatch.setattr(
        server.service.sampling, "stability_policy", StabilityPolicy(quota_bytes=quota)
    )
    futures = []
    for _ in range(8):
        try:
            futures.append(sampler.sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS))
        except tinker.APIStatusError as exc:
            assert exc.status_code == 403
    done = 0
    for future in futures:
        try:
            future.result()
            done += 1
        except (tinker.RequestFailedError, tinker.APIStatusError) as exc:
            assert "quota" in str(exc)
    assert done <= 3 and store.bytes_of_tenant(record.tenant) <= quota
