"""LoRA against full fine-tuning (issue 36 item 4): the parity run at several LoRA ranks
(lorafleet) and with every weight trained (TRL `GRPOTrainer` without PEFT), each with its own
learning-rate sweep; the best learning rate of each configuration on one plot.

Everything but the trained weights and the learning rate is bench/parity.py's recipe: the same
task, per-step prompts, sampling, group-centred advantages, the same loss up to a constant
(our summed importance_sampling, TRL's dr_grpo: bench/parity.py says why) and Adam settings.
Ours: LoRA rank 1, 8 and 32 on attention + MLP (alpha fixed at 32 as in Tinker, so the LoRA
scale alpha/r goes 32, 4, 1), through the Tinker SDK. TRL's: full fine-tuning of the same base,
with fp32 master weights (and bf16 autocast where the run's base dtype is bf16: Adam's updates
at full fine-tuning's learning rates are below bf16's resolution of a weight).

The sweeps. LoRA: 2e-4, 5e-4, 1e-3, around the README job's 5e-4 (its arithmetic tenant's;
its chain_sum tenant's 1e-3 is the top); with alpha fixed and the 1/r scale, Adam's best LoRA
learning rate barely moves with the rank (Thinking Machines, "LoRA Without Regret", 2025), so
one sweep serves every rank. Full fine-tuning: 5e-6, 2e-5, 5e-5, i.e. 10x to 100x below the
LoRA sweep's centre: the same study puts full fine-tuning's best learning rate about 10x below
LoRA's, and RL recipes for small models use 1e-6 to 1e-5. A configuration's best learning rate
is the one with the highest final-10-step mean reward (mean over seeds); one at an end of its
sweep is flagged (`at_sweep_edge`), since the sweep should then be extended (`--lora-lrs`,
`--full-lrs`) before its curve is read as that configuration's best.

Runs of ours and TRL's are stepped in pairs (bench/reward_runs.py), one TRL process at a time.
Output: the sweep table, the JSON (default bench/results/lora_vs_full.json: every run's
per-step rows, the sweep, the best learning rates, the machine) and the PNG of the best-LR
curves (default docs/images/lora_vs_full.png).

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.lora_vs_full --setup-trl
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.lora_vs_full --model tiny-qwen3 --steps 2 \\
        --json /tmp/lvf.json --png /tmp/lvf.png        # smoke run
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from bench.common import report
from bench.reward_bench import (
    Machinery,
    add_recipe_args,
    fmt,
    machinery,
    print_text_table,
    recipe_from,
    step_time,
)
from bench.reward_plot import plot_reward_curves
from bench.reward_runs import TRL_LOSS, OurRun, Recipe, Run, TrlRun, format_row, run_pair
from bench.reward_stats import best_learning_rate, side_summary

FULL = "full FT (TRL)"


@dataclass(frozen=True)
class Config:
    """One configuration of the sweep: a LoRA rank of ours, or TRL's full fine-tuning (rank
    None)."""

    rank: int | None

    @property
    def label(self) -> str:
        return FULL if self.rank is None else f"LoRA r{self.rank} (lorafleet)"


# rows[config][learning rate][seed]: one run's per-step rows
Rows = dict[Config, dict[float, dict[int, list[dict[str, Any]]]]]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_recipe_args(parser, steps=30, seeds=(0,))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--lora-lrs", type=float, nargs="+", default=[2e-4, 5e-4, 1e-3])
    parser.add_argument("--full-lrs", type=float, nargs="+", default=[5e-6, 2e-5, 5e-5])
    parser.add_argument("--json", type=Path, default=Path("bench/results/lora_vs_full.json"))
    parser.add_argument("--png", type=Path, default=Path("docs/images/lora_vs_full.png"))
    args = parser.parse_args()
    for name in ("ranks", "lora_lrs", "full_lrs"):
        values = getattr(args, name)
        if len(set(values)) != len(values) or min(values) <= 0:
            parser.error(
                f"--{name.replace('_', '-')} must be distinct positive values, got {values}"
            )
    return args


def sweep(m: Machinery, args: argparse.Namespace, recipe: Recipe) -> tuple[Rows, dict[str, Any]]:
    """Every configuration at every learning rate and seed: rows[config][lr][seed], and what
    the last TRL process said it trains (dtypes, autocast)."""
    ours = [(Config(r), lr) for r in args.ranks for lr in args.lora_lrs]
    full = [(Config(None), lr) for lr in args.full_lrs]
    rows: Rows = {}
    trl_info: dict[str, Any] = {}
    key = iter(m.keys)

    def make(config: Config, lr: float, seed: int) -> Run:
        seeded = recipe.with_(seed=seed, learning_rate=lr)
        label = f"{config.label} lr {lr:g} seed {seed}"
        if config.rank is not None:
            return OurRun(
                m.backend,
                next(key),
                seeded,
                rank=config.rank,
                steps=args.steps,
                run_dir=m.run_dir,
                label=label,
            )
        run = TrlRun(
            m.trl_python,
            recipe=seeded,
            steps=args.steps,
            model_dir=m.model_dir,
            dtype=m.dtype.dtype,
            tokenizer=m.tokenizer,
            lora=None,
            torch_threads=args.torch_threads,
            workdir=m.run_dir,
            label=label,
        )
        trl_info.update(run.side.info)
        return run

    def log(run: Run, row: dict[str, Any]) -> None:
        print(format_row(run, row), flush=True)

    for seed in args.seeds:
        # ours[j] steps in alternation with full[j] (one TRL process at a time); the rest alone
        for j in range(max(len(ours), len(full))):
            a = ours[j] if j < len(ours) else full[j]
            b = full[j] if j < len(ours) and j < len(full) else None
            first_rows, second_rows = run_pair(
                partial(make, *a, seed),
                None if b is None else partial(make, *b, seed),
                args.steps,
                log,
            )
            done = [(a, first_rows)] + (
                [] if b is None or second_rows is None else [(b, second_rows)]
            )
            for (config, lr), out in done:
                rows.setdefault(config, {}).setdefault(lr, {})[seed] = out
    return rows, trl_info


def main() -> None:
    args = parse_args()
    recipe = recipe_from(args)
    runs = len(args.ranks) * len(args.lora_lrs) * len(args.seeds)
    with machinery(args, runs=runs, max_rank=max(args.ranks)) as m:
        rows, trl_info = sweep(m, args, recipe)
    table, best, curves, results = [], {}, {}, {}
    # LoRA ranks in order, then full fine-tuning
    for config, per_lr in sorted(
        rows.items(), key=lambda kv: (kv[0].rank is None, kv[0].rank or 0)
    ):
        summaries = {lr: side_summary(per_seed) for lr, per_seed in per_lr.items()}
        finals = {lr: s["final"] for lr, s in summaries.items()}
        lr_best = best_learning_rate(finals)
        edge = len(finals) > 1 and lr_best in (min(finals), max(finals))
        best[config.label] = {
            "learning_rate": lr_best,
            "final": finals[lr_best],
            "at_sweep_edge": edge,
        }
        curves[f"{config.label}, lr {lr_best:g}"] = summaries[lr_best]
        results[config.label] = {
            "rank": config.rank,
            "system": "trl" if config.rank is None else "lorafleet",
            "by_learning_rate": {str(lr): s for lr, s in summaries.items()},
        }
        for lr, s in sorted(summaries.items()):
            f = s["final"]
            mark = ("best, at sweep edge" if edge else "best") if lr == lr_best else ""
            table.append(
                [config.label, f"{lr:g}", fmt(f["mean"]), fmt(f["min"]), fmt(f["max"]), mark]
            )
    final_steps = min(10, args.steps)
    print_text_table(
        f"sweep: final reward = mean of the last {final_steps} steps ({len(args.seeds)} seed(s))",
        ["configuration", "lr", "final mean", "min", "max", ""],
        table,
    )
    title = (
        f"{args.model}, {recipe.task}, {recipe.prompts_per_step}x{recipe.group_size} rollouts, "
        f"best learning rate per configuration, {len(args.seeds)} seed(s)"
    )
    args.png.parent.mkdir(parents=True, exist_ok=True)
    band = "band: min-max over seeds" if len(args.seeds) > 1 else "one seed"
    png = plot_reward_curves(args.png, curves, title, band)
    timings = {
        config.label: step_time(
            [r for per_seed in per_lr.values() for rs in per_seed.values() for r in rs]
        )
        for config, per_lr in rows.items()
    }
    report(
        f"LoRA vs full fine-tuning, {title}",
        timings,
        {},
        args.json,
        extra={
            "bench": "lora_vs_full",
            "command": sys.argv,
            "best": best,
            "prompts_match_every_step": all(
                r["prompts_match"]
                for per_lr in rows.values()
                for per_seed in per_lr.values()
                for rs in per_seed.values()
                for r in rs
            ),
            "recipe": {
                "model": args.model,
                "task": recipe.task,
                "prompts_per_step": recipe.prompts_per_step,
                "group_size": recipe.group_size,
                "max_tokens": recipe.max_tokens,
                "temperature": recipe.temperature,
                "steps": args.steps,
                "seeds": args.seeds,
                "ranks": args.ranks,
                "lora_lrs": args.lora_lrs,
                "full_lrs": args.full_lrs,
                "adam": {"beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0},
            },
            "loss": {
                "lorafleet": "importance_sampling (summed over tokens)",
                "trl": f"{TRL_LOSS}, beta=0, scale_rewards=none, num_iterations=1",
            },
            "png": str(png),
            "trl_info": trl_info,
            "configurations": results,
        },
        dtype=m.dtype,
    )
    for label, b in best.items():
        note = " (at the sweep's edge: extend the sweep)" if b["at_sweep_edge"] else ""
        print(f"best {label}: lr {b['learning_rate']:g}, final {b['final']['mean']:.3f}{note}")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
