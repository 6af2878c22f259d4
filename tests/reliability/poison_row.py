"""One bad request in a shared sampling batch (issue 34, item 1): victim tenants' samples and
an attacker's hostile sampling parameters are queued while the engine worker is paused, so
that they all start in the same engine steps, and then the worker is resumed.

Victims sample through the tinker SDK and through `/v1/completions`, seeded; the attacker
sends, through both routes, temperatures that underflow float32 (1e-300, 1e-45, 5e-324), a
top_p of 1e-300, a huge top_k, extreme seeds, and values that must be refused (a negative
temperature, top_p 0, a 70-bit seed). Afterwards every victim request is replayed alone.

`poison_row_failed_others`: victim requests that failed; `poison_row_solo_diffs`: victim
results whose tokens differ from their solo replay; `poison_row_attacker_5xx`: attacker
requests answered with a server error (each must be a 200 or a 4xx naming its field).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import tinker
from tinker import types

from lorafleet.server.main import ServerThread
from tests.reliability.harness import server_config, tenant_keys

PROMPTS = [[5, 17, 33, 60, 91, 120, 200, 7, 44], [11, 12, 13, 14], [300, 200, 100, 50, 25, 12]]
HOSTILE_PARAMS: list[dict[str, Any]] = [
    {"temperature": 1e-300},
    {"temperature": 1e-45},
    {"temperature": 5e-324},
    {"temperature": 1e-300, "top_p": 1e-300},
    {"temperature": 1.0, "top_k": 10**9},
    {"temperature": 0.5, "seed": 2**64 - 1},
    {"temperature": 0.5, "seed": -(2**63)},
    {"temperature": -1.0},  # refused
    {"top_p": 0.0},  # refused
    {"seed": 2**70},  # refused
]


def _victim_sdk(sampler: tinker.SamplingClient, i: int, max_tokens: int) -> list[int]:
    out = sampler.sample(
        types.ModelInput.from_ints(PROMPTS[i % len(PROMPTS)]),
        2,
        types.SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=100 + i),
    ).result()
    return [t for seq in out.sequences for t in seq.tokens]


def _victim_openai(server: ServerThread, key: str, base: str, i: int, max_tokens: int) -> str:
    reply = httpx.post(
        f"{server.base_url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={
            "model": base,
            "prompt": PROMPTS[i % len(PROMPTS)],
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "seed": 200 + i,
        },
        timeout=300,
    )
    reply.raise_for_status()
    return str(reply.json()["choices"][0]["text"])


def _attack_tinker(server: ServerThread, key: str, base: str, params: dict[str, Any]) -> int:
    """The status the attacker's request ends in: the future's, or the submit's."""
    headers = {"X-API-Key": key}
    body = {
        "base_model": base,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPTS[0]}]},
        "sampling_params": {"max_tokens": 16, **params},
        "num_samples": 2,
    }
    reply = httpx.post(f"{server.base_url}/api/v1/asample", json=body, headers=headers, timeout=300)
    if reply.status_code != 200:
        return reply.status_code
    rid = reply.json()["request_id"]
    while True:
        done = httpx.post(
            f"{server.base_url}/api/v1/retrieve_future",
            json={"request_id": rid},
            headers=headers,
            timeout=300,
        )
        if not done.headers["content-type"].startswith("application/json"):
            return done.status_code
        answer = done.json()
        if answer.get("type") == "try_again":
            continue
        if "error" in answer:
            return 500 if answer.get("category") == "server" else 400
        return done.status_code


def _attack_openai(server: ServerThread, key: str, base: str, params: dict[str, Any]) -> int:
    reply = httpx.post(
        f"{server.base_url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": base, "prompt": PROMPTS[1], "max_tokens": 16, **params},
        timeout=300,
    )
    return reply.status_code


def run_poison_row(
    workdir: Path,
    victims: int = 3,
    requests_per_victim: int = 4,
    max_tokens: int = 24,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    keys = tenant_keys(victims + 1, "poison")
    attacker, victim_keys = keys[0], keys[1:]
    server = ServerThread(server_config(workdir / "data", keys))
    out: dict[str, Any] = {"victims": victims, "requests_per_victim": requests_per_victim}
    clients = [tinker.ServiceClient(base_url=server.base_url, api_key=k) for k in victim_keys]
    try:
        base = server.service.served.names[0]
        samplers = [c.create_sampling_client(base_model=base).result() for c in clients]
        scheduler = server.service.scheduler
        jobs: list[tuple[str, Callable[[], Any]]] = []
        for v, key in enumerate(victim_keys):
            for i in range(requests_per_victim):
                n = v * requests_per_victim + i
                if i % 2 == 0:
                    jobs.append(
                        ("victim", lambda s=samplers[v], n=n: _victim_sdk(s, n, max_tokens))
                    )
                else:
                    jobs.append(
                        (
                            "victim",
                            lambda k=key, n=n: _victim_openai(server, k, base, n, max_tokens),
                        )
                    )
        for params in HOSTILE_PARAMS:
            jobs.append(("attacker", lambda p=params: _attack_tinker(server, attacker, base, p)))
            jobs.append(("attacker", lambda p=params: _attack_openai(server, attacker, base, p)))
        log(f"poison_row: {len(jobs)} requests queued together, then the worker resumed")
        began = time.perf_counter()
        with ThreadPoolExecutor(len(jobs)) as pool:
            scheduler.pause()
            try:
                futures: list[Future[Any]] = [pool.submit(run) for _kind, run in jobs]
                deadline = time.monotonic() + 30
                # every request queued before the batch starts (6 hostile ones are refused at
                # the door; the code before this issue queued some of those too)
                while scheduler.pending() < len(jobs) - 6 and time.monotonic() < deadline:
                    time.sleep(0.02)
            finally:
                scheduler.resume()
            outcomes: list[tuple[str, Any, BaseException | None]] = []
            for (kind, _run), future in zip(jobs, futures, strict=True):
                try:
                    outcomes.append((kind, future.result(), None))
                except Exception as exc:  # noqa: BLE001 - a failed victim request is what this counts
                    outcomes.append((kind, None, exc))
        shared_seconds = time.perf_counter() - began
        failed = [str(exc)[:300] for kind, _v, exc in outcomes if kind == "victim" and exc]
        attacker_statuses = [value for kind, value, _e in outcomes if kind == "attacker"]
        # each victim request alone, for the comparison
        diffs = 0
        for (kind, run), (_k, value, exc) in zip(jobs, outcomes, strict=True):
            if kind == "victim" and exc is None and run() != value:
                diffs += 1
        out.update(
            {
                "requests": len(jobs),
                "victim_requests": sum(kind == "victim" for kind, _r in jobs),
                "poison_row_failed_others": len(failed),
                "poison_row_solo_diffs": diffs,
                "poison_row_attacker_5xx": sum(1 for s in attacker_statuses if s >= 500),
                "attacker_statuses": sorted(attacker_statuses),
                "failures": failed[:5],
                "shared_seconds": round(shared_seconds, 2),
            }
        )
    finally:
        for client in clients:
            client.close("success").result(timeout=30)
        server.stop()
    return out
