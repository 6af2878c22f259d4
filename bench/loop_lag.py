"""Event-loop lag under big bodies (issue 31): the p99 latency of `GET /api/v1/healthz`, pinged
every 50 ms, while 8 clients send 4 MB `forward_backward` bodies.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.loop_lag --json bench/results/loop_lag.json

The server is `lorafleet serve` in a process of its own (tiny-qwen3, one torch thread), started
from `--server-path` (default: this checkout), so the figure before a change is the same
command against another checkout:

    git worktree add --detach /tmp/before-loop main
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.loop_lag --server-path /tmp/before-loop

Each client is a tenant of its own with one training run; it sends protobuf ForwardBackward
requests of `--rows` rows x `--tokens` tokens (960 x 256: 4.0 MB) back to back, each with
the next seq_id once the previous one was accepted. The server's queue bound
(`--max-queued-ops`, 8) keeps the engine's backlog (and the server's memory) bounded: a body
past it is still read, decoded and hashed, then answered 429, and its client waits the
Retry-After the server names before it sends the same seq_id again, as the SDK does. The
pinger runs in a process of its own, so its timings are not the bench's own event loop or GIL;
a ping due while the previous one is still out goes as soon as that one is answered, and the
JSON counts those late pings (a stall shows as one long ping, its `max_ms`, and as late ones).

First `--idle-seconds` of pings with no client sending (the floor), then `--seconds` of pings
while the clients send. `p99_lag_ms` is the loaded p99 (target <= 50 ms); the JSON records the
machine (bench/common.py `environment()`), the load average before and after, and the server
path and its git commit. Nothing here asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import add_dtype_option, bench_dtype, environment, wait_healthy
from lorafleet.fsio import atomic_write_bytes
from lorafleet.server.main import free_port

BASE_MODEL = "tiny-qwen3"
VOCAB = 512
HEALTHZ = "/api/v1/healthz"
TARGET_MS = 50.0


# =============================================================================== the pinger


def _pinger(url: str, interval_s: float, seconds: float, out: Any) -> None:
    """Pings healthz on a fixed schedule, one every `interval_s` for `seconds`, one at a time
    as a probe does: a ping due while the previous one is still out is sent as soon as that
    one is answered (and counted as late). Puts each ping's latency (send to answer, seconds),
    the count of late pings and of non-200 answers."""
    import httpx

    latencies: list[float] = []
    failures = late = 0
    with httpx.Client(base_url=url, timeout=60) as client:
        client.get(HEALTHZ)  # the connection, opened before the clock starts
        start = time.perf_counter()
        for n in range(max(1, round(seconds / interval_s))):
            due = start + n * interval_s
            if due >= start + seconds:
                break
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            elif delay < -interval_s / 2:
                late += 1
            began = time.perf_counter()
            if began >= start + seconds:
                break  # the window is over (a stall held the previous pings past it)
            try:
                ok = client.get(HEALTHZ).status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - began)
            failures += not ok
    out.put((latencies, late, failures))


def ping(url: str, interval_s: float, seconds: float) -> tuple[list[float], int, int]:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=_pinger, args=(url, interval_s, seconds, out), daemon=True)
    process.start()
    try:
        return out.get(timeout=seconds + 600)
    finally:
        process.join(30)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


# =============================================================================== the clients


def fwd_bwd_body(model_id: str, seq_id: int, rows: int, tokens: int, seed: int) -> bytes:
    """A ForwardBackwardRequest as the SDK writes it: int32 tokens, int64 targets and float32
    weights per datum."""
    from tinker.proto import tinker_public_pb2 as pb

    rng = np.random.default_rng(seed)
    msg = pb.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy", forward_only=False
    )
    for _ in range(rows):
        seq = rng.integers(3, VOCAB, tokens + 1)
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = seq[:-1].astype(np.int32).tobytes()
        target = datum.loss_fn_inputs["target_tokens"]
        target.dtype, target.dense = pb.DTYPE_INT64, seq[1:].astype(np.int64).tobytes()
        target.shape.append(tokens)
        weights = datum.loss_fn_inputs["weights"]
        weights.dtype, weights.dense = pb.DTYPE_FLOAT32, np.ones(tokens, np.float32).tobytes()
        weights.shape.append(tokens)
    return msg.SerializeToString()


@dataclass
class Sent:
    accepted: int = 0
    refused: int = 0  # 429: the queue bound (decoded, then refused)
    failed: list[str] = field(default_factory=list)


async def _poll(client: Any, request_id: str) -> dict[str, Any]:
    while True:
        reply = await client.post("/api/v1/retrieve_future", json={"request_id": request_id})
        reply.raise_for_status()
        body = reply.json()
        if body.get("type") != "try_again":
            return dict(body)


async def create_run(client: Any) -> str:
    session = await client.post("/api/v1/create_session", json={"tags": ["loop-lag"]})
    session.raise_for_status()
    session_id = session.json()["session_id"]
    created = await client.post(
        "/api/v1/create_model",
        json={
            "session_id": session_id,
            "model_seq_id": 0,
            "base_model": BASE_MODEL,
            "lora_config": {"rank": 4},
        },
    )
    created.raise_for_status()
    result = await _poll(client, created.json()["request_id"])
    if "error" in result:
        raise RuntimeError(f"create_model failed: {result}")
    return str(created.json()["model_id"])


async def flood(
    url: str, key: str, body_for: Any, stop: asyncio.Event, sent: Sent, model_id: str
) -> None:
    """Sends bodies back to back until `stop`; on a 429 waits its Retry-After and sends the
    same seq_id again."""
    import httpx

    seq_id = 1
    headers = {"X-API-Key": key, "Content-Type": "application/x-protobuf"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
        while not stop.is_set():
            reply = await client.post(
                "/api/v1/forward_backward", content=body_for(model_id, seq_id)
            )
            if reply.status_code == 200:
                sent.accepted += 1
                seq_id += 1
            elif reply.status_code == 429:
                sent.refused += 1
                wait = float(reply.headers.get("retry-after", "1"))
                with contextlib.suppress(TimeoutError):  # waited out: send it again
                    await asyncio.wait_for(stop.wait(), wait)
            else:
                sent.failed.append(f"{reply.status_code}: {reply.text[:200]}")
                await asyncio.sleep(0.5)


async def _runs(url: str, keys: list[str]) -> list[str]:
    import httpx

    async def one(key: str) -> str:
        async with httpx.AsyncClient(
            base_url=url, headers={"X-API-Key": key}, timeout=120
        ) as client:
            return await create_run(client)

    return list(await asyncio.gather(*(one(key) for key in keys)))


async def _loaded(
    url: str, keys: list[str], runs: list[str], args: argparse.Namespace
) -> tuple[list[float], int, int, list[Sent]]:
    bodies = [
        fwd_bwd_body("m", 1, args.rows, args.tokens, seed=i) for i in range(len(keys))
    ]  # one template per client: only its model id and seq_id change between sends

    def body_for(index: int) -> Any:
        from tinker.proto import tinker_public_pb2 as pb

        template = pb.ForwardBackwardRequest()
        template.ParseFromString(bodies[index])

        def make(model_id: str, seq_id: int) -> bytes:
            template.model_id, template.seq_id = model_id, seq_id
            return template.SerializeToString()

        return make

    stop = asyncio.Event()
    sent = [Sent() for _ in keys]
    tasks = [
        asyncio.create_task(flood(url, key, body_for(i), stop, sent[i], runs[i]))
        for i, key in enumerate(keys)
    ]
    await asyncio.sleep(args.lead)  # the clients' first bodies are in flight
    latencies, late, failures = await asyncio.to_thread(ping, url, args.interval, args.seconds)
    stop.set()
    await asyncio.gather(*tasks)
    return latencies, late, failures, sent


# =============================================================================== the server


def start_server(
    server_path: Path, data_dir: Path, port: int, keys: list[str], args: argparse.Namespace
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": str(server_path),
        "LORAFLEET_API_KEYS": ",".join(keys),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(data_dir.parent / "hf-hub"),
    }
    log = (data_dir.parent / "server.log").open("wb")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lorafleet.cli",
            "serve",
            "--base-model",
            BASE_MODEL,
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
            "--torch-threads",
            "1",
            "--dtype",
            args.dtype,
            "--max-queued-ops",
            str(args.max_queued_ops),
        ],
        cwd=server_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _commit(path: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    dirty = subprocess.run(
        ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return out.stdout.strip() + (" (uncommitted changes)" if dirty else "")


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": percentile(values, 50) * 1e3,
        "p99_ms": percentile(values, 99) * 1e3,
        "max_ms": max(values) * 1e3 if values else float("nan"),
        "pings": len(values),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument(
        "--server-path",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="the checkout whose server is measured (default: this one)",
    )
    add_dtype_option(parser)
    parser.add_argument("--clients", type=int, default=8, help="clients (tenants) sending bodies")
    parser.add_argument("--rows", type=int, default=960, help="rows per forward_backward body")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per row")
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between pings")
    parser.add_argument("--seconds", type=float, default=20.0, help="pinged while loaded")
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="pinged while idle")
    parser.add_argument("--lead", type=float, default=2.0, help="seconds of load before pings")
    parser.add_argument(
        "--max-queued-ops", type=int, default=8, help="the server's queue bound (429 past it)"
    )
    args = parser.parse_args()
    dtype = bench_dtype(args.dtype)
    server_path = args.server_path.resolve()
    keys = [f"tml-looplag-{i:02d}-0123456789abcdef" for i in range(args.clients)]
    body_bytes = len(fwd_bwd_body("m", 1, args.rows, args.tokens, seed=0))
    print(
        f"server from {server_path}; {args.clients} clients x {body_bytes / 1e6:.2f} MB "
        f"forward_backward bodies; healthz every {args.interval * 1e3:.0f} ms",
        flush=True,
    )
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="lorafleet-looplag-") as tmp:
        data_dir = Path(tmp) / "data"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(server_path, data_dir, port, keys, args)
        try:
            wait_healthy(
                url,
                server,
                300,
                details=lambda: (Path(tmp) / "server.log").read_text(errors="replace")[-3000:],
            )
            idle, idle_late, idle_failures = ping(url, args.interval, args.idle_seconds)
            runs = asyncio.run(_runs(url, keys))
            loaded, loaded_late, loaded_failures, sent = asyncio.run(_loaded(url, keys, runs, args))
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    load_after = os.getloadavg()
    p99 = percentile(loaded, 99) * 1e3
    rows = {"healthz idle": _stats(idle), "healthz loaded": _stats(loaded)}
    print(f"\nEvent-loop lag: healthz under {args.clients} clients' 4 MB forward_backward bodies")
    print(f"{'side':<20}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}{'pings':>8}")
    for name, row in rows.items():
        print(
            f"{name:<20}{row['p50_ms']:>10.1f}{row['p99_ms']:>10.1f}{row['max_ms']:>10.1f}"
            f"{row['pings']:>8}"
        )
    accepted = sum(s.accepted for s in sent)
    refused = sum(s.refused for s in sent)
    failed = [f for s in sent for f in s.failed]
    met = "met" if p99 <= TARGET_MS else "NOT met"
    print(
        f"\nbodies accepted {accepted}, refused by the queue bound {refused}, failed {len(failed)}"
    )
    print(f"late pings (sent after the next was due): idle {idle_late}, loaded {loaded_late}")
    print(f"p99_lag_ms {p99:.1f}  target <= {TARGET_MS:g}: {met}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    result = {
        "benchmark": "loop_lag",
        "p99_lag_ms": p99,
        "targets": {"p99_lag_ms": f"<= {TARGET_MS:g}: {met}"},
        "healthz": rows,
        "ping_failures": {"idle": idle_failures, "loaded": loaded_failures},
        "late_pings": {"idle": idle_late, "loaded": loaded_late},
        "bodies": {
            "bytes": body_bytes,
            "accepted": accepted,
            "refused_queue_bound": refused,
            "failed": len(failed),
            "failed_first": failed[:5],
        },
        "server_path": str(server_path),
        "server_commit": _commit(server_path),
        "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "load_average": {"before": load_before, "after": load_after},
        "environment": environment(dtype),
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(args.json, (json.dumps(result, indent=2) + "\n").encode())
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
