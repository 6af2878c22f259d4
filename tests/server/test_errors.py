"""Authentication, tenant isolation and user errors: every failure is a clear message, a bad
request fails alone, and nothing leaks across tenants."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from tinker import types
from tinker.proto import request_conv

from tests.server.conftest import KEY_A, KEY_B, VOCAB, rl_datum, sl_datum

GOOD = sl_datum([4, 8, 15, 16, 23, 42])


def _post(server, path: str, key: str | None, **kwargs) -> httpx.Response:
    headers = kwargs.pop("headers", {})
    if key is not None:
        headers["X-API-Key"] = key
    return httpx.post(f"{server.base_url}/api/v1/{path}", headers=headers, timeout=30, **kwargs)


def _fwdbwd_body(
    model_id: str, seq_id: int, data: list[types.Datum], loss_fn: str = "cross_entropy"
) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn),
        model_id=model_id,
        seq_id=seq_id,
    )
    return request_conv.forward_backward_request_to_proto(request).SerializeToString()


def _retrieve(server, key: str, request_id: str) -> httpx.Response:
    return _post(server, "retrieve_future", key, json={"request_id": request_id})


def test_missing_and_wrong_keys_are_rejected(server, base_model):
    response = _post(server, "create_session", None, json={})
    assert response.status_code == 401
    assert response.json() == {
        "error": "missing API key: send it in the X-API-Key header",
        "category": "user",
    }
    response = _post(server, "create_session", "tml-not-a-known-key-000", json={})
    assert response.status_code == 401 and response.json()["error"] == "invalid API key"
    wrong = tinker.ServiceClient(base_url=server.base_url, api_key="tml-not-a-known-key-000")
    with pytest.raises(tinker.AuthenticationError):
        wrong.create_lora_training_client(base_model=base_model, rank=4).result()


def test_other_tenant_gets_not_found(server, client_a, base_model):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=31).result()
    tc.forward_backward([GOOD], "cross_entropy").result()
    state = tc.save_state("private").result().path
    sampler_path = tc.save_weights_for_sampler("private").result().path

    rest_b = tinker.RestClient(base_url=server.base_url, api_key=KEY_B)
    with pytest.raises(tinker.NotFoundError):
        rest_b.get_training_run(tc.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        rest_b.list_checkpoints(tc.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        rest_b.get_weights_info_by_tinker_path(state).result()
    with pytest.raises(tinker.NotFoundError):
        rest_b.delete_checkpoint_from_tinker_path(state).result()
    assert all(
        c.tinker_path not in (state, sampler_path)
        for c in rest_b.list_user_checkpoints().result().checkpoints
    )
    assert all(
        r.training_run_id != tc.model_id for r in rest_b.list_training_runs().result().training_runs
    )

    client_b = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_B)
    try:
        with pytest.raises(tinker.NotFoundError):
            client_b.create_sampling_client(model_path=sampler_path).result()
        with pytest.raises(tinker.NotFoundError):
            client_b.create_training_client_from_state_with_optimizer(state).result()
    finally:
        client_b.close("success").result()

    # raw protocol: B cannot train, poll or sample on A's model
    response = _post(
        server,
        "forward_backward",
        KEY_B,
        content=_fwdbwd_body(tc.model_id, 999, [GOOD]),
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert response.status_code == 404 and response.json()["category"] == "user"
    sample = {
        "model_path": sampler_path,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
        "sampling_params": {"max_tokens": 2},
        "num_samples": 1,
    }
    assert _post(server, "asample", KEY_B, json=sample).status_code == 404
    promise = _post(server, "asample", KEY_A, json=sample).json()
    assert len(promise["sample_sequence_ids"]) == 1
    assert _retrieve(server, KEY_B, promise["request_id"]).status_code == 404
    assert (
        _retrieve(server, KEY_A, promise["request_id"]).headers["content-type"]
        == "application/x-protobuf"
    )
    assert _post(server, "get_info", KEY_B, json={"model_id": tc.model_id}).status_code == 404
    # and A still can
    assert _post(server, "get_info", KEY_A, json={"model_id": tc.model_id}).status_code == 200


def test_bad_requests_fail_alone_with_clear_messages(client_a, base_model):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=32).result()
    bad_token = sl_datum([4, 8, VOCAB + 5, 16])
    with pytest.raises(
        tinker.RequestFailedError,
        match=r"token id 517 at position 2 is outside the vocabulary \[0, 512\)",
    ):
        tc.forward_backward([GOOD, bad_token], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="unknown loss_fn 'hinge'"):
        tc.forward_backward([GOOD], "hinge").result()
    with pytest.raises(
        tinker.RequestFailedError, match="needs loss_fn_inputs 'logprobs', 'advantages'"
    ):
        tc.forward_backward([GOOD], "importance_sampling").result()
    with pytest.raises(tinker.RequestFailedError, match="learning_rate must be >= 0"):
        tc.optim_step(types.AdamParams(learning_rate=-1.0)).result()
    with pytest.raises(tinker.RequestFailedError, match="path '../escape' may only contain"):
        tc.save_state("../escape").result()
    # the client (and its seq order) is still fine after all of that
    result = tc.forward_backward([GOOD], "cross_entropy").result()
    assert np.isfinite(result.metrics["loss:sum"])
    assert (
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["skipped:max"] == 0.0
    )

    sampler = tc.save_weights_and_get_sampling_client().result()
    with pytest.raises(
        tinker.RequestFailedError, match="prompt token 9999 at position 1 is outside the vocabulary"
    ):
        sampler.sample(
            types.ModelInput.from_ints([3, 9999]), 1, types.SamplingParams(max_tokens=2)
        ).result()
    ok = sampler.sample(
        types.ModelInput.from_ints([3, 4]), 1, types.SamplingParams(max_tokens=2, stop=[])
    ).result()
    assert len(ok.sequences[0].tokens) == 2


def test_bad_request_in_a_mixed_batch_does_not_disturb_the_other(
    server, client_a, client_b, base_model
):
    from tests.server.conftest import wait_pending

    tc_a = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=33).result()
    tc_b = client_b.create_lora_training_client(base_model=base_model, rank=8, seed=34).result()
    # a ratio that overflows float32 makes the engine itself reject the batch (not prepare)
    overflow = rl_datum([1, 2], [3, 4], [-200.0, -200.0], 1.0)
    server.service.scheduler.pause()
    try:
        fa = tc_a.forward_backward([overflow], "importance_sampling")
        fb = tc_b.forward_backward([GOOD], "cross_entropy")
        wait_pending(server, 2)
    finally:
        server.service.scheduler.resume()
    with pytest.raises(tinker.RequestFailedError, match="nothing was applied"):
        fa.result()
    assert np.isfinite(fb.result().metrics["loss:sum"])


def test_malformed_protobuf_unknown_model_and_seq_conflicts(server, client_a, base_model):
    headers = {"Content-Type": "application/x-protobuf"}
    response = _post(
        server, "forward_backward", KEY_A, content=b"\xff\xff\xff garbage", headers=headers
    )
    assert response.status_code == 400
    assert response.json()["category"] == "user" and "protobuf" in response.json()["error"]
    response = _post(
        server,
        "forward_backward",
        KEY_A,
        content=_fwdbwd_body("nope:train:0", 1, [GOOD]),
        headers=headers,
    )
    assert (
        response.status_code == 404
        and "unknown model_id 'nope:train:0'" in response.json()["error"]
    )
    response = _post(
        server,
        "optim_step",
        KEY_A,
        json={"model_id": "nope:train:0", "seq_id": 1, "adam_params": {"learning_rate": 0.1}},
    )
    assert response.status_code == 404
    response = _post(server, "optim_step", KEY_A, json={"model_id": "x", "seq_id": "one"})
    assert response.status_code == 400 and "seq_id" in response.json()["error"]
    assert (
        _post(server, "retrieve_future", KEY_A, json={"request_id": "no-such-request"}).status_code
        == 404
    )
    assert (
        httpx.get(f"{server.base_url}/api/v1/no/such/route", headers={"X-API-Key": KEY_A}).json()[
            "category"
        ]
        == "user"
    )
    with pytest.raises(tinker.BadRequestError, match="not served here"):
        client_a.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="lora_config.rank must be between 1 and 16"):
        client_a.create_lora_training_client(base_model=base_model, rank=64).result()

    # a model driven only by raw requests from here on (its SDK client never sends again)
    tc = client_a.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=35).result()
    body = _fwdbwd_body(tc.model_id, 1, [GOOD])
    first = _post(server, "forward_backward", KEY_A, content=body, headers=headers).json()
    again = _post(server, "forward_backward", KEY_A, content=body, headers=headers).json()
    assert first["request_id"] == again["request_id"]  # a retry gets the original future
    other = _post(
        server,
        "forward_backward",
        KEY_A,
        content=_fwdbwd_body(tc.model_id, 1, [GOOD, GOOD]),
        headers=headers,
    )
    assert (
        other.status_code == 400 and "already used by a different request" in other.json()["error"]
    )
    # a malformed datum still takes its seq: it fails as a future, and seq 3 runs after it
    broken = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]},
    )
    bad = _post(
        server,
        "forward_backward",
        KEY_A,
        content=_fwdbwd_body(tc.model_id, 2, [broken]),
        headers=headers,
    ).json()
    later = _post(
        server,
        "optim_step",
        KEY_A,
        json={"model_id": tc.model_id, "seq_id": 3, "adam_params": {"learning_rate": 1e-3}},
    ).json()
    failed = _retrieve(server, KEY_A, bad["request_id"]).json()
    assert (
        failed["category"] == "user"
        and "target_tokens" in failed["error"]
        and "shape [2]" in failed["error"]
    )
    assert _retrieve(server, KEY_A, later["request_id"]).json()["metrics"]["step:max"] == 1.0
    done = _retrieve(server, KEY_A, first["request_id"])
    assert done.headers["content-type"] == "application/x-protobuf"
    # zstd-compressed bodies (the SDK's proto_compress_fwdbwd flag) are accepted too
    packed = zstandard.ZstdCompressor().compress(_fwdbwd_body(tc.model_id, 4, [GOOD]))
    promise = _post(
        server,
        "forward_backward",
        KEY_A,
        content=packed,
        headers={**headers, "Content-Encoding": "zstd"},
    ).json()
    assert (
        _retrieve(server, KEY_A, promise["request_id"]).headers["content-type"]
        == "application/x-protobuf"
    )
    garbage = _post(
        server,
        "forward_backward",
        KEY_A,
        content=b"not zstd",
        headers={**headers, "Content-Encoding": "zstd"},
    )
    assert garbage.status_code == 400 and "zstd" in garbage.json()["error"]
