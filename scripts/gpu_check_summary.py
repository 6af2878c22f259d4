"""The summary of scripts/gpu_check.sh: each step's exit status and time, and the issue's
figures read from the steps' JSON against their targets, written to gpu_check.json beside
them and printed as a table. Exits 1 if a step failed (a figure below its target is reported,
not a failure: the script checks that everything runs and measures; the targets are goals).

    python scripts/gpu_check_summary.py --results DIR --smoke 0 --steps test_cuda=0:41 gpu=0:130 rl=0:95
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# (step JSON, key, target, what it is): the figures issue 33 asks for, on one H200
FIGURES = (
    ("gpu", "train_mfu", 0.35, "train MFU, qwen3-1.7b-shape, 8 adapters"),
    ("gpu", "sample_mixed_over_base", 0.85, "sampling 8 mixed adapters / base"),
    ("gpu", "graphs_over_eager_8_rows", 1.5, "graph decode / eager at 8 rows"),
    ("rl", "tenants4_throughput_over_1", 2.0, "4 tenants' RL throughput / 1 (HTTP server)"),
    ("gpu", "tenants4_engine_throughput_over_1", None, "the same through the engines (reference)"),
    ("gpu", "graphs_over_eager", None, "graph decode / eager at 128 rows (reference)"),
)


def _steps(values: list[str]) -> dict[str, dict[str, int]]:
    steps = {}
    for value in values:
        name, _, rest = value.partition("=")
        status, _, seconds = rest.partition(":")
        if not name or not status.lstrip("-").isdigit() or not seconds.isdigit():
            raise SystemExit(f"--steps: expected NAME=STATUS:SECONDS, got {value!r}")
        steps[name] = {"exit": int(status), "seconds": int(seconds)}
    return steps


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--smoke", type=int, choices=(0, 1), required=True)
    parser.add_argument("--steps", nargs="+", required=True)
    args = parser.parse_args(argv)
    steps = _steps(args.steps)
    results = {name: _read(args.results / f"{name}.json") for name in ("gpu", "rl")}
    figures = []
    for step, key, target, what in FIGURES:
        data = results.get(step)
        value = None if data is None else data.get(key)
        figures.append(
            {
                "figure": key,
                "what": what,
                "value": value,
                "target": target,
                "meets_target": None
                if value is None or target is None or args.smoke
                else bool(value >= target),
            }
        )
    gpu = results["gpu"] or {}
    environment = gpu.get("environment") or (results["rl"] or {}).get("environment")
    summary = {
        "smoke": bool(args.smoke),
        "note": "toy sizes on the CPU: checks that every step runs, measures nothing"
        if args.smoke
        else "one CUDA device; figures against issue 33's targets",
        "steps": steps,
        "figures": figures,
        "lora_kernel": gpu.get("lora_kernel"),
        "cuda_graphs": gpu.get("cuda_graphs"),
        "environment": environment,
    }
    out = args.results / "gpu_check.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{'step':<12}{'exit':>6}{'seconds':>9}")
    for name, step in steps.items():
        print(f"{name:<12}{step['exit']:>6}{step['seconds']:>9}")
    print(f"\n{'figure':<36}{'value':>10}  target")
    for figure in figures:
        value = "-" if figure["value"] is None else f"{figure['value']:.3f}"
        target = "reference" if figure["target"] is None else f">= {figure['target']}"
        print(f"{figure['figure']:<36}{value:>10}  {target}")
    print(f"\nwrote {out}")
    failed = [name for name, step in steps.items() if step["exit"] != 0]
    if failed:
        print(f"gpu_check: failed steps: {', '.join(failed)} (their logs are beside {out})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
