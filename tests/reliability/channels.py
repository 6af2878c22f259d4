"""Two side effects one tenant's use of the server may have on another (issue 34), measured:

- `run_prefix_probe`: can a tenant tell, from its own counters in `lorafleet/stats` and from
  how long its requests take, whether another tenant has sent a prompt? A victim tenant
  samples a fresh secret prompt; right after it, an attacker tenant sends either that prompt
  (a right guess) or a fresh random one of the same length (a wrong guess), in random order.
  For each signal (the attacker's `hit_tokens` delta; its request's latency) the figure is the
  area under the ROC curve of telling right from wrong, folded (max(auc, 1 - auc)): 0.5 is
  chance, 1.0 is a perfect oracle. Each guess is a prompt the attacker never sent before, so
  its own cache cannot answer for it.
- `run_stream_cost`: another tenant's training step time with 64 console event streams open on
  a run with 31 curves of 1,000 points (new points arriving every half second), over the same
  steps without them, interleaved in rounds; the streams are read by a separate process so the
  readers' own CPU is not the server's.

Both run an in-process tiny-qwen3 server; bench/reliability.py (`--only prefix_probe,
stream_cost`) prints and records them.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.reliability.harness import BASE_MODEL, VOCAB, inprocess_server, tenant_keys

CURVES = 31
POINTS = 1000
STREAMS = 64


def folded_auc(positives: list[float], negatives: list[float]) -> float:
    """max(AUC, 1 - AUC) of telling `positives` from `negatives` by the value (Mann-Whitney,
    ties count half): how well the best threshold on this signal separates them."""
    if not positives or not negatives:
        return float("nan")
    wins = 0.0
    for p in positives:
        for n in negatives:
            wins += 1.0 if p > n else 0.5 if p == n else 0.0
    auc = wins / (len(positives) * len(negatives))
    return max(auc, 1.0 - auc)


def _hit_tokens(base_url: str, key: str) -> int:
    reply = httpx.get(f"{base_url}/api/v1/lorafleet/stats", headers={"X-API-Key": key})
    reply.raise_for_status()
    cache = reply.json().get("prefix_cache") or {}
    return int(cache.get("hit_tokens", 0))


def run_prefix_probe(
    workdir: Path, trials: int = 200, prompt_tokens: int = 768, seed: int = 0
) -> dict[str, Any]:
    import tinker
    from tinker import types

    victim_key, attacker_key = tenant_keys(2, "probe")
    rng = random.Random(seed)
    params = types.SamplingParams(max_tokens=1, seed=1)
    right_hits: list[float] = []
    wrong_hits: list[float] = []
    right_s: list[float] = []
    wrong_s: list[float] = []
    with inprocess_server(workdir / "data", [victim_key, attacker_key]) as server:
        victim = tinker.ServiceClient(base_url=server.base_url, api_key=victim_key)
        attacker = tinker.ServiceClient(base_url=server.base_url, api_key=attacker_key)
        v_sampler = victim.create_sampling_client(base_model=BASE_MODEL)
        a_sampler = attacker.create_sampling_client(base_model=BASE_MODEL)

        def fresh() -> list[int]:
            return [rng.randrange(1, VOCAB) for _ in range(prompt_tokens)]

        def sample(sampler: Any, prompt: list[int]) -> float:
            started = time.perf_counter()
            sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result()
            return time.perf_counter() - started

        for _ in range(4):  # warm-up: allocator, kernels, the first requests' set-up
            sample(a_sampler, fresh())
        order = [True] * (trials // 2) + [False] * (trials - trials // 2)
        rng.shuffle(order)
        for right in order:
            secret = fresh()
            sample(v_sampler, secret)
            guess = secret if right else fresh()
            before = _hit_tokens(server.base_url, attacker_key)
            took = sample(a_sampler, guess)
            hits = _hit_tokens(server.base_url, attacker_key) - before
            (right_hits if right else wrong_hits).append(hits)
            (right_s if right else wrong_s).append(took)
    counters_auc = folded_auc(right_hits, wrong_hits)
    timing_auc = folded_auc(wrong_s, right_s)  # a hit would be faster
    return {
        "trials": trials,
        "prompt_tokens": prompt_tokens,
        "right_guess_hit_tokens_mean": statistics.fmean(right_hits),
        "wrong_guess_hit_tokens_mean": statistics.fmean(wrong_hits),
        "right_guess_ms_median": 1000 * statistics.median(right_s),
        "wrong_guess_ms_median": 1000 * statistics.median(wrong_s),
        "counters_auc": counters_auc,
        "timing_auc": timing_auc,
        "prefix_probe_auc": max(counters_auc, timing_auc),
    }


# ============================================================================ stream cost


def _readers(base_url: str, cookie: str, run: str, count: int, seconds: float) -> None:
    """Runs in its own process: `count` console event streams on `run`, read and discarded."""
    from lorafleet.server.console.sessions import COOKIE

    url = f"{base_url}/console/api/events?view=tenant&run={run}"
    received = [0] * count
    stop = time.monotonic() + seconds

    def read(i: int) -> None:
        with (
            httpx.Client(cookies={COOKIE: cookie}, timeout=30) as client,
            client.stream("GET", url) as reply,
        ):
            for chunk in reply.iter_bytes():
                received[i] += len(chunk)
                if time.monotonic() > stop:
                    return

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 30)
    print(json.dumps({"bytes": sum(received), "streams_with_data": sum(1 for r in received if r)}))


def _post_points(base_url: str, key: str, run: str, steps: range) -> None:
    points = [
        {"name": f"curve_{c:02d}", "step": s, "value": ((s * 7 + c) % 97) / 97.0}
        for s in steps
        for c in range(CURVES)
    ]
    for i in range(0, len(points), 256):
        reply = httpx.post(
            f"{base_url}/api/v1/lorafleet/runs/{run}/metrics",
            json={"points": points[i : i + 256]},
            headers={"X-API-Key": key},
            timeout=60,
        )
        reply.raise_for_status()


def run_stream_cost(
    workdir: Path, rounds: int = 4, phase_s: float = 6.0, seed: int = 0
) -> dict[str, Any]:
    import tinker
    from tinker import types

    from lorafleet.server.console.sessions import COOKIE
    from tests.server.conftest import TRAIN_DATA

    watcher_key, trainer_key = tenant_keys(2, "streams")
    overrides = {
        # the phase measures what streams cost, not who may open them: one tenant opens all
        "console_streams": STREAMS,
        "console_streams_per_tenant": STREAMS,
        "console_streams_per_session": STREAMS,
        "console_operator_streams": 0,
        "console_newcomer_streams": 0,
    }
    with inprocess_server(workdir / "data", [watcher_key, trainer_key], **overrides) as server:
        base = server.base_url
        watcher = tinker.ServiceClient(base_url=base, api_key=watcher_key)
        run = watcher.create_lora_training_client(base_model=BASE_MODEL, rank=8).result()
        run_id = run.model_id
        _post_points(base, watcher_key, run_id, range(POINTS))
        signed = httpx.post(f"{base}/console/api/session", json={"key": watcher_key})
        signed.raise_for_status()
        cookie = signed.cookies[COOKIE]

        trainer = tinker.ServiceClient(base_url=base, api_key=trainer_key)
        tc = trainer.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=seed).result()
        adam = types.AdamParams(learning_rate=1e-3)

        def step() -> float:
            started = time.perf_counter()
            fwd = tc.forward_backward(TRAIN_DATA, "cross_entropy")
            opt = tc.optim_step(adam)
            fwd.result()
            opt.result()
            return time.perf_counter() - started

        for _ in range(3):
            step()  # warm-up
        without: list[float] = []
        with_streams: list[float] = []
        next_step = [POINTS]
        feeding = threading.Event()

        def feed() -> None:  # the watched run keeps training: new points twice a second
            while feeding.is_set():
                _post_points(base, watcher_key, run_id, range(next_step[0], next_step[0] + 1))
                next_step[0] += 1
                time.sleep(0.5)

        def steps(into: list[float]) -> None:
            until = time.monotonic() + phase_s
            while time.monotonic() < until:
                into.append(step())

        builds_during = 0
        for _ in range(rounds):
            steps(without)
            reader = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import sys; from tests.reliability.channels import _readers; "
                    "_readers(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), "
                    "float(sys.argv[5]))",
                    base,
                    cookie,
                    run_id,
                    str(STREAMS),
                    "600",
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            feeding.set()
            feeder = threading.Thread(target=feed, daemon=True)
            feeder.start()
            deadline = time.monotonic() + 60
            while server.service.console.streams.open_streams < STREAMS:
                if time.monotonic() > deadline or reader.poll() is not None:
                    raise RuntimeError(
                        f"only {server.service.console.streams.open_streams} of {STREAMS} "
                        "console streams opened"
                    )
                time.sleep(0.1)
            # every stream past its first (whole) snapshot: deltas from here on
            first = server.service.console.streams.builds
            deadline = time.monotonic() + 120
            while server.service.console.streams.builds < first + STREAMS:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            built_before = server.service.console.streams.builds
            steps(with_streams)
            builds_during += server.service.console.streams.builds - built_before
            feeding.clear()
            feeder.join(10)
            reader.terminate()
            reader.communicate(timeout=30)
            deadline = time.monotonic() + 30
            while server.service.console.streams.open_streams and time.monotonic() < deadline:
                time.sleep(0.1)
        streams = server.service.console.streams
        builds, build_s = streams.builds, streams.build_seconds
    off = statistics.median(without)
    on = statistics.median(with_streams)
    return {
        "streams": STREAMS,
        "curves": CURVES,
        "points_per_curve": POINTS,
        "rounds": rounds,
        "phase_s": phase_s,
        "steps_without": len(without),
        "steps_with": len(with_streams),
        "snapshot_builds_while_measured": builds_during,
        "step_ms_median_without": 1000 * off,
        "step_ms_median_with": 1000 * on,
        "step_ms_max_with": 1000 * max(with_streams),
        "snapshot_builds": builds,
        "snapshot_build_s": build_s,
        "stream_cost_step_ratio": on / off,
    }
