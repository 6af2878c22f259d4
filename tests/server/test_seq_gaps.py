"""A training client's calls are numbered by the SDK before they are sent; one the server never
runs must not wedge the model. Through the real SDK, behind a proxy that reroutes or drops one
request: a route the server lacks still takes its seq_id (the next call runs at once), and a
request lost on the way is skipped after the gap timeout (the calls behind it run)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import tinker
from tinker import types

from lorafleet import cli
from lorafleet.server.main import ServerThread
from tests.server.conftest import KEY_A, KEY_B, sl_datum
from tests.server.proxy import Proxy, once

API = "/api/v1"
FAST = 15.0  # well under the gap timeout a wedged model would need (30 s default)


def _training_client(
    base_url: str, base_model: str
) -> tuple[tinker.ServiceClient, tinker.TrainingClient]:
    service = tinker.ServiceClient(base_url=base_url, api_key=KEY_A)
    tc = service.create_lora_training_client(base_model=base_model, rank=4, seed=0).result(
        timeout=60
    )
    return service, tc


def _step(tc: tinker.TrainingClient, timeout: float) -> float:
    out = tc.forward_backward([sl_datum([5, 6, 7, 8, 9])], "cross_entropy").result(timeout=timeout)
    return out.metrics["loss:sum"]


@pytest.fixture
def short_gap(server: ServerThread) -> Iterator[float]:
    scheduler = server.service.scheduler
    before = scheduler.gap_timeout_s
    scheduler.gap_timeout_s = 2.0
    yield scheduler.gap_timeout_s
    scheduler.gap_timeout_s = before


def test_unknown_route_takes_its_seq_id(server: ServerThread, base_model: str) -> None:
    """The SDK calls save_state; the proxy sends it to a route this server lacks (as a newer
    SDK's call would be): the call fails with a 404 naming the route, and the same client's
    next call runs at once instead of waiting for the seq_id it consumed."""
    proxy = Proxy(server.base_url, once("POST", f"{API}/save_weights", f"{API}/save_weights_v9"))
    service, tc = _training_client(proxy.base_url, base_model)
    try:
        _step(tc, 60)
        with pytest.raises(
            tinker.NotFoundError, match="does not implement POST /api/v1/save_weights_v9"
        ):
            tc.save_state("lost").result(timeout=60)
        assert proxy.rerouted == [(f"{API}/save_weights", f"{API}/save_weights_v9")]
        began = time.monotonic()
        _step(tc, FAST)
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=FAST)
        assert time.monotonic() - began < FAST
    finally:
        service.close("success").result(timeout=30)
        proxy.close()


def test_unknown_route_answers_404_and_records_nothing_for_others(
    server: ServerThread, base_model: str
) -> None:
    """Without a model, or with another tenant's model, the catch-all only answers the 404: it
    never consumes a seq_id the caller does not own."""
    service, tc = _training_client(server.base_url, base_model)
    try:
        model_id = tc.get_info().model_id
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            alone = http.post(f"{API}/no_such_call", json={}, headers={"X-API-Key": KEY_A})
            assert alone.status_code == 404
            assert alone.json() == {
                "error": "this server does not implement POST /api/v1/no_such_call",
                "category": "user",
            }
            foreign = http.post(
                f"{API}/no_such_call",
                json={"model_id": model_id, "seq_id": 1},
                headers={"X-API-Key": KEY_B},
            )
            assert foreign.status_code == 404
            assert "not recorded: unknown model_id" in foreign.json()["error"]
            not_json = http.post(
                f"{API}/no/such/call", content=b"\x00\x01", headers={"X-API-Key": KEY_A}
            )
            assert not_json.status_code == 404
            audit = http.get(f"{API}/audit", headers={"X-API-Key": KEY_A})
            assert audit.status_code == 404
            assert audit.json()["error"] == "this server does not implement GET /api/v1/audit"
            public = http.post(f"{API}/healthz", json={"model_id": model_id, "seq_id": 1})
            assert public.status_code == 404  # no key: the catch-all reads nothing
        _step(tc, FAST)  # seq_id 1 is still the owner's
    finally:
        service.close("success").result(timeout=30)


def test_lost_request_is_skipped_after_the_gap_timeout(
    server: ServerThread, base_model: str, short_gap: float
) -> None:
    """The proxy drops an optim_step (the SDK has numbered it; the server never sees it). The
    client's next forward_backward waits for the missing seq_id for the gap timeout, then runs;
    the calls after it run at once."""
    proxy = Proxy(server.base_url, once("POST", f"{API}/optim_step", None))
    service, tc = _training_client(proxy.base_url, base_model)
    try:
        _step(tc, 60)
        with pytest.raises(tinker.NotFoundError, match="dropped by the test proxy"):
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
        assert proxy.dropped == [f"{API}/optim_step"]
        began = time.monotonic()
        _step(tc, short_gap + FAST)
        waited = time.monotonic() - began
        assert short_gap <= waited < short_gap + FAST
        began = time.monotonic()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=FAST)
        _step(tc, FAST)
        assert time.monotonic() - began < short_gap  # no second wait
        late = _late_arrival(server, tc.get_info().model_id, seq_id=2)
        assert "arrived after the server gave up waiting for it" in late
    finally:
        service.close("success").result(timeout=30)
        proxy.close()


def _late_arrival(server: ServerThread, model_id: str, seq_id: int) -> str:
    """The skipped request arriving after all (a retry that got through): its future fails."""
    headers = {"X-API-Key": KEY_A}
    body = {"model_id": model_id, "seq_id": seq_id, "adam_params": {"learning_rate": 1e-3}}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        promise = http.post(f"{API}/optim_step", json=body, headers=headers)
        assert promise.status_code == 200, promise.text
        result = http.post(
            f"{API}/retrieve_future",
            json={"request_id": promise.json()["request_id"]},
            headers=headers,
        )
    return str(result.json()["error"])


def test_serve_takes_the_gap_timeout() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(
        ["serve", "--base-model", "m", "--data-dir", "d", "--gap-timeout-s", "5"]
    )
    assert args.gap_timeout_s == 5.0
    assert (
        parser.parse_args(["serve", "--base-model", "m", "--data-dir", "d"]).gap_timeout_s == 30.0
    )
    for bad in ("0", "-1", "inf", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(
                ["serve", "--base-model", "m", "--data-dir", "d", "--gap-timeout-s", bad]
            )
