"""Load: N official-SDK clients at once, each its own tenant, each looping create ->
forward_backward -> optim_step -> sample -> save_state; then every tenant's request sequence
is replayed alone on a fresh server and the two runs are compared.

What "nothing lost or duplicated" is checked against:
- every future resolves (a `.result()` that times out is a lost request);
- the server's per-kind counts of executed operations equal what the clients sent, exactly
  (more would be a duplicate execution, fewer a lost one);
- each optim_step reports `step:max` = its 1-based index (a duplicated or dropped step would
  shift it);
- each tenant's forward_backward log-probs and losses, optimizer metrics, sampled tokens and
  final saved weights and optimizer state equal the solo replay's, bit for bit (the scheduler
  batches rows of different adapters together, and the engine keeps each row's arithmetic
  independent of its neighbours, so no tolerance is needed; a difference is counted).
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from tests.reliability.harness import (
    checkpoint_path_on_disk,
    inprocess_server,
    percentile,
    tenant_keys,
)

RESULT_TIMEOUT_S = 600.0
# Tolerances for "equal to the solo replay". Rows of different adapters share batches and a row
# is padded to the batch's longest row. Padding is routed to the row's own adapter (its gradient
# contribution is exactly zero), but a longer padded length can change how kernels block their
# float32 reductions, so a tenant's gradient equals its solo gradient bit for bit as long as the
# batch's padded length stays within the same kernel block, and to ~1e-7 relative otherwise.
# Training then amplifies that rounding step by step (Adam, large learning rates), so:
# - the first step, before any amplification, must agree to STEP0_RTOL (losses, optimizer
#   metrics) and its sampled tokens exactly;
# - later steps and the final weights to the looser bounds below. Sampled tokens of later steps
#   may flip where a token sits on a sampling boundary; flips are counted, not failed.
# A leak from another tenant moves results by O(1) from the first shared batch on; the report's
# `control_*` fields show the same comparison between two different tenants.
STEP0_RTOL = 1e-5
LOGPROB_ATOL = 1e-3
METRIC_RTOL = 1e-3
WEIGHT_RTOL = 1e-2
CALLS = (
    "create",
    "forward_backward",
    "optim_step",
    "save_weights_for_sampler",
    "sample",
    "save_state",
)
# server op kind -> how many of it one tenant step sends
SERVER_KINDS_PER_STEP = {
    "forward_backward": 1,
    "optim_step": 1,
    "save_sampler": 1,
    "sample": 1,
    "save_weights": 1,
}


@dataclass(frozen=True)
class TenantPlan:
    key: str
    seed: int
    rank: int
    steps: int
    learning_rate: float


@dataclass
class TenantTrace:
    key: str
    model_id: str = ""
    logprobs: list[bytes] = field(default_factory=list)  # per step, all datums' float32 bytes
    losses: list[float] = field(default_factory=list)
    optim: list[dict[str, float]] = field(default_factory=list)
    samples: list[list[list[int]]] = field(default_factory=list)
    saves: list[str] = field(default_factory=list)
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    step_errors: list[str] = field(default_factory=list)  # step:max not what it should be
    lost: list[str] = field(default_factory=list)  # futures that did not resolve
    failed: list[str] = field(default_factory=list)  # futures that resolved with an error


def make_plans(count: int, steps: int, seed: int, tag: str = "load") -> list[TenantPlan]:
    rng = random.Random(seed)
    return [
        TenantPlan(
            key,
            seed=seed * 1000 + i,
            rank=rng.choice([2, 4, 8, 16]),
            steps=steps,
            learning_rate=rng.choice([1e-3, 5e-3, 2e-2]),
        )
        for i, key in enumerate(tenant_keys(count, tag))
    ]


def step_batch(plan: TenantPlan, step: int) -> list[types.Datum]:
    """Different lengths per tenant and step, so mixed batches pad rows unevenly."""
    rng = random.Random(plan.seed * 7919 + step)
    out = []
    for _ in range(rng.randint(1, 3)):
        tokens = [rng.randrange(1, 500) for _ in range(rng.randint(4, 40))]
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
            )
        )
    return out


def _timed(trace: TenantTrace, call: str, submit: Callable[[], Any]) -> Any:
    began = time.perf_counter()
    future = submit()
    try:
        result = future.result(timeout=RESULT_TIMEOUT_S)
    except TimeoutError:
        trace.lost.append(f"{call}: no result within {RESULT_TIMEOUT_S:.0f} s")
        raise
    except tinker.TinkerError as exc:
        trace.failed.append(f"{call}: {type(exc).__name__}: {exc}")
        raise
    trace.latencies[call].append(time.perf_counter() - began)
    return result


def run_tenant(
    base_url: str,
    base_model: str,
    plan: TenantPlan,
    start: threading.Barrier | None = None,
    *,
    until: threading.Event | None = None,
    on_step: Callable[[TenantTrace, Any], None] | None = None,
    pause_s: float = 0.0,
) -> TenantTrace:
    """One tenant's whole session through the official SDK (one ServiceClient, one adapter):
    `plan.steps` steps, or fewer if `until` is set (checked after each step, which then also
    waits `pause_s`, so a short run can span another activity's time window). `on_step(trace,
    sampling_client)` is called after each step."""
    trace = TenantTrace(plan.key)
    service = tinker.ServiceClient(base_url=base_url, api_key=plan.key)
    try:
        if start is not None:
            start.wait()
        tc = _timed(
            trace,
            "create",
            lambda: service.create_lora_training_client(
                base_model=base_model, rank=plan.rank, seed=plan.seed, train_unembed=False
            ),
        )
        trace.model_id = tc.model_id
        prompt = types.ModelInput.from_ints([plan.seed % 400 + 3, 17, 29, 31])
        for step in range(plan.steps):
            out = _timed(
                trace,
                "forward_backward",
                lambda s=step: tc.forward_backward(step_batch(plan, s), "cross_entropy"),
            )
            trace.logprobs.append(
                b"".join(
                    o["logprobs"].to_numpy().astype("<f4").tobytes() for o in out.loss_fn_outputs
                )
            )
            trace.losses.append(float(out.metrics["loss:sum"]))
            optim = _timed(
                trace,
                "optim_step",
                lambda: tc.optim_step(types.AdamParams(learning_rate=plan.learning_rate)),
            )
            trace.optim.append(dict(optim.metrics or {}))
            if (optim.metrics or {}).get("step:max") != step + 1:
                trace.step_errors.append(
                    f"step {step}: optim_step reported step:max={optim.metrics}"
                )
            sampler = _timed(
                trace, "save_weights_for_sampler", tc.save_weights_and_get_sampling_client
            )
            params = types.SamplingParams(
                max_tokens=6, temperature=1.0, seed=plan.seed * 31 + step, stop=[]
            )
            sampled = _timed(trace, "sample", lambda sc=sampler, p=params: sc.sample(prompt, 2, p))
            trace.samples.append([list(s.tokens) for s in sampled.sequences])
            saved = _timed(trace, "save_state", lambda s=step: tc.save_state(f"step-{s}"))
            trace.saves.append(saved.path)
            if on_step is not None:
                on_step(trace, sampler)
            if until is not None:
                if until.is_set():
                    break
                time.sleep(pause_s)
    except (TimeoutError, tinker.TinkerError):
        pass  # recorded in trace.lost / trace.failed
    finally:
        try:
            service.close("success").result(timeout=60)
        except (TimeoutError, tinker.TinkerError) as exc:
            trace.failed.append(f"close: {type(exc).__name__}: {exc}")
    return trace


def _stats(base_url: str, key: str) -> Counter[str]:
    body = httpx.get(
        f"{base_url}/api/v1/lorafleet/stats", headers={"X-API-Key": key}, timeout=30
    ).json()
    return Counter(body["requests"])


def run_concurrent(
    base_url: str, base_model: str, plans: list[TenantPlan]
) -> tuple[list[TenantTrace], Counter[str]]:
    """All tenants at once (released together by a barrier); returns traces and the server's
    executed-operation counts over the run."""
    before = _stats(base_url, plans[0].key)
    barrier = threading.Barrier(len(plans))
    with ThreadPoolExecutor(len(plans)) as pool:
        traces = list(pool.map(lambda p: run_tenant(base_url, base_model, p, barrier), plans))
    after = _stats(base_url, plans[0].key)
    after.subtract(before)
    return traces, +after


def _weights(data_dir: Path, key: str, path: str) -> dict[str, torch.Tensor]:
    directory = checkpoint_path_on_disk(data_dir, key, path)
    tensors = load_file(directory / "weights.safetensors")
    tensors.update(
        {f"optimizer/{k}": v for k, v in load_file(directory / "optimizer.safetensors").items()}
    )
    return tensors


@dataclass
class Comparison:
    """How one tenant's concurrent run differs from its solo replay."""

    exact: bool = True  # every number and byte identical
    problems: list[str] = field(default_factory=list)  # differences beyond the tolerances
    max_logprob_diff: float = 0.0
    max_rel_weight_diff: float = 0.0  # max |delta| / max |w| over the final tensors
    max_metric_rel_diff: float = 0.0  # over losses and optimizer metrics, all steps
    sample_flips: int = 0  # steps after the first whose sampled tokens differ


def compare(a: TenantTrace, b: TenantTrace, a_dir: Path, b_dir: Path) -> Comparison:
    """Exactness first; beyond it the tolerances LOGPROB_ATOL / WEIGHT_RTOL (see run_load)."""
    out = Comparison()
    for name in ("losses", "optim", "samples", "logprobs"):
        mine, theirs = getattr(a, name), getattr(b, name)
        if len(mine) != len(theirs):
            out.problems.append(f"{name}: {len(mine)} steps vs {len(theirs)} in the replay")
        if mine != theirs:
            out.exact = False
    for step, (x, y) in enumerate(zip(a.logprobs, b.logprobs, strict=False)):
        xa, ya = np.frombuffer(x, "<f4"), np.frombuffer(y, "<f4")
        if xa.shape != ya.shape:
            out.problems.append(f"logprobs at step {step} have {xa.size} vs {ya.size} values")
            continue
        worst = float(np.max(np.abs(xa.astype(np.float64) - ya)) if xa.size else 0.0)
        out.max_logprob_diff = max(out.max_logprob_diff, worst)
        if worst > LOGPROB_ATOL:
            out.problems.append(f"logprobs at step {step} differ by {worst:.3g}")
    for step, (x, y) in enumerate(zip(a.losses, b.losses, strict=False)):
        rtol = STEP0_RTOL if step == 0 else METRIC_RTOL
        out.max_metric_rel_diff = max(out.max_metric_rel_diff, abs(x - y) / max(abs(y), 1e-12))
        if not math.isclose(x, y, rel_tol=rtol, abs_tol=1e-9):
            out.problems.append(f"loss at step {step}: {x} vs {y}")
    for step, (x, y) in enumerate(zip(a.optim, b.optim, strict=False)):
        rtol = STEP0_RTOL if step == 0 else METRIC_RTOL
        if set(x) != set(y):
            out.problems.append(f"optim_step metrics at step {step} have different keys")
            continue
        for k in x:
            out.max_metric_rel_diff = max(
                out.max_metric_rel_diff, abs(x[k] - y[k]) / max(abs(y[k]), 1e-12)
            )
        if any(not math.isclose(x[k], y[k], rel_tol=rtol, abs_tol=1e-9) for k in x):
            out.problems.append(f"optim_step metrics at step {step}: {x} vs {y}")
    for step, (x, y) in enumerate(zip(a.samples, b.samples, strict=False)):
        if x != y and step == 0:
            out.problems.append(f"sampled tokens at step {step}: {x} vs {y}")
        elif x != y:
            out.sample_flips += 1
    if not (a.saves and b.saves):
        out.problems.append("no final checkpoint to compare")
        return out
    wa, wb = _weights(a_dir, a.key, a.saves[-1]), _weights(b_dir, b.key, b.saves[-1])
    if set(wa) != set(wb):
        out.problems.append("the final checkpoints hold different tensors")
    for name in sorted(set(wa) & set(wb)):
        x, y = wa[name], wb[name]
        if x.shape != y.shape:
            out.problems.append(f"final {name}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
            continue
        if torch.equal(x, y):
            continue
        out.exact = False
        scale = float(y.double().abs().max()) or 1.0
        rel = float((x.double() - y.double()).abs().max()) / scale
        out.max_rel_weight_diff = max(out.max_rel_weight_diff, rel)
        if rel > WEIGHT_RTOL:
            out.problems.append(f"final {name} differs by {rel:.3g} of its largest value")
    return out


@dataclass
class LoadReport:
    tenants: int
    steps: int
    sent: dict[str, int]
    executed: dict[str, int]
    lost_requests: int
    duplicated_requests: int
    failed_requests: list[str]
    # tenants whose run differs from their solo replay beyond the tolerances
    cross_tenant_diffs: int
    diff_examples: list[str]
    bit_exact_tenants: int
    max_logprob_diff: float
    max_rel_weight_diff: float
    max_metric_rel_diff: float
    sample_flips: int
    # tenant 0's run against another tenant's replay: the same check must object to it
    control_problems: int | None
    control_rel_weight_diff: float | None
    control_metric_rel_diff: float | None
    latency_ms: dict[str, dict[str, float]]
    mixed_batches: dict[str, int]
    wall_s: float

    def ok(self) -> bool:
        return not (
            self.lost_requests
            or self.duplicated_requests
            or self.failed_requests
            or self.cross_tenant_diffs
        )


def run_load(workdir: Path, tenants: int, steps: int, seed: int = 0) -> LoadReport:
    plans = make_plans(tenants, steps, seed)
    keys = [p.key for p in plans]
    began = time.perf_counter()
    concurrent_dir, solo_dir = workdir / "load-concurrent", workdir / "load-solo"
    # the CLI's default 5 ms batch window: requests that arrive together share a batch
    slots = dict(
        max_adapters=max(12, tenants), sampler_slots=max(16, 2 * tenants), batch_window_s=0.005
    )
    with inprocess_server(concurrent_dir, keys, **slots) as server:
        base_model = str(server.service.executor.base_path)
        traces, executed = run_concurrent(server.base_url, base_model, plans)
        stats = server.service.scheduler.stats.as_dict()
    with inprocess_server(solo_dir, keys, **slots) as server:
        solo = [run_tenant(server.base_url, base_model, plan) for plan in plans]
    wall = time.perf_counter() - began

    sent: Counter[str] = Counter({"create_model": tenants})
    for kind, count in SERVER_KINDS_PER_STEP.items():
        sent[kind] = tenants * steps * count
    lost = sum(len(t.lost) for t in traces) + sum(
        max(0, sent[k] - executed.get(k, 0)) for k in sent
    )
    duplicated = sum(max(0, executed.get(k, 0) - sent.get(k, 0)) for k in set(sent) | set(executed))
    duplicated += sum(len(t.step_errors) for t in traces)
    diffs: list[str] = []
    comparisons = []
    for mine, replay in zip(traces, solo, strict=True):
        found = compare(mine, replay, concurrent_dir, solo_dir)
        comparisons.append(found)
        diffs += [f"tenant {mine.key[:22]}: {d}" for d in found.problems]
    # the control: tenant 0's run against another tenant's replay (of the same rank if there
    # is one, so the weights compare number by number)
    partner = next((j for j in range(1, tenants) if plans[j].rank == plans[0].rank), 1)
    control = compare(traces[0], solo[partner], concurrent_dir, solo_dir) if tenants > 1 else None
    latency: dict[str, dict[str, float]] = {}
    for call in CALLS:
        values = [v for t in traces for v in t.latencies.get(call, [])]
        latency[call] = {
            "n": len(values),
            "p50": percentile(values, 50) * 1e3,
            "p99": percentile(values, 99) * 1e3,
            "max": max(values, default=float("nan")) * 1e3,
        }
    return LoadReport(
        tenants=tenants,
        steps=steps,
        sent=dict(sent),
        executed=dict(executed),
        lost_requests=lost,
        duplicated_requests=duplicated,
        failed_requests=[f for t in traces + solo for f in t.failed],
        cross_tenant_diffs=sum(1 for c in comparisons if c.problems),
        diff_examples=diffs[:10],
        bit_exact_tenants=sum(1 for c in comparisons if c.exact and not c.problems),
        max_logprob_diff=max(c.max_logprob_diff for c in comparisons),
        max_rel_weight_diff=max(c.max_rel_weight_diff for c in comparisons),
        max_metric_rel_diff=max(c.max_metric_rel_diff for c in comparisons),
        sample_flips=sum(c.sample_flips for c in comparisons),
        control_problems=None if control is None else len(control.problems),
        control_rel_weight_diff=None if control is None else control.max_rel_weight_diff,
        control_metric_rel_diff=None if control is None else control.max_metric_rel_diff,
        latency_ms=latency,
        mixed_batches=dict(stats["mixed_batches"]),
        wall_s=wall,
    )
