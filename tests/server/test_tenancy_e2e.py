"""A service for many tenants, end to end through the official `tinker` SDK (issue 22):
- twelve clients on a server with two training slots all train at once; every one finishes,
  and each run equals the same run trained alone on a server with a slot for every run;
- past the queue bound the server answers 429 with Retry-After, and the SDK's call still
  succeeds (seen on the wire by a relaying proxy), without a request lost or run twice;
- a restart keeps what was metered and enforces a TTL that expired while the server was down.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from lorafleet.server.main import ServerThread, free_port
from lorafleet.server.state.paths import checkpoint_dir, parse_tinker_path
from tests.server.conftest import KEY_A, server_config, sl_datum, wait_pending

CLIENTS = 12
STEPS = 3
LEARNING_RATE = 1e-2
# The mixed-batch tolerances the existing tests state: per-step log-probs and grad norms as in
# tests/server/test_batching.py, final weights and Adam moments as in tests/reliability/load.py
# (WEIGHT_RTOL: the largest difference over the tensor's largest value).
LOGPROB_RTOL = LOGPROB_ATOL = 1e-5
WEIGHT_RTOL = 1e-2
PROBE = [sl_datum([40, 41, 42, 43, 44, 45, 46, 47])]


def _keys(count: int, tag: str) -> list[str]:
    return [f"tml-{tag}-{i:02d}-0123456789abcdef" for i in range(count)]


def _batch(client: int, step: int) -> list[types.Datum]:
    """1-3 rows of 4-24 tokens, different per client and step, so batches pad unevenly."""
    rng = random.Random(client * 7919 + step)
    return [
        sl_datum([rng.randrange(3, 500) for _ in range(rng.randint(4, 24))])
        for _ in range(rng.randint(1, 3))
    ]


@dataclass
class Trace:
    logprobs: list[list[np.ndarray]] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    probe: list[np.ndarray] = field(default_factory=list)
    state: str = ""


def _logprobs(out: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def _train(service: tinker.ServiceClient, base_model: str, client: int) -> Trace:
    trace = Trace()
    tc = service.create_lora_training_client(
        base_model=base_model, rank=4, seed=100 + client
    ).result()
    for step in range(STEPS):
        fwd = tc.forward_backward(_batch(client, step), "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=LEARNING_RATE))
        trace.logprobs.append(_logprobs(fwd.result()))
        metrics = opt.result().metrics or {}
        assert metrics.get("step:max") == step + 1, metrics
        trace.grad_norms.append(metrics["grad_norm:mean"])
    trace.probe = _logprobs(tc.forward(PROBE, "cross_entropy").result())
    trace.state = tc.save_state(f"final-{client}").result().path
    return trace


def _state_tensors(server: ServerThread, tinker_path: str) -> dict[str, torch.Tensor]:
    row = server.service.store.checkpoints.get(tinker_path)
    assert row is not None, tinker_path
    directory = checkpoint_dir(
        Path(server.config.data_dir), row.tenant, parse_tinker_path(tinker_path)
    )
    tensors = load_file(directory / "weights.safetensors")
    tensors.update(
        {f"optimizer/{k}": v for k, v in load_file(directory / "optimizer.safetensors").items()}
    )
    return tensors


def _stats(server: ServerThread, key: str | None = None) -> dict:
    key = key or server.config.api_keys[0]
    response = httpx.get(
        f"{server.base_url}/api/v1/lorafleet/stats", headers={"X-API-Key": key}, timeout=30
    )
    response.raise_for_status()
    return response.json()


@pytest.fixture(scope="module")
def two_slots(tmp_path_factory) -> Iterator[ServerThread]:
    config = server_config(tmp_path_factory.mktemp("two-slots"))
    engine = dataclasses.replace(config.engine, max_adapters=2)
    srv = ServerThread(dataclasses.replace(config, engine=engine, api_keys=_keys(CLIENTS, "slots")))
    yield srv
    srv.stop()


def test_twelve_clients_on_two_slots_all_finish_and_equal_their_solo_runs(
    two_slots, server, client_a
):
    base_model = str(two_slots.service.executor.base_path)
    services = [
        tinker.ServiceClient(base_url=two_slots.base_url, api_key=key)
        for key in _keys(CLIENTS, "slots")
    ]
    start = threading.Barrier(CLIENTS)
    traces: dict[int, Trace] = {}
    errors: list[str] = []

    def run(client: int) -> None:
        try:
            start.wait()
            traces[client] = _train(services[client], base_model, client)
        except Exception as exc:  # noqa: BLE001 - reported below, with the client it failed
            errors.append(f"client {client}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(CLIENTS)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert not errors, errors
        assert sorted(traces) == list(range(CLIENTS))
        # the twelve really shared two slots: runs were paged out and back in, and no batch
        # held more runs than there are slots
        stats = _stats(two_slots)
        paging = stats["paging"]["training"]
        assert sum(paging["page_ins"].values()) >= CLIENTS, paging
        assert paging["runs"]["hot"] <= 2, paging
        assert stats["max_batch_clients"]["forward_backward"] <= 2, stats["max_batch_clients"]
        assert stats["max_batch_clients"]["optim_step"] <= 2, stats["max_batch_clients"]
    finally:
        for service in services:
            service.close("success").result(timeout=30)

    # Each run alone, one after another, on the session's server (a slot for every run).
    solo_base = str(server.service.executor.base_path)
    for client in range(CLIENTS):
        solo = _train(client_a, solo_base, client)
        mixed = traces[client]
        for step in range(STEPS):
            for x, y in zip(solo.logprobs[step], mixed.logprobs[step], strict=True):
                np.testing.assert_allclose(y, x, rtol=LOGPROB_RTOL, atol=LOGPROB_ATOL)
            assert np.isclose(mixed.grad_norms[step], solo.grad_norms[step], rtol=LOGPROB_RTOL)
        for x, y in zip(solo.probe, mixed.probe, strict=True):
            np.testing.assert_allclose(y, x, rtol=LOGPROB_RTOL, atol=LOGPROB_ATOL)
        alone = _state_tensors(server, solo.state)
        shared = _state_tensors(two_slots, mixed.state)
        assert sorted(alone) == sorted(shared)
        for name, expected in alone.items():
            scale = float(expected.double().abs().max()) or 1.0
            rel = float((shared[name].double() - expected.double()).abs().max()) / scale
            assert rel <= WEIGHT_RTOL, f"client {client}: {name} differs by {rel:.3g}"


# ============================================================================ the queue bound

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class WireLog:
    """A relaying loopback proxy that keeps every response's status and Retry-After, headers
    and bodies passed through unchanged, so the SDK sees exactly what the server answered."""

    def __init__(self, upstream: str):
        self.seen: list[tuple[str, int, str | None]] = []  # (path, status, Retry-After)
        self._client = httpx.Client(base_url=upstream, timeout=120)
        log = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                return  # the test reads `seen`

            def _relay(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
                response = log._client.request(
                    self.command, self.path, content=body, headers=headers
                )
                log.seen.append(
                    (self.path, response.status_code, response.headers.get("retry-after"))
                )
                self.send_response(response.status_code)
                for name, value in response.headers.items():
                    if name.lower() not in HOP_HEADERS and name.lower() != "content-encoding":
                        self.send_header(name, value)
                self.send_header("content-length", str(len(response.content)))
                self.end_headers()
                self.wfile.write(response.content)

            do_GET = do_POST = do_PUT = do_DELETE = _relay

        self._server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def refused(self) -> list[tuple[str, int, str | None]]:
        return [entry for entry in self.seen if entry[1] == 429]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._client.close()


QUEUE_BOUND = 2
BOUND_CALLS = 5


def test_past_the_queue_bound_the_sdk_gets_429_with_retry_after_and_its_calls_succeed(tmp_path):
    config = server_config(tmp_path / "data", max_queued_ops=QUEUE_BOUND, queue_retry_after_s=1.0)
    srv = ServerThread(config)
    wire = WireLog(srv.base_url)
    service = tinker.ServiceClient(base_url=wire.base_url, api_key=KEY_A)
    try:
        tc = service.create_lora_training_client(
            base_model=str(srv.service.executor.base_path), rank=4, seed=7
        ).result()
        data = _batch(0, 0)
        expected = _logprobs(tc.forward(data, "cross_entropy").result())
        executed = dict(srv.service.scheduler.stats.requests)
        srv.service.scheduler.pause()
        try:
            calls = [tc.forward_backward(data, "cross_entropy") for _ in range(BOUND_CALLS)]
            wait_pending(srv, QUEUE_BOUND)
            deadline = time.monotonic() + 30
            while not wire.refused() and time.monotonic() < deadline:
                time.sleep(0.05)
            refused = wire.refused()
            # while the queue is full nothing more is queued: the others were refused
            assert srv.service.scheduler.pending() == QUEUE_BOUND
        finally:
            srv.service.scheduler.resume()
        assert refused, "no request was refused past the queue bound"
        assert all(path.endswith("/forward_backward") for path, _, _ in refused), refused
        assert all(after is not None and int(after) >= 1 for _, _, after in refused), refused
        # every call succeeds after the SDK's own retries, with the result it would have had
        for call in calls:
            for x, y in zip(expected, _logprobs(call.result(timeout=120)), strict=True):
                np.testing.assert_allclose(y, x, rtol=LOGPROB_RTOL, atol=LOGPROB_ATOL)
        metrics = tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics or {}
        assert metrics.get("step:max") == 1, metrics
        # each call ran exactly once: none lost, none run twice
        now = srv.service.scheduler.stats.requests
        assert now["forward_backward"] - executed.get("forward_backward", 0) == BOUND_CALLS
        assert srv.service.admission.refused >= len(refused)
    finally:
        service.close("success").result(timeout=30)
        wire.close()
        srv.stop()


# ============================================================================ across a restart

TTL_S = 2


def _usage(server: ServerThread, key: str = KEY_A) -> dict:
    response = httpx.get(
        f"{server.base_url}/api/v1/lorafleet/usage", headers={"X-API-Key": key}, timeout=30
    )
    response.raise_for_status()
    return response.json()


def test_a_restart_keeps_usage_and_enforces_a_ttl_that_expired_while_down(tmp_path):
    # The first server's maintenance never gets to the checkpoint (its interval is an hour):
    # whatever the timing, the TTL is enforced by the server after the restart.
    config = server_config(tmp_path / "data", maintenance_interval_s=3600.0)
    first = ServerThread(config)
    try:
        service = tinker.ServiceClient(base_url=first.base_url, api_key=KEY_A)
        tc = service.create_lora_training_client(
            base_model=str(first.service.executor.base_path), rank=4, seed=3
        ).result()
        for step in range(2):
            tc.forward_backward(_batch(1, step), "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        expiring = tc.save_state("expiring", ttl_seconds=TTL_S).result().path
        kept = tc.save_state("kept").result().path
        expiring_dir = checkpoint_dir(
            Path(config.data_dir),
            first.service.store.checkpoints.get(expiring).tenant,
            parse_tinker_path(expiring),
        )
        expires_at = first.service.store.checkpoints.get(expiring).expires_at
        before = _usage(first)
        service.close("success").result(timeout=30)
    finally:
        first.stop()
    trained = sum(len(d.model_input.to_ints()) for step in range(2) for d in _batch(1, step))
    assert before["totals"]["trained_tokens"] == trained, before["totals"]
    assert before["totals"]["optimizer_steps"] == 2, before["totals"]
    assert before["storage"]["checkpoint_bytes"] > 0
    assert expiring_dir.is_dir()
    time.sleep(max(0.0, expires_at - time.time()) + 0.3)  # it runs out while no server is up

    second = ServerThread(dataclasses.replace(config, maintenance_interval_s=0.5))
    try:
        after = _usage(second)
        for counter in ("trained_tokens", "optimizer_steps"):
            assert after["totals"][counter] == before["totals"][counter], counter
        assert after["runs"][tc.model_id]["trained_tokens"] == trained
        service = tinker.ServiceClient(base_url=second.base_url, api_key=KEY_A)
        # refused: as expired, or as unknown once maintenance has deleted it
        with pytest.raises(
            (tinker.NotFoundError, tinker.RequestFailedError),
            match=r"(checkpoint tinker://\S+ has expired|unknown checkpoint tinker://)",
        ):
            service.create_training_client_from_state(expiring).result()
        deadline = time.monotonic() + 15
        while expiring_dir.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not expiring_dir.exists(), "the expired checkpoint was not deleted after restart"
        assert second.service.store.checkpoints.get(expiring) is None
        rest = tinker.RestClient(base_url=second.base_url, api_key=KEY_A)
        listed = {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
        assert listed == {kept}
        # its storage is reclaimed in the usage, and the checkpoint that had no TTL still loads
        assert (
            0
            < _usage(second)["storage"]["checkpoint_bytes"]
            < before["storage"]["checkpoint_bytes"]
        )
        service.create_training_client_from_state(kept).result()
        service.close("success").result(timeout=30)
    finally:
        second.stop()
