"""Rollout engines in an RL step, and what keeping them in sync costs it.

Every side is a `lorafleet serve` subprocess on the same base model (default SmolLM2-135M,
fp32: the canary is exact only in fp32) driven through the real `tinker` SDK by the main job's
own GRPO step (`lorafleet.rl.loop.TenantRunner.train_step`: save weights and get a sampling
client, sample `--prompts` x `--group` rollouts, score, forward_backward, optim_step). One
tenant, the same task, seeds and step number on every side. Sides:
- `embedded`: the server's own sampler (the default);
- `ray2`: `--ray local --sampler-replicas 2`: two Ray sampler replicas and a Ray trainer rank;
- `vllm` / `vllm2`: `--rollout-engine vllm=spawn[:N]`: vLLM servers the server spawns from the
  cached vLLM venv (`bash scripts/setup_vllm.sh`); skipped, with the reason, where the venv or
  the flag is missing.
Each engine runs in its own phase beside a fresh embedded server (the engines' processes need
memory; no two phases hold theirs at once). Within a phase the steps are interleaved (one step
on each side in turn, after `--warmup` steps each); each side reports the median and min of its
step seconds, and each ratio compares sides of one phase.

- `vllm_step_over_embedded` (and `vllm2_..`): median step time with vLLM rollouts over the
  embedded sampler's in the same phase (informational on CPU: vLLM's CPU kernels, an HTTP hop
  per request, and the version staged as files).
- `sync_share_<side>`: per step, the seconds the server spent putting the new weights into its
  sampler, sync and canary on every replica (`sampler_sync.seconds` of
  `/api/v1/lorafleet/stats`, read before and after the step) over the step's seconds; the
  median over the timed steps. Target <= 0.10.

    .venv/bin/python -m bench.rollout --json bench/results/rollout.json

`--part canary` compares, in one process on a local Ray cluster (one trainer rank, two sampler
replicas, SmolLM2 fp32, one trained rank-16 adapter, a fresh version per side and round), the
canary of one version as it is run now (`RayVersionStore.verify_everywhere`: replicas probed at
once while the trainer computes its side, each replica's base log-probs computed once) against
the same checks done one after the other, as the server did before: the trainer's side, then
each replica's version and base-model probes in turn, then the publisher's second canary (the
trainer's side again and two probes through `generate`). `canary_serial_over_parallel` is the
ratio of their medians.

    .venv/bin/python -m bench.rollout --part canary --json bench/results/rollout_canary.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import httpx
import tinker

from bench.common import add_device_option, bench_device, fixed_dtype, report, wait_healthy
from lorafleet.fsio import atomic_write_bytes, ensure_private_dir
from lorafleet.rl.connect import Backend, load_tokenizer, start_backend
from lorafleet.rl.loop import RLConfig, TenantConfig, TenantRunner
from lorafleet.rl.report import Progress
from lorafleet.server.main import free_port

KEY = "tml-bench-rollout-0123456789"
SIDES = ("embedded", "ray2", "vllm", "vllm2")
SERVER_FLAGS: dict[str, list[str]] = {
    "embedded": [],
    "ray2": ["--ray", "local", "--sampler-replicas", "2"],
    "vllm": ["--rollout-engine", "vllm=spawn"],
    "vllm2": ["--rollout-engine", "vllm=spawn:2"],
}


def _serve_help() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "lorafleet.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def unavailable(side: str, serve_help: str) -> str | None:
    """Why a side cannot run here, None when it can."""
    if side.startswith("vllm"):
        if "--rollout-engine" not in serve_help:
            return "this lorafleet serve has no --rollout-engine"
        from lorafleet.sync.vllm_server import VllmUnavailableError, vllm_python

        try:
            vllm_python()
        except VllmUnavailableError as exc:
            return str(exc)
    if side == "ray2":
        try:
            import ray  # noqa: F401
        except ImportError:
            return "ray is not installed"
    return None


@dataclass
class Side:
    """One `lorafleet serve` process and the GRPO tenant that trains against it."""

    name: str
    root: Path
    args: argparse.Namespace
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)

    def start(self) -> None:
        data = ensure_private_dir(self.root / "data")
        keys = self.root / "keys"
        atomic_write_bytes(keys, (KEY + "\n").encode())
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.root / "server.log"
        command = [
            sys.executable,
            "-m",
            "lorafleet.cli",
            "serve",
            "--base-model",
            self.args.base_model,
            "--data-dir",
            str(data),
            "--api-key-file",
            str(keys),
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--device",
            self.args.device,
            "--max-lora-rank",
            str(self.args.rank),
            *(["--torch-threads", str(self.args.torch_threads)] if self.args.torch_threads else []),
            *SERVER_FLAGS[self.name],
        ]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        assert self.process is not None
        wait_healthy(
            self.url,
            self.process,
            self.args.startup_s,
            what=f"{self.name}: lorafleet serve (log: {self.log_path})",
            details=self.log_tail,
            poll_s=0.5,
        )
        backend = start_backend(
            base_model=self.args.base_model, run_dir=self.root, keys=[KEY], base_url=self.url
        )
        tenant = TenantConfig(
            name="t0",
            task="arithmetic",
            prompts_per_step=self.args.prompts,
            group_size=self.args.group,
            max_tokens=self.args.max_tokens,
            rank=self.args.rank,
            seed=0,
        )
        config = RLConfig(self.args.base_model, self.root, [tenant], progress=False)
        self.runner = TenantRunner(tenant, config, backend, KEY, Progress(False), threading.Event())
        service = backend.client(KEY)
        self.tc = service.create_lora_training_client(
            backend.base_model, rank=self.args.rank, seed=0
        ).result()
        self.tokenizer = load_tokenizer(backend, self.tc)
        self.backend: Backend = backend

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def sync_seconds(self) -> tuple[float, int]:
        response = httpx.get(
            f"{self.url}/api/v1/lorafleet/stats", headers={"X-API-Key": KEY}, timeout=30
        )
        response.raise_for_status()
        sync = response.json().get("sampler_sync")
        if sync is None:
            raise RuntimeError(
                f"{self.name}: the server's stats have no sampler_sync (sync and canary seconds)"
            )
        return float(sync["seconds"]), int(sync["versions"])

    def step(self, number: int, record: bool) -> None:
        before, versions = self.sync_seconds()
        start = time.perf_counter()
        row = self.runner.train_step(self.tc, self.tokenizer, number)
        step_s = time.perf_counter() - start
        after, versions_after = self.sync_seconds()
        if versions_after != versions + 1:
            raise RuntimeError(
                f"{self.name}: a step published {versions_after - versions} versions, not 1"
            )
        sync_s = after - before
        print(
            f"{self.name:<9} step {number}: {step_s:.2f} s (sample {row['sample_s']:.2f}, "
            f"train {row['train_s']:.2f}), sync + canary {sync_s:.3f} s, "
            f"share {sync_s / step_s:.3f}",
            flush=True,
        )
        if record:
            self.rows.append(
                {
                    "step_s": step_s,
                    "sync_s": sync_s,
                    "sync_share": sync_s / step_s,
                    "sample_s": row["sample_s"],
                    "train_s": row["train_s"],
                    "sampled_tokens": row["sampled_tokens"],
                    "trained_rows": row["trained_rows"],
                }
            )

    def close(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()  # the server stops what it spawned (Ray, vLLM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait()


def _median(values: list[float]) -> float:
    return statistics.median(values)


def run_phase(
    names: list[str], root: Path, args: argparse.Namespace, skipped: dict[str, str]
) -> list[Side]:
    """Starts the phase's servers, runs their steps interleaved, stops them; returns the sides
    that ran (a side that cannot start is recorded in `skipped`)."""
    sides: list[Side] = []
    try:
        for name in names:
            side = Side(name, ensure_private_dir(root / name), args)
            print(f"starting {name}: lorafleet serve {' '.join(SERVER_FLAGS[name])}", flush=True)
            sides.append(side)  # closed below even if its start is interrupted
            try:
                side.start()
            except RuntimeError as exc:  # a side that cannot start is reported, not fatal
                print(f"skipping {name}: {exc}", flush=True)
                skipped[name] = str(exc).splitlines()[0]
                sides.remove(side)
                side.close()
        for number in range(args.warmup + args.repeats):
            for side in sides:  # interleaved: every side takes the same step in turn
                try:
                    side.step(number, record=number >= args.warmup)
                except (tinker.TinkerError, RuntimeError, httpx.HTTPError) as exc:
                    # the phase ends here; the steps already timed are reported, with the reason
                    print(
                        f"{side.name}: step {number} failed: {exc}\n{side.log_tail()}", flush=True
                    )
                    skipped[f"{side.name} (phase {names[-1]})"] = f"step {number} failed: {exc}"
                    return [s for s in sides if s.rows]
    finally:
        for side in sides:
            side.close()
    return sides


def _summary(values: list[float]) -> dict[str, float]:
    return {"min_s": min(values), "median_s": _median(values), "runs": len(values)}


def _targets(base_model: str) -> tuple[str, ...]:
    """The attention + MLP linears (as bench.scale), resolved on a weightless copy."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lorafleet.model.loader import resolve_base
    from lorafleet.model.targets import resolve_tinker_targets

    _, model_dir = resolve_base(base_model)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return resolve_tinker_targets(model, train_unembed=False)


def bench_canary(args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """The `--part canary` sides (module docstring); returns timings, ratios, extra."""
    import ray
    import torch

    from lorafleet.canary import layers_are_zero
    from lorafleet.distributed.protocol import RankSettings
    from lorafleet.distributed.ray_samplers import RaySamplerPool, SamplerSettings
    from lorafleet.distributed.ray_trainer import RayRanks
    from lorafleet.distributed.remote import DistTrainEngine
    from lorafleet.model.banks import AdapterSpec
    from lorafleet.sample.canary_probe import generated_prompt_logprobs
    from lorafleet.sample.types import SampleRequest, SamplingParams
    from lorafleet.train.items import TrainItem
    from lorafleet.train.optim import AdamHParams

    torch.set_num_threads(1)
    rank = 16
    targets = _targets(args.base_model)
    env = {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "LORAFLEET_CACHE") if k in os.environ}
    ray.init(
        num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False
    )
    trainer = pool = None
    try:
        trainer = DistTrainEngine(
            RayRanks(
                RankSettings(
                    base_model=args.base_model,
                    targets=targets,
                    num_slots=2,
                    r_max=rank,
                    dtype="float32",
                    torch_threads=1,
                ),
                1,
            )
        )
        pool = RaySamplerPool(
            SamplerSettings(
                base_model=args.base_model,
                targets=targets,
                slots=8,
                r_max=rank,
                dtype="float32",
                torch_threads=1,
            ),
            2,
            trainer=trainer,
            verify=False,  # each side runs its canary itself
        )
        slot = trainer.create_adapter(AdapterSpec(rank=rank, alpha=32, seed=1))
        tokens_in = torch.randint(0, pool.limits.vocab_size, (64,))
        trainer.forward_backward(
            [
                TrainItem(
                    slot,
                    tokens_in,
                    "cross_entropy",
                    {"target_tokens": torch.roll(tokens_in, -1), "weights": torch.ones(64)},
                )
            ]
        )
        trainer.optim_step({slot: AdamHParams(learning_rate=1e-3)})  # a non-zero adapter
        store = pool.versions
        tokens = store.canary_prompt()
        params = SamplingParams(max_tokens=1, temperature=0.0, stop=[])

        def fresh() -> tuple[str, int]:
            key = store.publish("bench", trainer.bank, slot)
            if key[1] > 0:
                store.drop((key[0], key[1] - 1))
            return key

        def on_replica(index: int, key: tuple[str, int] | None) -> torch.Tensor:
            request = SampleRequest(list(tokens), params, adapter=key, prompt_logprobs=True)
            (result,) = pool.generate_on(index, [request])
            assert result.prompt_logprobs is not None, result.error
            return torch.tensor(result.prompt_logprobs[1:])

        def trainer_side() -> None:
            trainer.canary_logprobs(slot, tokens)
            layers_are_zero(trainer.bank.slot_weights(slot).values())

        def serial() -> None:
            key = fresh()
            trainer_side()
            for index in range(2):
                on_replica(index, key)
                on_replica(index, None)
            trainer_side()  # the publisher's own canary, through one replica
            generated_prompt_logprobs(pool, key, tokens)
            generated_prompt_logprobs(pool, None, tokens)

        def parallel() -> None:
            store.verify_everywhere(fresh(), slot)

        times: dict[str, list[float]] = {"canary_serial": [], "canary_parallel": []}
        for number in range(args.warmup + args.repeats):
            for name, side in (("canary_serial", serial), ("canary_parallel", parallel)):
                start = time.perf_counter()
                side()
                elapsed = time.perf_counter() - start
                print(f"round {number}: {name} {elapsed:.3f} s", flush=True)
                if number >= args.warmup:
                    times[name].append(elapsed)
    finally:
        if pool is not None:
            pool.close()
        if trainer is not None:
            trainer.close()
        ray.shutdown()
    timings = {name: _summary(values) for name, values in times.items()}
    ratios = {
        "canary_serial_over_parallel": (
            timings["canary_serial"]["median_s"] / timings["canary_parallel"]["median_s"],
            "informational (> 1: the parallel canary is cheaper)",
        )
    }
    extra = {
        "model": args.base_model,
        "canary": {"replicas": 2, "trainer_ranks": 1, "rank": rank, "tokens": len(tokens)},
    }
    return timings, ratios, extra


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument(
        "--part", choices=("steps", "canary"), default="steps", help="see the module docstring"
    )
    parser.add_argument("--repeats", type=int, default=4, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    parser.add_argument(
        "--sides",
        default=",".join(SIDES[1:]),
        help=f"comma-separated, of {', '.join(SIDES[1:])}: each runs in its own phase beside a "
        "fresh embedded server (default: all that can run here)",
    )
    parser.add_argument(
        "--beside-embedded",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run an embedded server in every phase, for the step ratio (--no-beside-embedded: "
        "the engine alone, where memory is short; its sync_share needs no other side)",
    )
    parser.add_argument("--base-model", default="smollm2-135m", help="preset or HF dir")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per rollout (max)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--torch-threads", type=int, default=None, help="server torch threads")
    parser.add_argument(
        "--startup-s", type=float, default=900.0, help="how long a server may take to start"
    )
    add_device_option(
        parser
    )  # our servers' (the trainer and embedded sampler); vLLM: its CPU build
    args = parser.parse_args()
    args.device = bench_device(args.device).device
    wanted = [s.strip() for s in args.sides.split(",") if s.strip()]
    bad = [s for s in wanted if s not in SIDES[1:]]
    if bad or not wanted:
        raise SystemExit(f"--sides: {bad or wanted!r} is not a subset of {', '.join(SIDES[1:])}")
    dtype = fixed_dtype("float32", "fixed: the canary is exact only in fp32 (vLLM included)")
    if args.part == "canary":
        timings, ratios, extra = bench_canary(args)
        report(
            "the Ray replicas' canary per version: parallel, reference once vs serial",
            timings,
            ratios,
            args.json,
            extra,
            dtype=dtype,
        )
        return
    serve_help = _serve_help()
    skipped: dict[str, str] = {}
    # One phase per engine, each beside its own embedded server: the engines' processes (Ray
    # actors, vLLM servers) need memory, and no two phases hold theirs at once.
    phases: dict[str, list[Side]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        for name in wanted:
            reason = unavailable(name, serve_help)
            if reason is not None:
                print(f"skipping {name}: {reason}", flush=True)
                skipped[name] = reason
                continue
            names = ["embedded", name] if args.beside_embedded else [name]
            ran = run_phase(names, ensure_private_dir(Path(tmp) / name), args, skipped)
            if any(side.name == name for side in ran):
                phases[name] = ran
    if not phases:
        raise SystemExit(f"no engine side could run: {skipped}")
    timings: dict[str, dict[str, float]] = {}
    ratios: dict[str, tuple[float, str]] = {}
    per_side: dict[str, dict[str, float]] = {}
    for phase, sides in phases.items():
        by_name = {side.name: side for side in sides}
        for side in sides:
            label = side.name if side.name == phase else f"{side.name}@{phase}"
            rows = side.rows
            if not rows:
                continue
            timings[f"{label}_step"] = _summary([r["step_s"] for r in rows])
            timings[f"{label}_sync_canary"] = _summary([r["sync_s"] for r in rows])
            ratios[f"sync_share_{label}"] = (_median([r["sync_share"] for r in rows]), "<= 0.10")
            per_side[label] = {
                "sample_s_median": _median([r["sample_s"] for r in rows]),
                "train_s_median": _median([r["train_s"] for r in rows]),
                "sampled_tokens_median": _median([r["sampled_tokens"] for r in rows]),
                "sync_share_max": max(r["sync_share"] for r in rows),
            }
        if phase.startswith("vllm") and by_name.get("embedded") and by_name[phase].rows:
            ratios[f"{phase}_step_over_embedded"] = (
                timings[f"{phase}_step"]["median_s"]
                / timings[f"embedded@{phase}_step"]["median_s"],
                "informational (CPU)",
            )
    report(
        "rollout engines: one tenant's GRPO step, and sync + canary per step",
        timings,
        ratios,
        args.json,
        {
            "model": args.base_model,
            "step": {
                "prompts": args.prompts,
                "group": args.group,
                "max_tokens": args.max_tokens,
                "rank": args.rank,
                "loss": "importance_sampling",
            },
            "server_flags": {name: SERVER_FLAGS[name] for name in SIDES},
            "sides": per_side,
            "rows": {
                (s.name if s.name == phase else f"{s.name}@{phase}"): s.rows
                for phase, sides in phases.items()
                for s in sides
            },
            "skipped": skipped,
        },
        dtype=dtype,
    )


if __name__ == "__main__":
    main()
