"""Reward curves compared: pure functions behind bench/parity.py and bench/lora_vs_full.py.

A curve is one reward per step. A side (one system, or one configuration at one learning rate)
has one curve per seed; its seed-mean curve is what is plotted and compared, its seeds' spread
is what says whether a difference is more than seed noise.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

MAE_WINDOW = 5  # rolling window of reward_mae (issue 36)
FINAL_STEPS = 10  # "final reward": the mean of a curve's last 10 steps


def _checked(curves: Sequence[Sequence[float]], what: str) -> int:
    if not curves:
        raise ValueError(f"{what}: no curves (no seeds)")
    lengths = {len(c) for c in curves}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(
            f"{what}: every seed needs the same, non-zero number of steps, got {sorted(lengths)}"
        )
    return lengths.pop()


def mean_curve(curves: Sequence[Sequence[float]]) -> list[float]:
    """The per-step mean over seeds."""
    steps = _checked(curves, "mean_curve")
    return [statistics.fmean(c[i] for c in curves) for i in range(steps)]


def band(curves: Sequence[Sequence[float]]) -> tuple[list[float], list[float]]:
    """Per-step min and max over seeds (the plotted band)."""
    steps = _checked(curves, "band")
    return (
        [min(c[i] for c in curves) for i in range(steps)],
        [max(c[i] for c in curves) for i in range(steps)],
    )


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Means of every full window (len - window + 1 of them); a curve shorter than the window
    (a smoke run) is one window of all its values."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if not values:
        raise ValueError("rolling_mean of an empty curve")
    w = min(window, len(values))
    return [statistics.fmean(values[i : i + w]) for i in range(len(values) - w + 1)]


def reward_mae(a: Sequence[float], b: Sequence[float], window: int = MAE_WINDOW) -> float:
    """Issue 36's reward_mae: the mean absolute difference between the two seed-mean curves
    after each is smoothed by a rolling mean of `window` steps (single steps at 32 rollouts are
    too noisy to compare one by one)."""
    if len(a) != len(b):
        raise ValueError(f"reward_mae: curves of {len(a)} and {len(b)} steps")
    ra, rb = rolling_mean(a, window), rolling_mean(b, window)
    return statistics.fmean(abs(x - y) for x, y in zip(ra, rb, strict=True))


def final_summary(curves: Sequence[Sequence[float]], last: int = FINAL_STEPS) -> dict[str, Any]:
    """Each seed's mean reward over its last `last` steps (all of them if fewer), and their
    mean, min, max and sample std (0 for one seed)."""
    steps = _checked(curves, "final_summary")
    k = min(last, steps)
    per_seed = [statistics.fmean(c[-k:]) for c in curves]
    return {
        "steps": k,
        "per_seed": per_seed,
        "mean": statistics.fmean(per_seed),
        "min": min(per_seed),
        "max": max(per_seed),
        "std": statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0,
    }


def spreads_overlap(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two sides' final-reward seed ranges [min, max] (final_summary) intersect."""
    return bool(a["min"] <= b["max"] and b["min"] <= a["max"])


def best_learning_rate(finals: Mapping[float, Mapping[str, Any]]) -> float:
    """The learning rate whose final-reward mean (final_summary) is highest; on a tie the
    smaller learning rate (the safer one). NaN means never win."""
    if not finals:
        raise ValueError("best_learning_rate: no learning rates")
    scored = [(lr, s["mean"]) for lr, s in finals.items()]
    finite = [(lr, m) for lr, m in scored if not math.isnan(m)]
    if not finite:
        raise ValueError(f"best_learning_rate: every final mean is NaN ({sorted(finals)})")
    best = max(m for _, m in finite)
    return min(lr for lr, m in finite if m == best)


def side_summary(per_seed_rows: Mapping[int, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """One side's JSON block from its per-seed step rows (each with `reward_mean`): the
    per-seed curves, the seed-mean curve with its min/max band, the final-reward summary, and
    the per-step mean over seeds of every other numeric figure the rows carry."""
    seeds = sorted(per_seed_rows)
    curves = [[float(r["reward_mean"]) for r in per_seed_rows[s]] for s in seeds]
    low, high = band(curves)
    keys = sorted(
        {
            k
            for rows in per_seed_rows.values()
            for r in rows
            for k, v in r.items()
            if k not in ("step", "reward_mean")
            and isinstance(v, int | float)
            and not isinstance(v, bool)
        }
    )
    return {
        "seeds": seeds,
        "reward_per_seed": {str(s): c for s, c in zip(seeds, curves, strict=True)},
        "reward_mean": mean_curve(curves),
        "reward_min": low,
        "reward_max": high,
        "final": final_summary(curves),
        "per_step_means": {k: _mean_per_step(per_seed_rows, seeds, k) for k in keys},
        "rows": {str(s): list(per_seed_rows[s]) for s in seeds},
    }


def _mean_per_step(
    per_seed_rows: Mapping[int, Sequence[Mapping[str, Any]]], seeds: Sequence[int], key: str
) -> list[float | None]:
    """The mean over the seeds that report `key` at each step (None where none does)."""
    steps = len(per_seed_rows[seeds[0]])
    out: list[float | None] = []
    for i in range(steps):
        values = [per_seed_rows[s][i].get(key) for s in seeds]
        numbers = [
            float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)
        ]
        out.append(statistics.fmean(numbers) if numbers else None)
    return out
