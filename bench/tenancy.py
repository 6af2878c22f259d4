"""Many tenants on one server: paged training adapters, fair shares, a flooder's neighbours.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.tenancy --json bench/results/tenancy.json

Three parts (issue 22), each on in-process servers (lorafleet.server.main.ServerThread) with
the tiny-qwen3 preset, driven by the official `tinker` SDK over loopback from this process:

- paging: `--runs` training runs (256) registered by `--clients` SDK clients (64, one tenant
  each; run r belongs to client r mod clients) on a server with `--max-adapters` bank slots (8),
  then `--ops` operations (forward_backward + optim_step, and every `--sample-every`-th one
  also save_weights_and_get_sampling_client + a sample), each on a run drawn by Zipf(`--zipf`)
  over the runs (the hottest runs spread over the clients), every client running its share in
  order, all clients at once. The same operations run on a second server whose bank holds
  every run, the two sides interleaved round after round. `failed_ops` (target 0) counts every
  operation or creation that raised in the SDK on the paged side; `paging_overhead` = seconds
  per operation paged / resident (target <= 1.3; min over rounds, median beside it).
- fairness: 8 equal-weight tenants, one run each, whose forward_backward calls are 1x to 32x
  in size (rows 32^(i/7), `--row-tokens` (32) tokens a row). Each stays backlogged: it keeps
  at least `--backlog-calls` (4) calls submitted and unfinished at every moment, and at least
  as many tokens as the heaviest tenant's share of `--backlog-rounds` (4) of the server's
  rounds (its round token budget, read from its stats): a call's result comes back and is
  replaced a round or two after it ran, and a tenant whose queue at the server runs dry in
  that time would be served less for want of work, not for want of a fair share. Over
  `--fair-seconds` after a warm-up, Jain's index over each tenant's served tokens per second
  (target >= 0.95). Then 3 tenants of weights 1:2:4 (a tenants file, where the server takes
  one), equal calls and the same backlog: each served share within 10% of its weight's share
  (`weighted_share_error`, the largest relative miss; target <= 0.10).
- flood: one tenant keeps `--flood-calls` (16) forward_backward calls of `--flood-rows` rows
  (512) of 16 tokens in flight beside 4 small tenants that step (1-row forward_backward +
  optim_step) in a loop; `small_p99_over_solo` = the small tenants' p99 step latency beside
  the flooder / their p99 alone, the two sides interleaved (target <= 3). The flooder's client
  runs in a process of its own, as it would on its own machine: building and decoding 512-row
  calls in this process would hold the GIL that the server and the small clients need, and
  the ratio would measure that. The small tenants' wait is bounded by the server's round token
  budget (`--round-tokens` sets it; the row count of the flood calls hardly matters), so on a
  slow CPU the ratio follows how long one round of that many tokens takes there.

Paging pages to host memory unless `--warm-bytes` is small enough that runs go to disk too.

Served tokens are counted by the clients: a call's tokens count when its result arrives inside
the measured window. Server configuration fields this checkout lacks (the paging, scheduling
and tenant-config work of issue 22 may not all be present) are skipped and listed in the JSON
under `unsupported_config`, so the bench runs on any checkout and says what it measured.
Nothing here asserts; each result states whether its target is met.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker
from tinker import types

from bench.common import add_device_option, add_dtype_option, bench_device, bench_dtype, report
from lorafleet.hardware import DtypeChoice
from lorafleet.server.config import ServerConfig
from lorafleet.server.engine.executor import EngineConfig
from lorafleet.server.main import ServerThread, free_port

BASE_MODEL = "tiny-qwen3"
VOCAB = 512  # tiny-qwen3's tokenizer
RANK = 4
RESULT_TIMEOUT_S = 600.0
PROMPT = types.ModelInput.from_ints([11, 22, 33, 44])
SAMPLE_PARAMS = types.SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[])
ENGINE_OPTIONS = ("warm_bytes", "device")


def _log(message: str) -> None:
    print(message, flush=True)


# =============================================================================== servers


@dataclass(frozen=True)
class TenantSpec:
    name: str
    key: str
    weight: float = 1.0


def tenant_specs(tag: str, count: int, weights: Sequence[float] | None = None) -> list[TenantSpec]:
    return [
        TenantSpec(
            f"{tag}{i:02d}",
            f"tml-bench-{tag}-{i:02d}-0123456789abcdef",
            1.0 if weights is None else float(weights[i]),
        )
        for i in range(count)
    ]


def _supported(cls: type, values: dict[str, Any], unsupported: list[str]) -> dict[str, Any]:
    """The fields of `values` that the dataclass `cls` has; the others are listed in
    `unsupported` (by `cls.field`), so the report says what this checkout could not set."""
    names = {f.name for f in dataclasses.fields(cls)}
    for name in values:
        if name not in names:
            unsupported.append(f"{cls.__name__}.{name}")
    return {k: v for k, v in values.items() if k in names}


def tenants_toml(tenants: Sequence[TenantSpec]) -> str:
    """A tenants file (issue 22, `--tenants-file`): one table per tenant with its key's
    sha256 and its weight; no quotas, so only the weights differ from the default."""
    import hashlib

    lines = []
    for spec in tenants:
        digest = hashlib.sha256(spec.key.encode()).hexdigest()
        lines += [
            f"[tenants.{spec.name}]",
            f'key_sha256 = ["{digest}"]',
            f"weight = {spec.weight}",
            "",
        ]
    return "\n".join(lines)


@dataclass
class Server:
    thread: ServerThread
    tenants: list[TenantSpec]
    weighted: bool  # the tenants' weights reached the server (a tenants file it accepts)

    @property
    def url(self) -> str:
        return self.thread.base_url

    @property
    def base_model(self) -> str:
        return str(self.thread.service.executor.base_path)

    def stats(self) -> dict[str, Any]:
        """What `GET /api/v1/lorafleet/stats` shows an operator key (every tenant's queues and
        deficits; the bench's tenants are not operators, and would see only their own)."""
        return self.thread.service.stats()

    def stop(self) -> None:
        self.thread.stop()


def start_server(
    data_dir: Path,
    tenants: Sequence[TenantSpec],
    dtype: DtypeChoice,
    unsupported: list[str],
    *,
    max_adapters: int,
    sampler_slots: int = 16,
    weighted: bool = False,
    **server_fields: Any,
) -> Server:
    """An in-process server for `tenants`. With `weighted`, the tenants (and their weights)
    go to it as a tenants file when ServerConfig takes one, else as plain keys (equal
    weights; `Server.weighted` is then False)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    engine_fields = {k: server_fields.pop(k) for k in ENGINE_OPTIONS if k in server_fields}
    engine = EngineConfig(
        **_supported(
            EngineConfig,
            dict(
                base_model=BASE_MODEL,
                dtype=dtype.dtype,
                max_adapters=max_adapters,
                sampler_slots=sampler_slots,
                max_lora_rank=8,
                max_sample_rows=16,
                **engine_fields,
            ),
            unsupported,
        )
    )
    fields: dict[str, Any] = dict(server_fields)
    accepted = weighted and "tenants_file" in {f.name for f in dataclasses.fields(ServerConfig)}
    if weighted and accepted:
        path = data_dir.parent / f"{data_dir.name}-tenants.toml"
        path.write_text(tenants_toml(tenants), encoding="utf-8")
        path.chmod(0o600)
        fields["tenants_file"] = path
    elif weighted:
        unsupported.append("ServerConfig.tenants_file")
    config = ServerConfig(
        base_model=BASE_MODEL,
        data_dir=data_dir,
        api_keys=[] if accepted else [t.key for t in tenants],
        port=free_port(),
        engine=engine,
        torch_threads=1,
        tokenizer_cache=data_dir.parent / f"{data_dir.name}-hf-hub",
        **_supported(ServerConfig, fields, unsupported),
    )
    return Server(ServerThread(config), list(tenants), accepted)


def server_options(args: argparse.Namespace) -> dict[str, Any]:
    """What the command line sets on every server (unset: the server's defaults)."""
    options: dict[str, Any] = {}
    if args.round_tokens is not None:
        options["round_token_budget"] = args.round_tokens
    if args.warm_bytes is not None:
        options["warm_bytes"] = args.warm_bytes
    options["device"] = args.device  # resolved by bench_device in main
    return options


def connect(server: Server, spec: TenantSpec) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=server.url, api_key=spec.key)


def close_all(clients: Sequence[tinker.ServiceClient]) -> None:
    for client in clients:
        try:
            client.close("success").result(timeout=60)
        except Exception as exc:  # noqa: BLE001 - a bench must still write what it measured
            _log(f"closing a client failed: {type(exc).__name__}: {exc}")


# =============================================================================== helpers


def datums(seed: int, rows: int, tokens: int) -> list[types.Datum]:
    """`rows` next-token rows of `tokens` predicted tokens each, the same for the same seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        seq = [rng.randrange(3, VOCAB) for _ in range(tokens + 1)]
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * tokens},
            )
        )
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def min_median(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "min_s": ordered[0] if ordered else float("nan"),
        "median_s": ordered[len(ordered) // 2] if ordered else float("nan"),
        "runs": len(ordered),
    }


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all are equal, 1/n when one gets everything."""
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares > 0 else float("nan")


def _met(value: float, ok: bool) -> str:
    return "met" if ok else ("not measured" if math.isnan(value) else "NOT met")


@contextmanager
def pool(workers: int) -> Iterator[ThreadPoolExecutor]:
    executor = ThreadPoolExecutor(max_workers=workers)
    try:
        yield executor
    finally:
        executor.shutdown(wait=True)


# =============================================================================== (a) paging


@dataclass
class PagingSide:
    name: str
    server: Server
    clients: list[tinker.ServiceClient] = field(default_factory=list)
    runs: dict[int, Any] = field(default_factory=dict)  # run index -> TrainingClient
    failures: list[str] = field(default_factory=list)
    ops_done: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, what: str, exc: BaseException) -> None:
        with self.lock:
            self.failures.append(f"{what}: {type(exc).__name__}: {str(exc)[:300]}")


def zipf_ops(
    count: int, runs: int, exponent: float, sample_every: int, seed: int
) -> list[tuple[int, bool]]:
    """`count` operations as (run, also_sample): the k-th most active run is drawn with
    probability proportional to 1/k^exponent, and which run is k-th is a fixed shuffle, so the
    hot runs belong to different clients."""
    rng = random.Random(seed)
    order = list(range(runs))
    rng.shuffle(order)
    weights = [1.0 / (k + 1) ** exponent for k in range(runs)]
    ranks = rng.choices(range(runs), weights=weights, k=count)
    return [
        (order[r], sample_every > 0 and (i + 1) % sample_every == 0) for i, r in enumerate(ranks)
    ]


def _register(side: PagingSide, specs: list[TenantSpec], runs: int) -> None:
    """Every client creates its runs, all clients at once."""
    side.clients = [connect(side.server, spec) for spec in specs]

    def create(client_index: int) -> None:
        for run in range(client_index, runs, len(specs)):
            try:
                tc = (
                    side.clients[client_index]
                    .create_lora_training_client(
                        base_model=side.server.base_model, rank=RANK, seed=run, train_unembed=False
                    )
                    .result(timeout=RESULT_TIMEOUT_S)
                )
            except Exception as exc:  # noqa: BLE001 - counted: a failed creation is the finding
                side.fail(f"create run {run}", exc)
                continue
            side.runs[run] = tc

    with pool(len(specs)) as executor:
        list(executor.map(create, range(len(specs))))


def _run_ops(side: PagingSide, ops: list[tuple[int, bool]], clients: int, round_: int) -> float:
    """Every client runs its operations in order, all clients at once; returns the seconds."""
    per_client: list[list[tuple[int, int, bool]]] = [[] for _ in range(clients)]
    for index, (run, also_sample) in enumerate(ops):
        per_client[run % clients].append((index, run, also_sample))
    start = threading.Barrier(clients + 1)

    def work(items: list[tuple[int, int, bool]]) -> None:
        start.wait()
        for index, run, also_sample in items:
            tc = side.runs.get(run)
            if tc is None:
                side.fail(f"op {index} on run {run}", RuntimeError("the run was never created"))
                continue
            try:
                fwd = tc.forward_backward(datums(round_ * 100_003 + index, 2, 16), "cross_entropy")
                opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
                fwd.result(timeout=RESULT_TIMEOUT_S)
                opt.result(timeout=RESULT_TIMEOUT_S)
                if also_sample:
                    sampler = tc.save_weights_and_get_sampling_client().result(
                        timeout=RESULT_TIMEOUT_S
                    )
                    sampler.sample(PROMPT, 1, SAMPLE_PARAMS).result(timeout=RESULT_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - counted: a failed operation is the finding
                side.fail(f"op {index} on run {run}", exc)
                continue
            with side.lock:
                side.ops_done += 1

    with pool(clients) as executor:
        done = [executor.submit(work, items) for items in per_client]
        start.wait()
        began = time.perf_counter()
        for future in done:
            future.result()
        return time.perf_counter() - began


def part_paging(args: argparse.Namespace, workdir: Path, dtype: DtypeChoice) -> dict[str, Any]:
    _log(
        f"\n(a) paging: {args.runs} runs, {args.clients} clients, {args.ops} ops per round, "
        f"max_adapters {args.max_adapters} vs {args.runs}"
    )
    unsupported: list[str] = []
    specs = tenant_specs("page", args.clients)
    sides = [
        PagingSide(
            name,
            start_server(
                workdir / f"paging-{name}",
                specs,
                dtype,
                unsupported,
                max_adapters=slots,
                **server_options(args),
                sampler_slots=max(16, args.clients),
            ),
        )
        for name, slots in (("paged", args.max_adapters), ("resident", args.runs))
    ]
    ops = zipf_ops(args.ops, args.runs, args.zipf, args.sample_every, seed=1)
    distinct = len({run for run, _ in ops})
    times: dict[str, list[float]] = {side.name: [] for side in sides}
    registered: dict[str, float] = {}
    try:
        for side in sides:
            began = time.perf_counter()
            _register(side, specs, args.runs)
            registered[side.name] = time.perf_counter() - began
            _log(
                f"  {side.name}: {len(side.runs)}/{args.runs} runs registered in "
                f"{registered[side.name]:.1f} s ({len(side.failures)} failures)"
            )
        for round_ in range(args.repeats + 1):  # round 0 warms up
            for side in sides:
                seconds = _run_ops(side, ops, args.clients, round_)
                if round_ > 0:
                    times[side.name].append(seconds / len(ops))
                _log(f"  round {round_} {side.name}: {seconds:.1f} s")
        stats = {side.name: side.server.stats() for side in sides}
        paging = stats["paged"].get("paging", {}).get("training", {})
        _log(f"  paged side: page-ins {paging.get('page_ins')}, runs by tier {paging.get('runs')}")
    finally:
        for side in sides:
            close_all(side.clients)
            side.server.stop()
    timings = {f"paging:{name}_per_op": min_median(values) for name, values in times.items()}
    overhead = timings["paging:paged_per_op"]["min_s"] / timings["paging:resident_per_op"]["min_s"]
    overhead_median = (
        timings["paging:paged_per_op"]["median_s"] / timings["paging:resident_per_op"]["median_s"]
    )
    paged, resident = sides
    failed = len(paged.failures)
    return {
        "timings": timings,
        "ratios": {
            "failed_ops": (float(failed), f"== 0: {_met(failed, failed == 0)}"),
            "paging_overhead": (overhead, f"<= 1.3: {_met(overhead, overhead <= 1.3)}"),
        },
        "detail": {
            "runs": args.runs,
            "clients": args.clients,
            "max_adapters": args.max_adapters,
            "ops_per_round": len(ops),
            "distinct_runs_per_round": distinct,
            "zipf": args.zipf,
            "sample_every": args.sample_every,
            "rounds": args.repeats,
            "registration_s": registered,
            "paging_overhead_median": overhead_median,
            "failed_ops": failed,
            "failed_ops_resident": len(resident.failures),
            "failures_first": paged.failures[:5],
            "failures_resident_first": resident.failures[:5],
            "ops_done": {side.name: side.ops_done for side in sides},
            "paging_counters": paging,
            "server_stats": stats,
            "unsupported_config": sorted(set(unsupported)),
        },
    }


# =============================================================================== (b) fairness


@dataclass
class Served:
    """One tenant's completions: (time the result arrived, tokens in the call)."""

    done: list[tuple[float, int]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def tokens_between(self, start: float, end: float) -> int:
        return sum(tokens for at, tokens in self.done if start <= at <= end)


def _backlogged(
    tc: Any, rows: int, row_tokens: int, depth: int, stop: threading.Event, served: Served
) -> None:
    """Keeps `depth` forward_backward calls of `rows` rows submitted and unfinished until
    `stop`; each result's arrival is recorded with the call's tokens."""
    seed = 0
    inflight: list[Any] = []
    while not stop.is_set() or inflight:
        while not stop.is_set() and len(inflight) < depth:
            seed += 1
            inflight.append(tc.forward_backward(datums(seed, rows, row_tokens), "cross_entropy"))
        if not inflight:
            break
        future = inflight.pop(0)
        try:
            future.result(timeout=RESULT_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - counted, and the tenant goes on
            served.failures.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            continue
        served.done.append((time.perf_counter(), rows * row_tokens))


DEFAULT_ROUND_TOKENS = 4096
"""The round budget assumed for the backlog when the server's stats do not report one."""


def round_budget(server: Server) -> int:
    fair = server.stats().get("fair_share")
    if isinstance(fair, dict) and isinstance(fair.get("round_token_budget"), int):
        return int(fair["round_token_budget"])
    return DEFAULT_ROUND_TOKENS


@dataclass
class Shares:
    tokens_per_s: list[float]
    depths: list[int]  # calls each tenant kept in flight
    floor_tokens: int
    failures: list[str]
    stats: dict[str, Any]


def measure_shares(server: Server, rows: Sequence[int], args: argparse.Namespace) -> Shares:
    """Tokens per second served to each of the server's tenants while all stay backlogged.

    Every tenant keeps at least `--backlog-calls` calls in flight, and at least as many tokens
    as the heaviest tenant's weighted share of `--backlog-rounds` rounds: the same floor for
    everyone, so no tenant runs short of work for its share, and a scheduler that served
    whatever is queued (not by weight) would serve the tenants alike."""
    weights = [spec.weight for spec in server.tenants]
    budget = round_budget(server)
    floor = math.ceil(args.backlog_rounds * budget * max(weights) / sum(weights))
    depths = [max(args.backlog_calls, math.ceil(floor / (n * args.row_tokens))) for n in rows]
    clients = [connect(server, spec) for spec in server.tenants]
    try:
        runs = [
            client.create_lora_training_client(
                base_model=server.base_model, rank=RANK, seed=i, train_unembed=False
            ).result(timeout=RESULT_TIMEOUT_S)
            for i, client in enumerate(clients)
        ]
        stop = threading.Event()
        served = [Served() for _ in runs]
        with pool(len(runs)) as executor:
            for tc, n, depth, record in zip(runs, rows, depths, served, strict=True):
                executor.submit(_backlogged, tc, n, args.row_tokens, depth, stop, record)
            time.sleep(args.fair_warmup)
            start = time.perf_counter()
            time.sleep(args.fair_seconds)
            end = time.perf_counter()
            stats = server.stats()  # while every tenant is backlogged: the queues and deficits
            stop.set()
        return Shares(
            [record.tokens_between(start, end) / (end - start) for record in served],
            depths,
            floor,
            [f for record in served for f in record.failures],
            stats,
        )
    finally:
        close_all(clients)


def part_fairness(args: argparse.Namespace, workdir: Path, dtype: DtypeChoice) -> dict[str, Any]:
    sizes = [max(1, round(32 ** (i / 7))) for i in range(8)]
    _log(
        f"\n(b) fairness: 8 equal tenants, calls of {sizes} rows x {args.row_tokens} tokens, "
        f"{args.fair_seconds:.0f} s measured"
    )
    unsupported: list[str] = []
    equal_server = start_server(
        workdir / "fair-equal",
        tenant_specs("fair", 8),
        dtype,
        unsupported,
        max_adapters=8,
        weighted=True,
        **server_options(args),
    )
    try:
        equal = measure_shares(equal_server, sizes, args)
    finally:
        equal_server.stop()
    index = jain(equal.tokens_per_s)
    _log(
        f"  calls in flight {equal.depths}; tokens/s per tenant "
        f"{[round(r) for r in equal.tokens_per_s]}; Jain {index:.3f}"
    )

    weights = [1.0, 2.0, 4.0]
    _log(f"  weights {weights}: calls of {args.weighted_rows} rows each")
    weighted_server = start_server(
        workdir / "fair-weighted",
        tenant_specs("wt", 3, weights),
        dtype,
        unsupported,
        max_adapters=8,
        weighted=True,
        **server_options(args),
    )
    try:
        weighted = measure_shares(weighted_server, [args.weighted_rows] * 3, args)
        applied = weighted_server.weighted
    finally:
        weighted_server.stop()
    total = sum(weighted.tokens_per_s)
    shares = [r / total if total else float("nan") for r in weighted.tokens_per_s]
    wanted = [w / sum(weights) for w in weights]
    worst = max(abs(s / w - 1.0) for s, w in zip(shares, wanted, strict=True))
    _log(
        f"  calls in flight {weighted.depths}; shares {[round(s, 3) for s in shares]} "
        f"(weights' {[round(w, 3) for w in wanted]})"
    )
    return {
        "timings": {},
        "ratios": {
            "jain_index": (index, f">= 0.95: {_met(index, index >= 0.95)}"),
            "weighted_share_error": (
                worst,
                f"<= 0.10: {_met(worst, worst <= 0.10)}"
                + ("" if applied else " (weights not applied: this server takes no tenants file)"),
            ),
        },
        "detail": {
            "call_rows": sizes,
            "row_tokens": args.row_tokens,
            "measured_s": args.fair_seconds,
            "backlog_floor_tokens": equal.floor_tokens,
            "calls_in_flight": equal.depths,
            "tokens_per_s": equal.tokens_per_s,
            "failures": len(equal.failures),
            "failures_first": equal.failures[:5],
            "weights": weights,
            "weights_applied": applied,
            "weighted_rows": args.weighted_rows,
            "weighted_backlog_floor_tokens": weighted.floor_tokens,
            "weighted_calls_in_flight": weighted.depths,
            "weighted_tokens_per_s": weighted.tokens_per_s,
            "weighted_shares": shares,
            "weighted_failures": len(weighted.failures),
            "server_stats": {"equal": equal.stats, "weighted": weighted.stats},
            "unsupported_config": sorted(set(unsupported)),
        },
    }


# =============================================================================== (c) flood


def _small_steps(
    tc: Any, steps: int, seed: int, latencies: list[float], failures: list[str]
) -> None:
    for step in range(steps):
        began = time.perf_counter()
        try:
            fwd = tc.forward_backward(datums(seed * 1000 + step, 1, 16), "cross_entropy")
            opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
            fwd.result(timeout=RESULT_TIMEOUT_S)
            opt.result(timeout=RESULT_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - counted, and the tenant goes on
            failures.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            continue
        latencies.append(time.perf_counter() - began)


@dataclass
class Flood:
    served: int = 0
    failures: list[str] = field(default_factory=list)


def _flood_process(
    url: str, key: str, base_model: str, rows: int, calls: int, started: Any, stop: Any, out: Any
) -> None:
    """The flooding tenant, in a process of its own (as it would be on its own machine): its
    client's work (building 512-row calls, decoding their results) does not share the GIL of
    the server and the small tenants' clients."""
    service = tinker.ServiceClient(base_url=url, api_key=key)
    record = Served()
    try:
        tc = service.create_lora_training_client(
            base_model=base_model, rank=RANK, seed=0, train_unembed=False
        ).result(timeout=RESULT_TIMEOUT_S)
        halt = threading.Event()
        worker = threading.Thread(
            target=_backlogged, args=(tc, rows, 16, calls, halt, record), daemon=True
        )
        worker.start()
        started.set()
        stop.wait()
        halt.set()
        worker.join()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which counts it
        record.failures.append(f"{type(exc).__name__}: {str(exc)[:200]}")
    finally:
        started.set()
        service.close("success").result(timeout=60)
        out.put((len(record.done), record.failures))


@contextmanager
def flooding(server: Server, spec: TenantSpec, args: argparse.Namespace) -> Iterator[Flood]:
    """Runs the flooder (its own process) for the body of the `with`, its calls in flight
    for `--flood-lead` seconds first; the result is filled in when it has stopped."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    started, stop, out = context.Event(), context.Event(), context.Queue()
    process = context.Process(
        target=_flood_process,
        args=(
            server.url,
            spec.key,
            server.base_model,
            args.flood_rows,
            args.flood_calls,
            started,
            stop,
            out,
        ),
        daemon=True,
    )
    process.start()
    flood = Flood()
    try:
        if not started.wait(RESULT_TIMEOUT_S):
            raise RuntimeError("the flooder's process did not start")
        time.sleep(args.flood_lead)  # its calls reach the server first
        yield flood
    finally:
        stop.set()
        flood.served, flood.failures = out.get(timeout=RESULT_TIMEOUT_S)
        process.join(60)


def part_flood(args: argparse.Namespace, workdir: Path, dtype: DtypeChoice) -> dict[str, Any]:
    _log(
        f"\n(c) flood: {args.flood_calls} concurrent forward_backward calls of {args.flood_rows} "
        f"rows x 16 tokens (their client in a process of its own) beside 4 small tenants "
        f"({args.small_steps} 1-row steps each)"
    )
    unsupported: list[str] = []
    specs = tenant_specs("flood", 5)
    server = start_server(
        workdir / "flood", specs, dtype, unsupported, max_adapters=8, **server_options(args)
    )
    clients = [connect(server, spec) for spec in specs[1:]]  # specs[0] is the flooder's
    p99: dict[str, list[float]] = {"solo": [], "flooded": []}
    p50: dict[str, list[float]] = {"solo": [], "flooded": []}
    failures: list[str] = []
    flood_served: list[int] = []
    try:
        runs = [
            client.create_lora_training_client(
                base_model=server.base_model, rank=RANK, seed=i + 1, train_unembed=False
            ).result(timeout=RESULT_TIMEOUT_S)
            for i, client in enumerate(clients)
        ]
        small = runs

        def small_round(seed: int) -> list[float]:
            latencies: list[float] = []
            with pool(len(small)) as executor:
                for i, tc in enumerate(small):
                    executor.submit(
                        _small_steps, tc, args.small_steps, seed + i, latencies, failures
                    )
            return latencies

        for round_ in range(args.repeats + 1):  # round 0 warms up
            solo = small_round(round_ * 10)
            with flooding(server, specs[0], args) as flood:
                flooded = small_round(round_ * 10 + 5)
            failures += flood.failures
            flood_served.append(flood.served)
            if round_ > 0:
                p99["solo"].append(percentile(solo, 99))
                p99["flooded"].append(percentile(flooded, 99))
                p50["solo"].append(percentile(solo, 50))
                p50["flooded"].append(percentile(flooded, 50))
            _log(
                f"  round {round_}: small p99 solo {percentile(solo, 99) * 1e3:.0f} ms, "
                f"beside the flood {percentile(flooded, 99) * 1e3:.0f} ms "
                f"({flood.served} flood calls served)"
            )
        stats = server.stats()
    finally:
        close_all(clients)
        server.stop()
    timings = {f"flood:small_p99_{name}": min_median(values) for name, values in p99.items()}
    ratio = timings["flood:small_p99_flooded"]["min_s"] / timings["flood:small_p99_solo"]["min_s"]
    ratio_median = (
        timings["flood:small_p99_flooded"]["median_s"] / timings["flood:small_p99_solo"]["median_s"]
    )
    return {
        "timings": timings,
        "ratios": {
            "small_p99_over_solo": (ratio, f"<= 3: {_met(ratio, ratio <= 3.0)}"),
        },
        "detail": {
            "flood_calls": args.flood_calls,
            "flood_rows": args.flood_rows,
            "small_steps_per_tenant": args.small_steps,
            "small_p99_over_solo_median": ratio_median,
            "small_p50_s": {name: min_median(values) for name, values in p50.items()},
            "flood_calls_served_per_round": flood_served,
            "failures": len(failures),
            "failures_first": failures[:5],
            "server_stats": stats,
            "unsupported_config": sorted(set(unsupported)),
        },
    }


# =============================================================================== main

PARTS: dict[str, Callable[[argparse.Namespace, Path, DtypeChoice], dict[str, Any]]] = {
    "paging": part_paging,
    "fairness": part_fairness,
    "flood": part_flood,
}


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per side")
    add_dtype_option(parser)
    add_device_option(parser)
    parser.add_argument("--only", default=",".join(PARTS), help="comma-separated parts to run")
    parser.add_argument("--runs", type=int, default=256, help="(a) registered training runs")
    parser.add_argument("--clients", type=int, default=64, help="(a) SDK clients, one tenant each")
    parser.add_argument("--max-adapters", type=int, default=8, help="(a) bank slots, paged side")
    parser.add_argument("--ops", type=int, default=256, help="(a) operations per round")
    parser.add_argument("--zipf", type=float, default=1.1, help="(a) Zipf exponent of activity")
    parser.add_argument(
        "--sample-every", type=int, default=8, help="(a) every n-th op also samples (0: never)"
    )
    parser.add_argument("--row-tokens", type=int, default=32, help="(b) tokens per row")
    parser.add_argument(
        "--backlog-calls",
        type=int,
        default=4,
        help="(b) calls each tenant keeps in flight, at least",
    )
    parser.add_argument(
        "--backlog-rounds",
        type=float,
        default=4.0,
        help="(b) ... and tokens: the heaviest tenant's share of this many rounds",
    )
    parser.add_argument("--fair-seconds", type=float, default=20.0, help="(b) measured window")
    parser.add_argument("--fair-warmup", type=float, default=3.0, help="(b) seconds before it")
    parser.add_argument(
        "--weighted-rows", type=int, default=16, help="(b) rows per call, weighted tenants"
    )
    parser.add_argument("--flood-calls", type=int, default=16, help="(c) flooder's calls in flight")
    parser.add_argument("--flood-rows", type=int, default=512, help="(c) rows per flooder call")
    parser.add_argument(
        "--flood-lead", type=float, default=0.5, help="(c) seconds the flood runs before"
    )
    parser.add_argument(
        "--small-steps", type=int, default=25, help="(c) steps per small tenant per round"
    )
    parser.add_argument(
        "--round-tokens",
        type=int,
        default=None,
        help="every server's round_token_budget (default: the server's own)",
    )
    parser.add_argument(
        "--warm-bytes",
        type=int,
        default=None,
        help="every server's host memory for paged-out runs (default: the engine's own; "
        "small values page runs to disk)",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="keep the data dirs here")
    return parser.parse_args()


def main() -> int:
    args = _args()
    args.device = bench_device(args.device).device
    dtype = bench_dtype(args.dtype, args.device)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"--only: unknown part(s) {unknown}; the parts are {list(PARTS)}")
    timings: dict[str, dict[str, float]] = {}
    ratios: dict[str, tuple[float, str]] = {}
    extra: dict[str, Any] = {
        "model": BASE_MODEL,
        "rank": RANK,
        "server_options": server_options(args),
        "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lorafleet-tenancy-") as tmp:
        workdir = args.workdir or Path(tmp)
        for name in parts:
            started = time.perf_counter()
            result = PARTS[name](args, workdir / name, dtype)
            timings.update(result["timings"])
            ratios.update(result["ratios"])
            extra[name] = {**result["detail"], "seconds": time.perf_counter() - started}
    extra["seconds"] = time.perf_counter() - began
    report(
        f"Tenancy on tiny-qwen3 {dtype.dtype}: paging, fair shares, a flooder's neighbours",
        timings,
        ratios,
        args.json,
        extra=extra,
        dtype=dtype,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
