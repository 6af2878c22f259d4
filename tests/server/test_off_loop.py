"""Every route's blocking work runs off the event loop (http/off_loop.py, issue 31): while one
request's body is being decoded, /healthz and other tenants are answered; a tenant's requests
reach intake in the order they arrived; big bodies never hold every worker; and an error
raised off the loop answers the same 4xx/5xx as before.

No timings: the work under test blocks on an event until the test has seen what it must see
(the generous timeouts only turn a hang into a failure)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import numpy as np
import pytest
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from lorafleet.server.errors import ServerFault, UserError
from lorafleet.server.http import proto
from lorafleet.server.http.off_loop import Lanes
from lorafleet.server.main import ServerThread
from tests.server.conftest import KEY_A, KEY_B, connect

API = "/api/v1"
WAIT_S = 60.0  # only ever reached when something hangs


# =============================================================================== the lanes


def _gather(lanes: Lanes, jobs: list[tuple[str, Callable[[], Any], int]]) -> list[Any]:
    """Hands `jobs` (lane, work, size) over in this order from one event loop, as routes do,
    and returns their results (exceptions as values)."""

    async def scenario() -> list[Any]:
        calls = [lanes.run(lane, work, size=size) for lane, work, size in jobs]
        return list(await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), WAIT_S))

    return asyncio.run(scenario())


def test_a_lane_runs_one_job_at_a_time_in_order_while_other_lanes_go_on():
    lanes = Lanes(4)
    release = threading.Event()
    log: list[str] = []
    lock = threading.Lock()
    running = {"a": 0, "b": 0}
    most = {"a": 0, "b": 0}

    def job(lane: str, i: int) -> Callable[[], str]:
        def work() -> str:
            with lock:
                running[lane] += 1
                most[lane] = max(most[lane], running[lane])
                log.append(f"{lane}{i}")
            if lane == "a" and i == 0:
                # lane b's ten jobs all run while a0 holds its lane: a1 must not start meanwhile
                assert b_done.wait(WAIT_S)
                with lock:
                    assert "a1" not in log
                release.set()
            with lock:
                running[lane] -= 1
            if lane == "b" and i == 9:
                b_done.set()
            return f"{lane}{i}"

        return work

    b_done = threading.Event()
    jobs = [("a", job("a", i), 0) for i in range(10)] + [("b", job("b", i), 0) for i in range(10)]
    try:
        results = _gather(lanes, jobs)
    finally:
        lanes.close()
    assert results == [f"a{i}" for i in range(10)] + [f"b{i}" for i in range(10)]
    assert [x for x in log if x[0] == "a"] == [f"a{i}" for i in range(10)]
    assert [x for x in log if x[0] == "b"] == [f"b{i}" for i in range(10)]
    assert most == {"a": 1, "b": 1}
    assert release.is_set()


def test_big_bodies_hold_at_most_their_workers_and_small_requests_still_run():
    """Two flooding tenants' big bodies with one large slot: the second waits for the first,
    and a third tenant's small request runs meanwhile."""
    lanes = Lanes(3, large_bytes=1000, large_workers=1)
    first_in, release = threading.Event(), threading.Event()
    started: list[str] = []

    def big(name: str) -> Callable[[], str]:
        def work() -> str:
            started.append(name)
            if name == "big-1":
                first_in.set()
                assert release.wait(WAIT_S)
            return name

        return work

    def small() -> str:
        assert first_in.wait(WAIT_S)
        assert started == ["big-1"]  # big-2 waits for the large slot, small did not
        release.set()
        return "small"

    try:
        results = _gather(
            lanes,
            [("t1", big("big-1"), 5000), ("t2", big("big-2"), 5000), ("t3", small, 10)],
        )
    finally:
        lanes.close()
    assert results == ["big-1", "big-2", "small"]
    assert started == ["big-1", "big-2"]


def test_errors_raised_off_the_loop_reach_the_caller_unchanged():
    lanes = Lanes(2)
    bad = UserError("field x: value 3 is not allowed", status=413)

    def refuse() -> None:
        raise bad

    try:
        (result,) = _gather(lanes, [("t", refuse, 0)])
    finally:
        lanes.close()
    assert result is bad


def test_close_fails_what_is_queued_with_a_server_error():
    lanes = Lanes(1)
    entered, release = threading.Event(), threading.Event()
    outcomes: list[Any] = []

    def blocking() -> str:
        entered.set()
        assert release.wait(WAIT_S)
        return "ran"

    lanes.submit("t", blocking, lambda r, e: outcomes.append(r if e is None else e))
    lanes.submit("t", lambda: "never", lambda r, e: outcomes.append(r if e is None else e))
    assert entered.wait(WAIT_S)
    closing = threading.Thread(target=lanes.close)
    closing.start()
    release.set()
    closing.join(WAIT_S)
    assert not closing.is_alive()
    assert len(outcomes) == 2 and "ran" in outcomes
    (dropped,) = [o for o in outcomes if o != "ran"]
    assert isinstance(dropped, ServerFault) and dropped.status == 500
    with pytest.raises(ServerFault):
        lanes.submit("t", lambda: None, lambda r, e: None)


@pytest.mark.parametrize(
    ("workers", "large"), [(0, None), (2, 0), (2, 3)], ids=["no-workers", "no-large", "too-many"]
)
def test_bad_pool_sizes_are_refused_naming_the_value(workers: int, large: int | None):
    with pytest.raises(ValueError, match=str(large if workers else workers)):
        Lanes(workers, large_workers=large)


# =============================================================================== the server


def fwd_bwd_body(model_id: str, seq_id: int, rows: int = 2, tokens: int = 8) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    for r in range(rows):
        seq = np.arange(3 + r, 4 + r + tokens)
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = seq[:-1].astype(np.int32).tobytes()
        target = datum.loss_fn_inputs["target_tokens"]
        target.dtype, target.dense = pb.DTYPE_INT64, seq[1:].astype(np.int64).tobytes()
        target.shape.append(tokens)
        weights = datum.loss_fn_inputs["weights"]
        weights.dtype, weights.dense = pb.DTYPE_FLOAT32, np.ones(tokens, np.float32).tobytes()
        weights.shape.append(tokens)
    return msg.SerializeToString()


@pytest.fixture
def run_a(server: ServerThread, base_model: str) -> Iterator[str]:
    """A training run of tenant A, created through the SDK; its model id."""
    sc = connect(server, KEY_A)
    tc = sc.create_lora_training_client(base_model=base_model, rank=4, seed=0).result()
    yield tc.get_info().model_id
    sc.close("success").result(timeout=30)


@contextmanager
def decoding_held(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[threading.Event, threading.Event]]:
    """forward_backward's data decoding blocks (on its worker) until `release` is set;
    `entered` is set once it is blocked."""
    entered, release = threading.Event(), threading.Event()
    real = proto.decode_call

    def held(msg: pb.ForwardBackwardRequest) -> Any:
        entered.set()
        assert release.wait(WAIT_S)
        return real(msg)

    monkeypatch.setattr(proto, "decode_call", held)
    try:
        yield entered, release
    finally:
        release.set()


def _client(server: ServerThread, key: str | None = KEY_A) -> httpx.Client:
    headers = {"X-API-Key": key} if key else {}
    return httpx.Client(base_url=server.base_url, headers=headers, timeout=WAIT_S)


def test_healthz_and_other_tenants_are_answered_while_a_body_is_decoded(
    server: ServerThread, run_a: str, monkeypatch: pytest.MonkeyPatch
):
    with (
        decoding_held(monkeypatch) as (entered, release),
        ThreadPoolExecutor(1) as pool,
        _client(server) as a,
        _client(server, None) as probe,
        _client(server, KEY_B) as b,
    ):
        sending = pool.submit(
            a.post,
            f"{API}/forward_backward",
            content=fwd_bwd_body(run_a, 1),
            headers={"Content-Type": "application/x-protobuf"},
        )
        assert entered.wait(WAIT_S)
        # the decode holds its worker, not the loop: both are answered while it is held
        assert probe.get(f"{API}/healthz").status_code == 200
        session = b.post(f"{API}/create_session", json={"tags": []})
        assert session.status_code == 200, session.text
        assert not sending.done()
        release.set()
        reply = sending.result(WAIT_S)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model_id"] == run_a


def test_a_tenants_later_request_reaches_intake_after_its_earlier_one(
    server: ServerThread, run_a: str, monkeypatch: pytest.MonkeyPatch
):
    """forward_backward (seq 1), held in decoding, then optim_step (seq 2) of the same tenant:
    the optim_step waits in the tenant's lane, and reaches intake only after seq 1 did."""
    service = server.service
    optim_body = json.dumps(
        {"model_id": run_a, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}}
    ).encode()
    handed_over = threading.Event()
    real_submit = service.lanes.submit

    def submit(lane: str, work: Any, deliver: Any, *, size: int = 0) -> None:
        real_submit(lane, work, deliver, size=size)
        if size == len(optim_body):  # the optim_step's body, read and queued in its lane
            handed_over.set()

    monkeypatch.setattr(service.lanes, "submit", submit)
    reached: list[int] = []
    real_to_model = service.intake.submit_to_model

    def to_model(tenant: Any, model: Any, seq_id: int, op: Any, fingerprint: str) -> Any:
        reached.append(seq_id)
        return real_to_model(tenant, model, seq_id, op, fingerprint)

    monkeypatch.setattr(service.intake, "submit_to_model", to_model)
    with (
        decoding_held(monkeypatch) as (entered, release),
        ThreadPoolExecutor(2) as pool,
        _client(server) as a,
    ):
        fwd = pool.submit(
            a.post,
            f"{API}/forward_backward",
            content=fwd_bwd_body(run_a, 1),
            headers={"Content-Type": "application/x-protobuf"},
        )
        assert entered.wait(WAIT_S)
        opt = pool.submit(
            a.post,
            f"{API}/optim_step",
            content=optim_body,
            headers={"Content-Type": "application/json"},
        )
        assert handed_over.wait(WAIT_S)
        assert reached == []  # seq 2 waits behind seq 1, whose decoding is held
        release.set()
        replies = fwd.result(WAIT_S), opt.result(WAIT_S)
    assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
    assert reached == [1, 2]
    with _client(server) as a:
        for reply in replies:
            result = _result(a, reply.json()["request_id"])
            assert "error" not in result, result


def _until(condition: Callable[[], bool]) -> None:
    event = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):
        if condition():
            return
        event.wait(0.01)
    raise AssertionError("the condition never held")


def _result(client: httpx.Client, request_id: str) -> dict[str, Any]:
    while True:
        reply = client.post(f"{API}/retrieve_future", json={"request_id": request_id})
        assert reply.status_code == 200, reply.text
        if reply.headers["content-type"].startswith("application/json"):
            body = reply.json()
            if body.get("type") == "try_again":
                continue
            return dict(body)
        return {"protobuf": len(reply.content)}


def test_errors_raised_off_the_loop_answer_as_before(
    server: ServerThread, run_a: str, monkeypatch: pytest.MonkeyPatch
):
    proto_headers = {"Content-Type": "application/x-protobuf"}
    with _client(server) as a:
        not_proto = a.post(f"{API}/forward_backward", content=b"\xff" * 64, headers=proto_headers)
        assert not_proto.status_code == 400
        assert "not a valid protobuf ForwardBackwardRequest" in not_proto.json()["error"]

        not_zstd = a.post(
            f"{API}/forward_backward",
            content=b"plain bytes",
            headers={**proto_headers, "Content-Encoding": "zstd"},
        )
        assert not_zstd.status_code == 400 and "not valid zstd" in not_zstd.json()["error"]

        limit = server.config.max_body_bytes
        bomb = zstandard.ZstdCompressor().compress(b"\0" * (limit + 1))
        too_big = a.post(
            f"{API}/forward_backward",
            content=bomb,
            headers={**proto_headers, "Content-Encoding": "zstd"},
        )
        assert too_big.status_code == 413, too_big.text

        foreign = a.post(
            f"{API}/forward_backward", content=fwd_bwd_body("nobody:0", 1), headers=proto_headers
        )
        assert foreign.status_code == 404, foreign.text

        not_json = a.post(
            f"{API}/optim_step", content=b"{nope", headers={"Content-Type": "application/json"}
        )
        assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]

        unknown = a.post(f"{API}/retrieve_future", json={"request_id": "no-such-request"})
        assert unknown.status_code == 404 and "unknown request_id" in unknown.json()["error"]

        def crash(*args: Any) -> Any:
            raise RuntimeError("boom")

        monkeypatch.setattr(server.service.training, "optim_step", crash)
        crashed = a.post(
            f"{API}/optim_step",
            json={"model_id": run_a, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}},
        )
        assert crashed.status_code == 500 and crashed.json()["category"] == "server"
    # the server goes on (on a new connection: Starlette closes one after an unhandled error,
    # as it did when the work ran on the loop): the tenant's lane and the loop still answer
    with _client(server) as again:
        assert again.get(f"{API}/healthz").status_code == 200
        assert again.post(f"{API}/create_session", json={"tags": []}).status_code == 200


def test_many_concurrent_requests_of_two_tenants_all_answer_and_the_lanes_drain(
    server: ServerThread,
):
    """An outside tester's burst: 96 requests at once over two tenants, good and bad mixed,
    each answered as it would be alone; nothing is left queued in the lanes afterwards."""

    async def burst() -> list[int]:
        async with (
            httpx.AsyncClient(
                base_url=server.base_url, headers={"X-API-Key": KEY_A}, timeout=WAIT_S
            ) as a,
            httpx.AsyncClient(
                base_url=server.base_url, headers={"X-API-Key": KEY_B}, timeout=WAIT_S
            ) as b,
        ):
            calls = []
            for i in range(48):
                client = a if i % 2 else b
                calls += [
                    client.post(f"{API}/create_session", json={"tags": [f"burst-{i}"]}),
                    client.post(f"{API}/retrieve_future", json={"request_id": f"nope-{i}"}),
                ]
            replies = await asyncio.gather(*calls)
            return [r.status_code for r in replies]

    codes = asyncio.run(burst())
    assert codes == [200, 404] * 48
    _until(lambda: server.service.lanes.stats().queued == 0)
    assert server.service.lanes.stats().workers <= server.config.request_workers
