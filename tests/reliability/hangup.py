"""Clients that hang up (issue 34, item 10): OpenAI streams dropped after their first chunk,
and Tinker SDK samples abandoned by an asyncio timeout. The server must stop their samples:
`hangup_busy_s` is how long the sampler kept working after the last stream was dropped (the
issue measured 37.7 s for 10 dropped 32 x 1,500-token streams before), `sdk_busy_s` the same
after the SDK calls were abandoned (the long-poll's grace, `abandon_grace_s`, plus a step);
the tokens drawn until then are metered (`*_metered_tokens`, against `*_max_tokens` had they
run to their end).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import tinker
from tinker import types

from lorafleet.server.main import ServerThread
from tests.reliability.harness import server_config, tenant_id, tenant_keys


def run_hangup(
    workdir: Path,
    streams: int = 10,
    n: int = 4,
    max_tokens: int = 1500,
    sdk_calls: int = 4,
    sdk_timeout_s: float = 1.0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    (key,) = tenant_keys(1, "hangup")
    server = ServerThread(server_config(workdir / "data", [key]))
    engine = server.service.executor.sampler
    tenant = tenant_id(key)
    out: dict[str, Any] = {"streams": streams, "n": n, "max_tokens": max_tokens}

    def sampled() -> float:
        totals = server.service.metering.totals(tenant)
        return sum(v for _t, _r, c, v in totals if c == "sampled_tokens")

    def busy_after(t0: float, limit: float = 600.0) -> float:
        while engine.has_work() and time.perf_counter() - t0 < limit:
            time.sleep(0.005)
        return round(time.perf_counter() - t0, 3)

    def settled(before: float) -> float:
        """What the dropped requests were metered, once their futures have resolved."""
        deadline = time.monotonic() + 30
        while server.service.scheduler.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        return sampled() - before

    try:
        base = server.service.served.names[0]
        log(f"hangup: {streams} streams of n={n} x {max_tokens} tokens dropped after one chunk")

        def hang(i: int) -> None:
            body = {
                "model": base,
                "prompt": [5, 6, 7, i],
                "max_tokens": max_tokens,
                "n": n,
                "stream": True,
                "temperature": 1.0,
            }
            headers = {"X-API-Key": key}
            with (
                httpx.Client(base_url=server.base_url, headers=headers, timeout=300) as http,
                http.stream("POST", "/v1/completions", json=body) as reply,
            ):
                next(reply.iter_lines())

        before = sampled()
        threads = [threading.Thread(target=hang, args=(i,)) for i in range(streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        out["hangup_busy_s"] = busy_after(time.perf_counter())
        out["hangup_metered_tokens"] = settled(before)
        out["hangup_max_tokens"] = streams * n * max_tokens

        log(f"hangup: {sdk_calls} SDK samples abandoned by a {sdk_timeout_s} s asyncio timeout")

        async def abandon() -> None:
            client = tinker.ServiceClient(base_url=server.base_url, api_key=key)
            sampler = await client.create_sampling_client_async(base_model=base)

            async def one(i: int) -> None:
                call = sampler.sample_async(
                    types.ModelInput.from_ints([9, 8, 7, i]),
                    n,
                    # (stop=[]: no early end at EOS, so only the cancellation ends them)
                    types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[]),
                )
                with contextlib.suppress(TimeoutError):  # the caller gives up: the point
                    await asyncio.wait_for(call, sdk_timeout_s)

            await asyncio.gather(*(one(i) for i in range(sdk_calls)))

        before = sampled()
        asyncio.run(abandon())
        out["sdk_busy_s"] = busy_after(time.perf_counter())
        out["sdk_metered_tokens"] = settled(before)
        out["sdk_max_tokens"] = sdk_calls * n * max_tokens
        out["abandon_grace_s"] = server.service.config.abandon_grace_s
        out["abandoned_cancelled"] = server.service.abandoned.cancelled
    finally:
        server.stop()
    return out
