"""Crash safety: SIGKILL the server in the middle of forward_backward, optim_step, save_state,
save_weights_for_sampler and the ephemeral export (save_weights_and_get_sampling_client), start
it again on the same data directory and port, and check what a user would rely on.

Where to kill is chosen by a seeded RNG per cycle: the operation (each in turn, shuffled), the
how (`pause_begin`: the engine is stopped just before the work, via the test-only crash points
of lorafleet/server/engine/faults.py; `pause_end`: just after the work, before its result or database
row is recorded; `delay`: the engine runs on and the kill lands a random 0-30 ms after the
operation began, often in the middle of writing files), and which occurrence (1st-3rd).

A client (official SDK) trains and saves in a loop until the server dies under it. Every save
it was told completed goes into a ledger with the sha256 of its files and a probe: the forward
log-probs of a fixed datum (training state) or greedy sampled tokens and log-probs (sampler
weights). Then, per cycle:
- right after the kill, before the restart: every visible checkpoint directory (training,
  sampler, ephemeral) reads back complete (else it is a torn file); in-progress writes are only
  ever hidden temp names;
- after the restart: the SQLite store passes `integrity_check` and agrees with the files (every
  row's directory is readable, nothing left pending from before), start-up recovery left no
  temp litter, modes are 0600/0700, every ledger entry's files are byte-identical, the newest
  training state resumes with bit-identical log-probs and the cycle's sampler checkpoints
  sample bit-identical tokens and log-probs;
- the client's in-flight future fails with a clear error (no hang).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import tinker
from tinker import types

from tests.reliability.harness import (
    ServerProcess,
    checkpoint_path_on_disk,
    digest_dir,
    permission_problems,
    scan_checkpoints,
    sqlite_problems,
    tenant_keys,
)

CRASH_OPS = ("forward_backward", "optim_step", "save_state", "save_sampler", "export")
MODES = ("pause_begin", "pause_end", "delay")
ITERATIONS = 12  # per cycle; the kill always comes within the first 3
RESULT_TIMEOUT_S = 300.0
WORKER_TIMEOUT_S = 240.0  # after the restart: longer means the future hung
PROBE = types.Datum(
    model_input=types.ModelInput.from_ints([5, 10, 15, 20, 25, 30, 35]),
    loss_fn_inputs={"target_tokens": [10, 15, 20, 25, 30, 35, 40], "weights": [1.0] * 7},
)
PROMPT = types.ModelInput.from_ints([7, 14, 21, 28])
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])


@dataclass
class Saved:
    path: str
    kind: str  # "training" | "sampler"
    digest: dict[str, str]
    cycle: int
    probe: bytes | None = None  # None: the server died before the probe answered


@dataclass(frozen=True)
class CyclePlan:
    index: int
    op: str
    mode: str
    hit: int
    delay_s: float

    @property
    def point(self) -> str:
        return f"{self.op}.{'end' if self.mode == 'pause_end' else 'begin'}"


@dataclass
class CycleResult:
    plan: CyclePlan
    killed_at: str = ""
    mid_write: bool = False  # a hidden temp entry was on disk at the kill
    torn: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    in_flight: str = ""
    clean_failure: bool = False
    recovered: dict[str, Any] = field(default_factory=dict)
    startup_s: float = 0.0
    saves_checked: int = 0
    loads_checked: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase

    @property
    def survived(self) -> bool:
        return not self.torn and not self.problems and self.clean_failure


def make_plans(cycles: int, seed: int) -> list[CyclePlan]:
    rng = random.Random(seed)
    ops = [CRASH_OPS[i % len(CRASH_OPS)] for i in range(cycles)]
    rng.shuffle(ops)
    return [
        CyclePlan(i, op, rng.choice(MODES), rng.randint(1, 3), rng.uniform(0.0, 0.03))
        for i, op in enumerate(ops)
    ]


def _batch(cycle: int, k: int) -> list[types.Datum]:
    rng = random.Random(cycle * 1000 + k)
    tokens = [rng.randrange(1, 500) for _ in range(rng.randint(8, 24))]
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
    ]


def probe_forward(tc: Any) -> bytes:
    out = tc.forward([PROBE], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    return out.loss_fn_outputs[0]["logprobs"].to_numpy().astype("<f4").tobytes()


def probe_sample(sampler: Any) -> bytes:
    seq = sampler.sample(PROMPT, 1, GREEDY).result(timeout=RESULT_TIMEOUT_S).sequences[0]
    return repr((list(seq.tokens), [float(x) for x in seq.logprobs or []])).encode()


class FaultWatch:
    """Follows the server's crash-point log (lorafleet/server/engine/faults.py)."""

    def __init__(self, path: Path):
        self.path = path
        self.lines: list[str] = []
        self._offset = 0

    def _read(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as log:
                log.seek(self._offset)
                chunk = log.read()
        except FileNotFoundError:
            return
        complete = chunk[: chunk.rfind("\n") + 1]
        self._offset += len(complete.encode())
        self.lines += complete.splitlines()

    def count(self, point: str) -> int:
        self._read()
        return sum(1 for line in self.lines if line.split()[0] == point)

    def wait_for(self, point: str, hit: int, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._read()
            for line in self.lines:
                name, count, *_ = line.split()
                if name == point and int(count) == hit:
                    return line
            time.sleep(0.0005)
        return None

    def arm_pause(self, point: str, hit: int) -> None:
        Path(str(self.path) + ".pause").write_text(f"{point} {hit}\n")


class Workload(threading.Thread):
    """Trains and saves until the server dies under it; every save it is told completed goes
    into the ledger (with its files' digests, read at once, and then its probe)."""

    def __init__(
        self, service: Any, tc: Any, cycle: int, data_dir: Path, key: str, ledger: list[Saved]
    ):
        super().__init__(name=f"crash-workload-{cycle}", daemon=True)
        self.service, self.tc, self.cycle = service, tc, cycle
        self.data_dir, self.key, self.ledger = data_dir, key, ledger
        self.outcome = ""
        self.exception: BaseException | None = None

    def _saved(self, path: str, kind: str) -> Saved:
        directory = checkpoint_path_on_disk(self.data_dir, self.key, path)
        entry = Saved(path, kind, digest_dir(directory), self.cycle)
        self.ledger.append(entry)
        return entry

    def run(self) -> None:
        tc = self.tc
        try:
            for k in range(ITERATIONS):
                name = f"c{self.cycle:02d}-{k}"
                tc.forward_backward(_batch(self.cycle, k), "cross_entropy").result(
                    timeout=RESULT_TIMEOUT_S
                )
                tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=RESULT_TIMEOUT_S)
                state = self._saved(
                    tc.save_state(name).result(timeout=RESULT_TIMEOUT_S).path, "training"
                )
                state.probe = probe_forward(tc)
                path = tc.save_weights_for_sampler(name).result(timeout=RESULT_TIMEOUT_S).path
                sampler_entry = self._saved(path, "sampler")
                sampler = self.service.create_sampling_client(model_path=path).result(
                    timeout=RESULT_TIMEOUT_S
                )
                sampler_entry.probe = probe_sample(sampler)
                live = tc.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
                live.sample(PROMPT, 1, GREEDY).result(timeout=RESULT_TIMEOUT_S)
            self.outcome = f"finished all {ITERATIONS} iterations (the kill never hit)"
        except BaseException as exc:  # noqa: BLE001 - recorded and judged by the cycle
            self.exception = exc
            self.outcome = f"{type(exc).__name__}: {exc}"[:300]


# What a client may be told after the crash, each an answer that says what happened and what to do:
# its request died with the old process; its model lived only in that process's memory; its
# sampler was an ephemeral one (save_weights_and_get_sampling_client), which never survives a
# restart by design.
CLEAN_FAILURES = (
    "the server restarted before this request finished",
    "is not loaded any more",
    "never across a server restart",
)


@dataclass
class CrashReport:
    cycles: list[CycleResult]
    server_starts: int
    wall_s: float

    @property
    def survived(self) -> int:
        return sum(1 for c in self.cycles if c.survived)

    @property
    def torn_files_seen(self) -> int:
        return sum(len(c.torn) for c in self.cycles)

    @property
    def hung_futures(self) -> int:
        return sum(1 for c in self.cycles if c.in_flight == "hung")

    def summary(self) -> dict[str, Any]:
        return {
            "cycles": len(self.cycles),
            "crash_restarts_survived": self.survived,
            "torn_files_seen": self.torn_files_seen,
            "hung_futures": self.hung_futures,
            "mid_write_kills": sum(1 for c in self.cycles if c.mid_write),
            "saves_verified": sum(c.saves_checked for c in self.cycles),
            "loads_verified_bit_exact": sum(c.loads_checked for c in self.cycles),
            "problems": [
                f"cycle {c.plan.index}: {p}" for c in self.cycles for p in c.torn + c.problems
            ][:20],
            "startup_s_median": sorted(c.startup_s for c in self.cycles)[len(self.cycles) // 2]
            if self.cycles
            else None,
            "per_cycle": [
                {
                    "op": c.plan.op,
                    "mode": c.plan.mode,
                    "hit": c.plan.hit,
                    "killed_at": c.killed_at,
                    "mid_write": c.mid_write,
                    "in_flight": c.in_flight,
                    "recovered": c.recovered,
                    "timings_s": {"startup": c.startup_s, **c.timings},
                    "survived": c.survived,
                }
                for c in self.cycles
            ],
            "server_starts": self.server_starts,
            "wall_s": self.wall_s,
        }


def _verify_after_restart(
    server: ServerProcess,
    key: str,
    ledger: list[Saved],
    cycle: int,
    restart_time: float,
    result: CycleResult,
) -> tuple[Any, Any]:
    """Checks the restarted server and its data dir; resumes the newest training state (the
    next cycle trains on from it). Returns (service client, training client)."""
    data_dir = server.data_dir
    stats = httpx.get(
        f"{server.base_url}/api/v1/lorafleet/stats", headers={"X-API-Key": key}, timeout=30
    ).json()
    result.recovered = stats.get("recovered", {})
    result.problems += sqlite_problems(data_dir, started_before=restart_time)
    _complete, torn, hidden = scan_checkpoints(data_dir)
    result.torn += [f"after restart: {t}" for t in torn]
    result.problems += [f"left after recovery: {h}" for h in hidden]
    result.problems += permission_problems(data_dir)
    for entry in ledger:
        directory = checkpoint_path_on_disk(data_dir, key, entry.path)
        if not directory.is_dir():
            result.problems.append(f"{entry.path} (reported saved) is gone")
        elif digest_dir(directory) != entry.digest:
            result.problems.append(f"{entry.path} (reported saved) changed on disk")
        result.saves_checked += 1
    service = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    listed = {
        c.tinker_path
        for c in tinker.RestClient(base_url=server.base_url, api_key=key)
        .list_user_checkpoints(limit=1000)
        .result(timeout=RESULT_TIMEOUT_S)
        .checkpoints
    }
    result.problems += [
        f"{e.path} (reported saved) is not listed" for e in ledger if e.path not in listed
    ]
    for entry in [e for e in ledger if e.kind == "sampler" and e.cycle == cycle and e.probe][-2:]:
        sampler = service.create_sampling_client(model_path=entry.path).result(
            timeout=RESULT_TIMEOUT_S
        )
        if probe_sample(sampler) != entry.probe:
            result.problems.append(f"{entry.path} samples differently after the restart")
        result.loads_checked += 1
    latest = next(
        (e for e in reversed(ledger) if e.kind == "training" and e.probe is not None), None
    )
    if latest is None:
        return service, None
    tc = service.create_training_client_from_state_with_optimizer(latest.path).result(
        timeout=RESULT_TIMEOUT_S
    )
    if probe_forward(tc) != latest.probe:
        result.problems.append(f"{latest.path} resumes with different log-probs")
    result.loads_checked += 1
    return service, tc


def run_crash(workdir: Path, cycles: int, seed: int = 0, log: Any = None) -> CrashReport:
    say = log or (lambda _msg: None)
    key = tenant_keys(1, "crash")[0]
    server = ServerProcess(workdir / "crash-data", [key], workdir / "crash-server.log")
    faults = workdir / "crash-faults"
    faults.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    startup = server.start(fault_file=faults / "0.log")
    rest = tinker.RestClient(base_url=server.base_url, api_key=key)
    base_model = rest.get_server_capabilities().result(timeout=60).supported_models[0].model_name
    ledger: list[Saved] = []
    services: list[Any] = []
    results: list[CycleResult] = []
    service = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    tc = service.create_lora_training_client(
        base_model=base_model, rank=8, seed=seed, train_unembed=False
    ).result(timeout=RESULT_TIMEOUT_S)
    try:
        for plan in make_plans(cycles, seed):
            result = CycleResult(plan, startup_s=startup)
            services.append(service)
            watch = FaultWatch(faults / f"{plan.index}.log")
            target = watch.count(plan.point) + plan.hit
            if plan.mode != "delay":
                watch.arm_pause(plan.point, target)
            worker = Workload(service, tc, plan.index, server.data_dir, key, ledger)
            clock = time.monotonic()
            worker.start()
            line = watch.wait_for(plan.point, target, timeout=RESULT_TIMEOUT_S)
            if line is None:
                result.problems.append(
                    f"the server never reached {plan.point} #{target}; worker: {worker.outcome}"
                )
            elif plan.mode == "delay":
                time.sleep(plan.delay_s)
            server.kill()
            result.killed_at = line or ""
            _complete, torn, hidden = scan_checkpoints(server.data_dir)
            result.torn += [f"at the kill: {t}" for t in torn]
            result.mid_write = any(".tmp" in h for h in hidden)
            restart_time = time.time()
            result.timings["to_kill"] = time.monotonic() - clock
            startup = server.start(fault_file=faults / f"{plan.index + 1}.log")
            result.startup_s = startup
            clock = time.monotonic()
            service, tc = _verify_after_restart(
                server, key, ledger, plan.index, restart_time, result
            )
            result.timings["verify"] = time.monotonic() - clock
            if tc is None:
                tc = service.create_lora_training_client(
                    base_model=base_model, rank=8, seed=seed, train_unembed=False
                ).result(timeout=RESULT_TIMEOUT_S)
            worker.join(WORKER_TIMEOUT_S)
            result.timings["worker_wait_after_verify"] = (
                time.monotonic() - clock - result.timings["verify"]
            )
            result.in_flight = "hung" if worker.is_alive() else worker.outcome
            result.clean_failure = isinstance(worker.exception, tinker.RequestFailedError) and any(
                m in str(worker.exception) for m in CLEAN_FAILURES
            )
            if not result.clean_failure:
                result.problems.append(
                    f"the client's in-flight request ended with: {result.in_flight}"
                )
            results.append(result)
            say(
                f"crash cycle {plan.index}: {plan.op}/{plan.mode}#{plan.hit} survived={result.survived} "
                f"mid_write={result.mid_write} in_flight={result.in_flight[:80]!r} "
                f"problems={(result.torn + result.problems)[:3]}"
            )
        services.append(service)
    finally:
        for client in services:  # every session still exists on the restarted server
            # if the server is gone (an earlier failure), closing only ends the client's threads
            with contextlib.suppress(TimeoutError, tinker.TinkerError, OSError):
                client.close("success").result(timeout=10)
        server.stop()
    return CrashReport(results, server.starts, time.perf_counter() - began)
