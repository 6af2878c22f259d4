"""Quota races (issue 34, item 5): many requests at once against one quota must not together
pass it. Two tenants of a tenants-file server:

- a copier whose `storage_bytes` leaves room for its source checkpoint and `room` copies
  (plus half a copy), sending `copies` concurrent `copy_weights` of that checkpoint;
- a sampler whose `sampled_tokens_per_day` leaves room for `room` samples (plus half), sending
  `samples` concurrent samples of `max_tokens` each, which never stop early (`stop: []`).

With `hold` (the default), the engine worker is paused while each wave arrives and resumed once
every request of the wave has been answered 403 or queued: the worst case, where all of them
are admitted while the engine is busy, and the one the outside testers hit.

`quota_overshoot_bytes` is what the copier stores beyond its limit afterwards,
`quota_overshoot_tokens` what the sampler was metered beyond its limit; `quota_overshoot` their
sum (0 when the quotas held). Every answer is a 200 or a 403 naming the quota; anything else is
counted in `unexpected`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from lorafleet.server.main import ServerThread
from tests.reliability.harness import server_config
from tests.server.tenant_files import write_tenants

COPIER = "tml-quota-race-copier-0123456789abcdef"
SAMPLER = "tml-quota-race-sampler-0123456789abcdef"
PROMPT = [5, 17, 33, 60, 91, 120]


def _post(
    server: ServerThread, key: str, path: str, body: Any, timeout: float = 300
) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/api/v1/{path}", json=body, headers={"X-API-Key": key}, timeout=timeout
    )


def _result(server: ServerThread, key: str, request_id: str) -> Any:
    while True:
        reply = _post(server, key, "retrieve_future", {"request_id": request_id})
        body = reply.json() if reply.headers["content-type"].startswith("application/json") else {}
        if body.get("type") != "try_again":
            return reply, body


def _source_checkpoint(server: ServerThread) -> str:
    """The copier's sampler checkpoint, saved through the tinker SDK."""
    import tinker

    from tests.server.conftest import sl_datum

    sc = tinker.ServiceClient(base_url=server.base_url, api_key=COPIER)
    try:
        base = server.service.served.names[0]
        tc = sc.create_lora_training_client(base_model=base, rank=4, seed=1).result()
        tc.forward_backward([sl_datum([3, 4, 5, 6, 7])], "cross_entropy").result()
        return str(tc.save_weights_for_sampler("race-source").result().path)
    finally:
        sc.close("success").result(timeout=30)


def _stored(server: ServerThread, tenant: str) -> int:
    return sum(size for _t, _r, size in server.service.store.checkpoints.bytes_per_run(tenant))


def run_quota_race(
    workdir: Path,
    copies: int = 20,
    samples: int = 20,
    room: int = 2,
    max_tokens: int = 32,
    hold: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    token_limit = room * max_tokens + max_tokens // 2
    tenants = {
        "copier": {"keys": [COPIER]},
        "sampler": {"keys": [SAMPLER], "quotas": {"sampled_tokens_per_day": token_limit}},
    }
    path = write_tenants(workdir / "tenants.toml", tenants)
    config = dataclasses.replace(
        server_config(workdir / "data", []), api_keys=[], tenants_file=path
    )
    server = ServerThread(config)
    out: dict[str, Any] = {"copies": copies, "samples": samples, "room": room}
    unexpected: list[str] = []
    try:
        source = _source_checkpoint(server)
        size = _stored(server, "copier")
        storage_limit = size + room * size + size // 2
        tenants["copier"]["quotas"] = {"storage_bytes": storage_limit}
        write_tenants(path, tenants)
        server.service.reload_tenants()
        log(f"quota_race: {copies} copies of {size} B under storage_bytes={storage_limit}")

        def copy(i: int) -> int:
            reply = _post(
                server,
                COPIER,
                "copy_weights",
                {"source_path": source, "destination_project_id": f"race-{i}"},
            )
            if reply.status_code not in (200, 403) or (
                reply.status_code == 403 and "storage_bytes" not in reply.text
            ):
                unexpected.append(f"copy: {reply.status_code} {reply.text[:200]}")
            return reply.status_code

        base = server.service.served.names[0]

        def sample(i: int) -> str:
            reply = _post(
                server,
                SAMPLER,
                "asample",
                {
                    "base_model": base,
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
                    "sampling_params": {"max_tokens": max_tokens, "seed": i, "stop": []},
                    "num_samples": 1,
                },
            )
            if reply.status_code == 403:
                if "sampled_tokens_per_day" not in reply.text:
                    unexpected.append(f"sample: 403 {reply.text[:200]}")
                return "refused"
            if reply.status_code != 200:
                unexpected.append(f"sample: {reply.status_code} {reply.text[:200]}")
                return "error"
            answer, body = _result(server, SAMPLER, reply.json()["request_id"])
            if answer.status_code != 200 or body.get("error"):
                if "sampled_tokens_per_day" not in str(body.get("error", "")):
                    unexpected.append(f"sample result: {answer.status_code} {answer.text[:200]}")
                return "refused"
            return "ok"

        scheduler = server.service.scheduler
        refused = {"copy": 0, "sample": 0}

        def counted(kind: str, send: Callable[[int], Any]) -> Callable[[int], Any]:
            def run(i: int) -> Any:
                outcome = send(i)
                refused[kind] += outcome in (403, "refused")
                return outcome

            return run

        def wave(
            kind: str, count: int, send: Callable[[int], Any], queued: Callable[[], int]
        ) -> list[Any]:
            with ThreadPoolExecutor(count) as pool:
                if hold:
                    scheduler.pause()
                try:
                    futures = [pool.submit(counted(kind, send), i) for i in range(count)]
                    deadline = time.monotonic() + 120
                    while hold and refused[kind] + queued() < count and time.monotonic() < deadline:
                        time.sleep(0.01)
                finally:
                    scheduler.resume()
                return [f.result() for f in futures]

        began = time.perf_counter()
        copied = wave("copy", copies, copy, lambda: len(scheduler._calls))
        sampled = wave("sample", samples, sample, scheduler.pending)
        stored = _stored(server, "copier")
        metering = server.service.metering
        used = metering.today("sampler", "sampled_tokens")
        out.update(
            {
                "storage_bytes_limit": storage_limit,
                "checkpoint_bytes": size,
                "copies_ok": copied.count(200),
                "copies_refused": copied.count(403),
                "stored_bytes": stored,
                "sampled_tokens_per_day_limit": token_limit,
                "samples_ok": sampled.count("ok"),
                "samples_refused": sampled.count("refused"),
                "sampled_tokens": used,
                "quota_overshoot_bytes": max(0, stored - storage_limit),
                "quota_overshoot_tokens": int(max(0.0, used - token_limit)),
                "unexpected": unexpected,
                "seconds": round(time.perf_counter() - began, 2),
            }
        )
        out["quota_overshoot"] = out["quota_overshoot_bytes"] + out["quota_overshoot_tokens"]
    finally:
        server.stop()
    return out
