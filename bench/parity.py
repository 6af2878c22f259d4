"""Reward parity (issue 36 item 3): the same GRPO run through lorafleet and through TRL.

Our side: one tenant of an embedded lorafleet server, trained through the Tinker SDK by
`lorafleet rl`'s own step (bench/reward_runs.py). TRL's side: `GRPOTrainer` + a PEFT LoRA in
its own venv (bench/trl_grpo.py). Same on both: the base model and its dtype, the task, each
step's prompts (our generator with our per-step seed, rendered with our chat template and
system turn; TRL checks the token ids and reports the questions each step drew), prompts per
step, group size, max new tokens, temperature, LoRA rank / alpha / target layers (read back from
our adapter's PEFT config: attention + MLP, no unembedding, which TRL cannot train through a
LoRA), learning rate, Adam (betas 0.9 / 0.95, eps 1e-12, no weight decay, no clipping, constant
LR). Seeds pair up: seed s is our adapter seed, problem seed and sampling seed, and TRL's
`seed`; the two sides' LoRA inits and sampling draws still differ (each system's own RNG), so
curves agree only in distribution: hence seeds, and the spread.

The loss. Ours is `lorafleet rl`'s on-policy default, Tinker's `importance_sampling`:
-sum over sampled tokens of ratio * advantage, ratio = exp(trainer logp - sampler logp),
advantage = reward minus its group's mean (no std scaling), summed over tokens and rows,
never averaged. TRL's closest is `loss_type="dr_grpo"` with `scale_rewards="none"`, `beta=0`,
`num_iterations=1`: the same token-level sum, divided by a constant (rows x
max_completion_length). Adam is invariant to a constant positive scale of the loss (up to its
eps, 1e-12 here), so the two give the same updates from the same gradients. TRL's default
`dapo` divides by the step's own token count, a scale that changes from step to step and so
reweights steps inside Adam's moments; `grpo` averages per sequence first, which weights a
short completion's tokens more. With one optimizer step per generation TRL's ratio is exactly
1 (old log-probs are the current ones, detached), so its PPO clip never acts; ours is the
sampler's logp against the trainer's, ~1 with batch-invariant numerics (logged per step as
`log_ratio_*`). Zero-advantage rows: TRL keeps them (zero gradient, and dr_grpo's constant
divisor ignores them), we drop them: the same gradient. One difference we keep: when every
group of a step agrees, `lorafleet rl` sends no forward_backward and no optim_step, while TRL
still steps Adam on a zero gradient (momentum moves the weights); such steps are logged
(`optimizer_stepped` false on our side).

Output: a per-step table, the final-reward table, the JSON (default
bench/results/parity.json: per-step per-seed rows of both sides, seed-mean curves, `reward_mae`
= mean |difference| of the two seed-mean curves after a rolling mean of 5 steps, each side's
final-10-step mean with its seed spread, `spreads_overlap`, the machine) and the PNG (default
docs/images/parity.png; bands: min-max over seeds). Pass: reward_mae <= 0.05 and overlapping
spreads.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.parity --setup-trl
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.parity --model tiny-qwen3 --steps 2 --seeds 0 \\
        --json /tmp/parity.json --png /tmp/parity.png        # smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bench.common import report
from bench.reward_bench import (
    add_recipe_args,
    fmt,
    machinery,
    print_final_table,
    recipe_from,
    step_time,
)
from bench.reward_plot import plot_reward_curves
from bench.reward_runs import TRL_LOSS, OurRun, TrlRun, format_row, run_pair
from bench.reward_stats import MAE_WINDOW, reward_mae, side_summary, spreads_overlap

OURS, TRL = "lorafleet", "trl"
MAE_TARGET = 0.05


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_recipe_args(parser, steps=30, seeds=(0, 1, 2))
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4, help="learning rate (both sides)")
    parser.add_argument("--json", type=Path, default=Path("bench/results/parity.json"))
    parser.add_argument("--png", type=Path, default=Path("docs/images/parity.png"))
    return parser.parse_args()


def per_step_table(ours: dict[str, Any], trl: dict[str, Any]) -> None:
    """Plain text, one line per step: wide enough for a log, whatever the terminal."""
    o, t = ours["per_step_means"], trl["per_step_means"]
    heads = ("reward", "|adv|", "nonzero", "len")
    print("\nper step, mean over seeds (ours / TRL); log-ratio: ours, clip: TRL")
    print(
        f"{'step':>4}  " + "  ".join(f"{h:>13}" for h in heads) + f"  {'log-ratio':>9}  {'clip':>5}"
    )
    for i, (ro, rt) in enumerate(zip(ours["reward_mean"], trl["reward_mean"], strict=True)):
        pairs = [
            (ro, rt, ".3f"),
            (o["adv_abs_mean"][i], t["adv_abs_mean"][i], ".3f"),
            (o["nonzero_adv_frac"][i], t["nonzero_adv_frac"][i], ".2f"),
            (o["sampled_len_mean"][i], t["sampled_len_mean"][i], ".1f"),
        ]
        cells = "  ".join(f"{fmt(a, spec):>6} /{fmt(b, spec):>6}" for a, b, spec in pairs)
        ratio = o.get("log_ratio_mean", [None] * (i + 1))[i]
        clip = t.get("clip_frac", [None] * (i + 1))[i]
        print(f"{i:>4}  {cells}  {fmt(ratio, '+.4f'):>9}  {fmt(clip, '.3f'):>5}")


def main() -> None:
    args = parse_args()
    recipe = recipe_from(args).with_(learning_rate=args.lr)
    rows: dict[str, dict[int, list[dict[str, Any]]]] = {OURS: {}, TRL: {}}
    info: dict[str, Any] = {}

    def log(run: Any, row: dict[str, Any]) -> None:
        print(format_row(run, row), flush=True)

    with machinery(args, runs=len(args.seeds), max_rank=args.rank) as m:
        for i, seed in enumerate(args.seeds):
            seeded = recipe.with_(seed=seed)
            ours: dict[str, OurRun] = {}

            def make_ours(
                i: int = i, seed: int = seed, seeded: Any = seeded, ours: Any = ours
            ) -> OurRun:
                ours["run"] = OurRun(
                    m.backend,
                    m.keys[i],
                    seeded,
                    rank=args.rank,
                    steps=args.steps,
                    run_dir=m.run_dir,
                    label=f"lorafleet seed {seed}",
                )
                return ours["run"]

            def make_trl(seed: int = seed, seeded: Any = seeded, ours: Any = ours) -> TrlRun:
                run = TrlRun(
                    m.trl_python,
                    recipe=seeded,
                    steps=args.steps,
                    model_dir=m.model_dir,
                    dtype=m.dtype.dtype,
                    tokenizer=m.tokenizer,
                    lora=ours["run"].lora,
                    torch_threads=args.torch_threads,
                    workdir=m.run_dir,
                    label=f"TRL seed {seed}",
                )
                info["trl"] = {k: v for k, v in run.side.info.items() if k != "lora_modules"}
                info["lora"] = ours["run"].lora
                return run

            ours_rows, trl_rows = run_pair(make_ours, make_trl, args.steps, log)
            assert trl_rows is not None
            rows[OURS][seed], rows[TRL][seed] = ours_rows, trl_rows

    sides = {name: side_summary(per_seed) for name, per_seed in rows.items()}
    mae = reward_mae(sides[OURS]["reward_mean"], sides[TRL]["reward_mean"], MAE_WINDOW)
    overlap = spreads_overlap(sides[OURS]["final"], sides[TRL]["final"])
    prompts_ok = all(
        r["prompts_match"] for side in rows.values() for per_seed in side.values() for r in per_seed
    )
    skipped = sum(not r["optimizer_stepped"] for per_seed in rows[OURS].values() for r in per_seed)
    per_step_table(sides[OURS], sides[TRL])
    print_final_table(
        f"final reward: mean of the last {sides[OURS]['final']['steps']} steps, per seed",
        {"lorafleet (SDK)": sides[OURS], "TRL GRPOTrainer + PEFT": sides[TRL]},
    )
    lora = info["lora"]
    title = (
        f"{args.model}, {recipe.task}, {recipe.prompts_per_step}x{recipe.group_size} rollouts, "
        f"LoRA r{lora['r']} alpha {lora['lora_alpha']}, lr {args.lr:g}, "
        f"{len(args.seeds)} seed(s), reward_mae {mae:.3f}"
    )
    args.png.parent.mkdir(parents=True, exist_ok=True)
    png = plot_reward_curves(
        args.png,
        {"lorafleet (Tinker SDK)": sides[OURS], "TRL GRPOTrainer + PEFT": sides[TRL]},
        title,
        "band: min-max over seeds",
    )
    timings = {
        "lorafleet step": step_time([r for s in rows[OURS].values() for r in s]),
        "TRL step": step_time([r for s in rows[TRL].values() for r in s]),
    }
    report(
        f"Reward parity, {title}",
        timings,
        {
            "reward_mae": (mae, f"<= {MAE_TARGET} (rolling window {MAE_WINDOW})"),
            "step_time_over_trl": (
                timings["lorafleet step"]["median_s"] / timings["TRL step"]["median_s"],
                "informative (median s per step)",
            ),
        },
        args.json,
        extra={
            "bench": "parity",
            "command": sys.argv,
            "spreads_overlap": overlap,
            "passed": mae <= MAE_TARGET and overlap,
            "reward_mae_window": MAE_WINDOW,
            "prompts_match_every_step": prompts_ok,
            "lorafleet_steps_without_update": skipped,
            "recipe": {
                "model": args.model,
                "task": recipe.task,
                "prompts_per_step": recipe.prompts_per_step,
                "group_size": recipe.group_size,
                "max_tokens": recipe.max_tokens,
                "temperature": recipe.temperature,
                "learning_rate": args.lr,
                "steps": args.steps,
                "seeds": args.seeds,
                "lora": {k: lora[k] for k in ("r", "lora_alpha", "target_modules")},
                "adam": {"beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0},
            },
            "loss": {
                "lorafleet": "importance_sampling (summed over tokens)",
                "trl": f"{TRL_LOSS}, beta=0, scale_rewards=none, num_iterations=1",
            },
            "trl_info": info["trl"],
            "png": str(png),
            "sides": sides,
        },
        dtype=m.dtype,
    )
    verdict = "PASS" if mae <= MAE_TARGET and overlap else "DIFFER"
    print(
        f"\nreward_mae {mae:.4f} (target <= {MAE_TARGET}), spreads overlap: {overlap} -> {verdict}"
    )
    if not prompts_ok:
        print("WARNING: a side drew other questions than the recipe's on some step (prompts_match)")
    if skipped:
        print(f"note: {skipped} step(s) of ours had every group agree: no optimizer step")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
