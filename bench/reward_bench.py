"""What bench/parity.py and bench/lora_vs_full.py share: their common flags, the TRL venv, the
embedded server that holds our runs, and their per-step and summary tables."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

from bench import trl_side
from bench.common import (
    add_dtype_option,
    add_numerics_option,
    bench_device,
    bench_dtype,
    bench_numerics,
)
from bench.reward_runs import Recipe
from lorafleet.hardware import DtypeChoice
from lorafleet.rl.connect import Backend, start_backend


def add_recipe_args(parser: argparse.ArgumentParser, *, steps: int, seeds: Sequence[int]) -> None:
    """The recipe both systems run (defaults: the README job's arithmetic tenant) and the
    machinery flags."""
    recipe = Recipe()
    parser.add_argument(
        "--model",
        "--base-model",
        default="smollm2-135m",
        help="preset or HF dir (tiny-qwen3 for a smoke run)",
    )
    parser.add_argument("--task", default=recipe.task)
    parser.add_argument(
        "--prompts", type=int, default=recipe.prompts_per_step, help="prompts per step"
    )
    parser.add_argument("--group", type=int, default=recipe.group_size, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=recipe.max_tokens)
    parser.add_argument("--temperature", type=float, default=recipe.temperature)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(seeds))
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="on both sides (default: torch's)"
    )
    add_dtype_option(parser)
    add_numerics_option(parser)  # the embedded server's
    parser.add_argument("--trl-venv", type=Path, default=trl_side.DEFAULT_TRL_VENV)
    parser.add_argument(
        "--setup-trl", action="store_true", help="create --trl-venv first (scripts/setup_trl.sh)"
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="keep the server data and TRL logs here (default: a temp dir)",
    )


def recipe_from(args: argparse.Namespace) -> Recipe:
    for name in ("prompts", "group", "max_tokens", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.group < 2:
        raise SystemExit(
            f"--group must be >= 2 (advantages are centred per group), got {args.group}"
        )
    if len(set(args.seeds)) != len(args.seeds):
        raise SystemExit(f"--seeds must be distinct, got {args.seeds}")
    return Recipe(
        task=args.task,
        prompts_per_step=args.prompts,
        group_size=args.group,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
    )


@dataclass
class Machinery:
    backend: Backend
    dtype: DtypeChoice
    trl_python: Path
    run_dir: Path
    keys: list[str]
    tokenizer: Any

    @property
    def model_dir(self) -> Path:
        assert self.backend.tokenizer_dir is not None  # embedded: the preset's local dir
        return self.backend.tokenizer_dir


@contextmanager
def machinery(args: argparse.Namespace, *, runs: int, max_rank: int) -> Iterator[Machinery]:
    """The resolved dtype (one concrete dtype for both sides), the TRL venv (refused, naming
    the flag, when missing), and one embedded server on the CPU with a key per run of ours;
    runs take turns, so two adapter slots are enough (the server pages the others out)."""
    bench_device("cpu")  # TRL's side runs on the CPU; ours with it
    choice = bench_dtype(args.dtype)
    numerics = bench_numerics(args.numerics)
    if args.setup_trl:
        trl_side.setup_trl(args.trl_venv)
    python = trl_side.trl_python(args.trl_venv)
    if not python.exists():
        raise SystemExit(f"--trl-venv {args.trl_venv}: no TRL venv there (pass --setup-trl)")
    with tempfile.TemporaryDirectory(prefix="lorafleet-reward-bench-") as tmp:
        run_dir = args.run_dir if args.run_dir is not None else Path(tmp)
        run_dir.mkdir(parents=True, exist_ok=True)
        keys = [f"tml-bench-reward-{i:03d}-0123456789abcdef" for i in range(runs)]
        backend = start_backend(
            base_model=args.model,
            run_dir=run_dir,
            keys=keys,
            base_url=None,
            dtype=choice.dtype,
            max_adapters=2,
            max_rank=max_rank,
            max_sample_rows=max(16, min(256, args.prompts * args.group)),
            torch_threads=args.torch_threads,
            device="cpu",
            numerics=numerics,
        )
        try:
            from transformers import AutoTokenizer

            assert backend.tokenizer_dir is not None
            tokenizer = AutoTokenizer.from_pretrained(str(backend.tokenizer_dir))
            yield Machinery(backend, choice, python, run_dir, keys, tokenizer)
        finally:
            backend.close()


def step_time(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """min/median seconds per step over all seeds' rows (bench/common.report's timing shape)."""
    times = sorted(float(r["step_s"]) for r in rows if r.get("step_s") is not None)
    if not times:
        return {"min_s": float("nan"), "median_s": float("nan"), "runs": 0}
    return {"min_s": times[0], "median_s": statistics.median(times), "runs": len(times)}


def fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_text_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Plain text, columns as wide as their widest cell: readable in a log at any width."""
    cells = [list(map(str, columns))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    print(f"\n{title}")
    for n, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def print_final_table(title: str, sides: Mapping[str, Mapping[str, Any]]) -> None:
    print_text_table(
        title,
        ["side", "seeds", "final mean", "min", "max", "std"],
        [
            [
                name,
                ",".join(map(str, side["seeds"])),
                fmt(side["final"]["mean"]),
                fmt(side["final"]["min"]),
                fmt(side["final"]["max"]),
                fmt(side["final"]["std"]),
            ]
            for name, side in sides.items()
        ],
    )
