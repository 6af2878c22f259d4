"""Queue, don't fail (issue 22, item 2): requests wait in the queues; only past
`max_queued_ops` does the server answer 429 with Retry-After, and the real SDK's call then
still succeeds, run once, in its seq_id order."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import tinker
from tinker import types

from lorafleet.server.main import ServerThread
from lorafleet.server.ops.admission import Admission, QueueFull
from tests.server.conftest import KEY_A, KEY_B, server_config, sl_datum, wait_pending

BOUND = 2


@pytest.fixture(scope="module")
def bounded(tmp_path_factory) -> Iterator[ServerThread]:
    server = ServerThread(
        server_config(tmp_path_factory.mktemp("queue-bound"), max_queued_ops=BOUND)
    )
    yield server
    server.stop()


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def test_past_the_bound_the_answer_is_429_and_the_sdk_call_still_succeeds(bounded):
    service = bounded.service
    client = tinker.ServiceClient(base_url=bounded.base_url, api_key=KEY_A)
    try:
        tc = client.create_lora_training_client(
            base_model=str(service.executor.base_path), rank=4, seed=3
        ).result()
        data = [[sl_datum([3, 6, 9, 12 + i])] for i in range(3)]
        ran = service.scheduler.stats.requests["forward_backward"]
        refused = service.admission.refused
        service.scheduler.pause()
        try:
            futures = [tc.forward_backward(d, "cross_entropy") for d in data[:BOUND]]
            wait_pending(bounded, BOUND)
            futures.append(tc.forward_backward(data[BOUND], "cross_entropy"))
            _wait(lambda: service.admission.refused > refused, 30, "no 429 was answered")
            # what the SDK got, seen on the wire: 429, Retry-After, a body naming the bound
            reply = httpx.post(
                f"{bounded.base_url}/api/v1/optim_step",
                headers={"X-API-Key": KEY_A},
                json={
                    "model_id": tc.model_id,
                    "seq_id": 99,
                    "type": "optim_step",
                    "adam_params": {"learning_rate": 1e-3},
                },
            )
            assert reply.status_code == 429
            assert reply.headers["retry-after"] == "1"
            assert "max_queued_ops 2" in reply.json()["error"]
            assert service.store.futures.find(tc.model_id, 99) is None  # not recorded
        finally:
            service.scheduler.resume()
        outputs = [f.result(timeout=120) for f in futures]
        assert all(o.loss_fn_outputs for o in outputs)
        # each call ran once: the retried one neither lost nor duplicated
        assert service.scheduler.stats.requests["forward_backward"] == ran + 3
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
    finally:
        client.close("success").result(timeout=30)


def test_another_tenant_waits_for_room_too(bounded):
    """The bound is the server's: B's sample, refused while A fills it, succeeds once A drains."""
    service = bounded.service
    a = tinker.ServiceClient(base_url=bounded.base_url, api_key=KEY_A)
    b = tinker.ServiceClient(base_url=bounded.base_url, api_key=KEY_B)
    try:
        base = str(service.executor.base_path)
        tc = a.create_lora_training_client(base_model=base, rank=4, seed=4).result()
        sampler = b.create_sampling_client(base_model=base).result()
        refused = service.admission.refused
        service.scheduler.pause()
        try:
            held = [tc.forward_backward([sl_datum([3, 4, 5, 6])], "cross_entropy") for _ in "ab"]
            wait_pending(bounded, BOUND)
            sample = sampler.sample(
                types.ModelInput.from_ints([5, 6, 7]),
                1,
                types.SamplingParams(max_tokens=3, temperature=0.0, stop=[]),
            )
            _wait(lambda: service.admission.refused > refused, 30, "no 429 was answered")
        finally:
            service.scheduler.resume()
        assert len(sample.result(timeout=120).sequences[0].tokens) == 3
        assert all(f.result(timeout=60).loss_fn_outputs for f in held)
    finally:
        a.close("success").result(timeout=30)
        b.close("success").result(timeout=30)


class _Futures:
    def __init__(self) -> None:
        self.pending: set[str] = set()

    def is_pending(self, request_id: str) -> bool:
        return request_id in self.pending


def test_a_request_that_queued_ones_wait_on_is_never_refused():
    """The SDK sends a call's first chunk last: refusing it would leave its later chunks
    holding queue places while they wait for it."""
    futures = _Futures()
    admission = Admission(futures, max_queued_ops=2)  # type: ignore[arg-type]
    for seq in (2, 3):
        futures.pending.add(f"r{seq}")
        admission.admit("t", f"r{seq}", "m", seq, None)
    futures.pending.add("r1")
    admission.admit("t", "r1", "m", 1, None)  # the others wait on it: admitted past the bound
    with pytest.raises(QueueFull, match="max_queued_ops 2"):
        admission.admit("t", "r4", "m", 4, None)
    with pytest.raises(QueueFull):
        admission.admit("u", "x1", None, None, None)
    futures.pending -= {"r1", "r2"}  # finished: their places are free again
    futures.pending.add("x1")
    admission.admit("u", "x1", None, None, None)
    assert admission.queued() == 2 and admission.queued("t") == 1


def test_a_tenant_queued_ops_quota_bounds_one_tenant():
    futures = _Futures()
    admission = Admission(futures, max_queued_ops=100)  # type: ignore[arg-type]
    futures.pending.add("a1")
    admission.admit("a", "a1", None, None, 1)
    with pytest.raises(QueueFull, match="quota queued_ops 1"):
        admission.admit("a", "a2", None, None, 1)
    admission.admit("b", "b1", None, None, 1)  # another tenant is not held up by it


@pytest.mark.parametrize("bound", [0, -1, 1.5])
def test_a_queue_bound_that_is_not_a_positive_count_is_refused(bound):
    with pytest.raises(ValueError, match="max_queued_ops"):
        Admission(_Futures(), bound)  # type: ignore[arg-type]


def _json_forward_backward(model_id: str, seq_id: int) -> dict:
    tokens = [3, 6, 9, 12 + seq_id]
    return {
        "model_id": model_id,
        "seq_id": seq_id,
        "forward_backward_input": {
            "loss_fn": "cross_entropy",
            "data": [
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
                    "loss_fn_inputs": {
                        "target_tokens": {"data": tokens[1:], "dtype": "int64"},
                        "weights": {"data": [1.0] * 3, "dtype": "float32"},
                    },
                }
            ],
        },
    }


def test_past_the_bound_a_body_is_refused_before_it_is_decoded(bounded, monkeypatch):
    """A large forward_backward body decoded only to be answered 429 is work every other
    request waits behind (bench/loop_lag.py): the bound is checked once the envelope names the
    model and seq_id. A retry of a request already recorded still gets its first future."""
    from lorafleet.server.http import proto

    service = bounded.service
    client = tinker.ServiceClient(base_url=bounded.base_url, api_key=KEY_A)
    decoded: list[int] = []
    decode = proto.decode_call
    monkeypatch.setattr(
        proto, "decode_call", lambda msg: (decoded.append(msg.seq_id), decode(msg))[1]
    )

    def post(seq_id: int) -> httpx.Response:
        return httpx.post(
            f"{bounded.base_url}/api/v1/forward_backward",
            headers={"X-API-Key": KEY_A},
            json=_json_forward_backward(tc.model_id, seq_id),
            timeout=30,
        )

    try:
        tc = client.create_lora_training_client(
            base_model=str(service.executor.base_path), rank=4, seed=3
        ).result()
        service.scheduler.pause()
        try:
            first = [post(seq).json()["request_id"] for seq in (1, 2)]
            assert decoded == [1, 2]
            refused = post(3)
            assert refused.status_code == 429 and "max_queued_ops 2" in refused.text
            assert decoded == [1, 2]  # seq 3's data was never decoded
            assert service.store.futures.find(tc.model_id, 3) is None
            again = post(1)  # the same request again: its first future, not a 429
            assert again.status_code == 200 and again.json()["request_id"] == first[0]
        finally:
            service.scheduler.resume()
    finally:
        client.close("success").result(timeout=30)
