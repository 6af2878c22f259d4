"""Does the README job learn, for every tenant, whatever the seed? (issue 36, docs/learning.md)

Runs README command 1 (`README_JOB`, the same arguments; a test keeps the two equal) once per
seed, each as its own `lorafleet rl` process so the CPU class and dtype follow the environment
(`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2` gives the AVX2
run on an AVX-512 machine), then prints per seed and tenant: the first step's mean reward, the
mean of the last 3 steps, the gain, and the held-out greedy accuracy before the first update
and after the last. A tenant passes when its gain is at least `--min-gain` (0.10, absolute).

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.learning --seeds 0,1,2 --json runs/learning.json

One README job takes about 2-5 minutes on 2 cores; the seeds run one after another.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import environment
from lorafleet.fsio import atomic_write_json
from lorafleet.rl.report import print_table, read_metrics

# README command 1, after `lorafleet rl` (the run dir is the bench's own, per seed).
README_JOB = (
    "--tenants",
    "2",
    "--tasks",
    "arithmetic,rg:chain_sum:max_terms=2:max_digits=1",
    "--lr",
    "5e-4,1e-3",
    "--steps",
    "10",
)


def run_seed(seed: int, run_dir: Path, extra: list[str]) -> float:
    """One README job; returns its wall time. Its output goes to `run_dir`/rl.log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "lorafleet.cli", "rl", *README_JOB]
    command += ["--seed", str(seed), "--run-dir", str(run_dir / "rl"), "--no-progress", *extra]
    started = time.perf_counter()
    with (run_dir / "rl.log").open("w") as log:
        rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        raise SystemExit(f"seed {seed}: lorafleet rl exited {rc}; see {run_dir / 'rl.log'}")
    return time.perf_counter() - started


def tenant_rows(seed: int, rl_dir: Path, min_gain: float) -> list[dict[str, Any]]:
    out = []
    for metrics in sorted(rl_dir.glob("t*/metrics.jsonl")):
        rows = read_metrics(metrics)
        rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
        evals = [r for r in rows if "eval_accuracy" in r]
        last3 = statistics.fmean(rewards[-3:])
        out.append(
            {
                "seed": seed,
                "tenant": metrics.parent.name,
                "steps": len(rewards),
                "reward_first": rewards[0],
                "reward_last3": last3,
                "gain": last3 - rewards[0],
                "passed": last3 - rewards[0] >= min_gain,
                "eval_first": evals[0]["eval_accuracy"] if evals else None,
                "eval_last": evals[-1]["eval_accuracy"] if evals else None,
                "eval_reward_first": evals[0]["eval_reward"] if evals else None,
                "eval_reward_last": evals[-1]["eval_reward"] if evals else None,
                "rewards": rewards,
            }
        )
    return out


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma list of --seed values")
    parser.add_argument("--min-gain", type=float, default=0.10)
    parser.add_argument("--run-root", type=Path, default=Path("runs/learning"))
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--wait-load",
        type=float,
        default=None,
        help="on a shared machine: before each seed, wait until the 1-minute load is below this",
    )
    parser.add_argument(
        "rl_args",
        nargs="*",
        help="more `lorafleet rl` arguments, after --, e.g. -- --dtype float32",
    )
    args = parser.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: comma-separated integers")
    if not seeds:
        parser.error("--seeds is empty")
    results: list[dict[str, Any]] = []
    walls = {}
    config: dict[str, Any] = {}
    for seed in seeds:
        run_dir = args.run_root / f"seed-{seed}"
        while args.wait_load is not None and os.getloadavg()[0] >= args.wait_load:
            time.sleep(10)
        print(f"seed {seed}: start, load {os.getloadavg()[0]:.1f}", flush=True)
        walls[seed] = run_seed(seed, run_dir, args.rl_args)
        config = json.loads((run_dir / "rl" / "config.json").read_text())
        results += tenant_rows(seed, run_dir / "rl", args.min_gain)
        print(f"seed {seed}: {walls[seed]:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)
    print_table(
        f"README job, {len(seeds)} seeds, dtype {config.get('dtype')} "
        f"(pass: last-3 mean >= first + {args.min_gain})",
        ["seed", "tenant", "first", "last-3 mean", "gain", "pass", "eval first", "eval last"],
        [
            [
                r["seed"],
                r["tenant"],
                _fmt(r["reward_first"]),
                _fmt(r["reward_last3"]),
                f"{r['gain']:+.3f}",
                "yes" if r["passed"] else "NO",
                _fmt(r["eval_first"]),
                _fmt(r["eval_last"]),
            ]
            for r in results
        ],
    )
    if args.json is not None:
        atomic_write_json(
            args.json,
            {
                "bench": "learning",
                "command": ["lorafleet", "rl", *README_JOB, *args.rl_args],
                "seeds": seeds,
                "min_gain": args.min_gain,
                "all_passed": all(r["passed"] for r in results),
                "wall_s": walls,
                "dtype": config.get("dtype"),
                "dtype_choice": config.get("dtype_choice"),
                "eval": {"every": config.get("eval_every"), "prompts": config.get("eval_prompts")},
                "cpu_env": {
                    k: os.environ.get(k)
                    for k in (
                        "ATEN_CPU_CAPABILITY",
                        "ONEDNN_MAX_CPU_ISA",
                        "MKL_ENABLE_INSTRUCTIONS",
                    )
                },
                "environment": environment(),
                "tenants": results,
            },
        )
        print(f"results: {args.json}")


if __name__ == "__main__":
    main()
