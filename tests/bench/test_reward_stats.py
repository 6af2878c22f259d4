"""The pure parts of bench/parity.py and bench/lora_vs_full.py: reward_mae, the final-reward
spread and its overlap, best-LR selection, the JSON block of a side, and the per-step learning
figures of each side (no server, no TRL)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest

from bench.reward_runs import Recipe, expected_questions, group_stats, slug
from bench.reward_stats import (
    best_learning_rate,
    final_summary,
    mean_curve,
    reward_mae,
    rolling_mean,
    side_summary,
    spreads_overlap,
)
from bench.trl_side import REPO


def test_rolling_mean_takes_full_windows_and_one_window_when_short():
    assert rolling_mean([1, 2, 3, 4, 5, 6], 5) == [3.0, 4.0]
    assert rolling_mean([0.0, 1.0], 5) == [0.5]  # a 2-step smoke run: one window of all
    with pytest.raises(ValueError, match="window"):
        rolling_mean([1.0], 0)


def test_reward_mae_smooths_before_comparing():
    assert reward_mae([0.2] * 30, [0.2] * 30) == 0.0
    assert reward_mae([0.3] * 30, [0.2] * 30) == pytest.approx(0.1)
    # step-to-step noise of +-0.5 around the same level is what the window is for: over 5
    # steps the alternation leaves at most 0.1 of it
    noisy = [0.5 + (0.5 if i % 2 else -0.5) for i in range(30)]
    assert reward_mae(noisy, [0.5] * 30) == pytest.approx(0.1)
    assert reward_mae(noisy, [0.5] * 30, window=1) == pytest.approx(0.5)


def test_reward_mae_refuses_curves_of_different_lengths():
    with pytest.raises(ValueError, match="30 and 29 steps"):
        reward_mae([0.0] * 30, [0.0] * 29)


def test_mean_curve_needs_equal_seeds():
    assert mean_curve([[0.0, 1.0], [1.0, 0.0]]) == [0.5, 0.5]
    with pytest.raises(ValueError, match="same, non-zero number of steps"):
        mean_curve([[0.0, 1.0], [1.0]])
    with pytest.raises(ValueError, match="no seeds"):
        mean_curve([])


def test_final_summary_is_the_last_ten_steps_per_seed():
    a = [0.0] * 20 + [1.0] * 10
    b = [0.0] * 25 + [1.0] * 5
    s = final_summary([a, b])
    assert s["steps"] == 10
    assert s["per_seed"] == [1.0, 0.5]
    assert (s["mean"], s["min"], s["max"]) == (0.75, 0.5, 1.0)
    assert s["std"] == pytest.approx(math.sqrt(0.125))
    one = final_summary([[0.1, 0.3]])  # short and single-seed: all steps, std 0
    assert (one["steps"], one["mean"], one["std"]) == (2, pytest.approx(0.2), 0.0)


def test_spreads_overlap_when_the_seed_ranges_intersect():
    def spread(lo, hi):
        return {"min": lo, "max": hi}

    assert spreads_overlap(spread(0.2, 0.4), spread(0.3, 0.5))
    assert spreads_overlap(spread(0.2, 0.4), spread(0.4, 0.5))  # touching counts
    assert spreads_overlap(spread(0.1, 0.9), spread(0.4, 0.5))  # one inside the other
    assert not spreads_overlap(spread(0.2, 0.3), spread(0.31, 0.5))
    assert not spreads_overlap(spread(0.6, 0.7), spread(0.2, 0.5))


def test_best_learning_rate_by_final_mean_smaller_on_tie_nan_never_wins():
    def final(mean):
        return {"mean": mean}

    assert best_learning_rate({1e-4: final(0.2), 5e-4: final(0.4), 1e-3: final(0.3)}) == 5e-4
    assert best_learning_rate({1e-3: final(0.4), 5e-4: final(0.4)}) == 5e-4
    assert best_learning_rate({1e-3: final(float("nan")), 5e-4: final(0.0)}) == 5e-4
    with pytest.raises(ValueError, match="NaN"):
        best_learning_rate({1e-3: final(float("nan"))})
    with pytest.raises(ValueError, match="no learning rates"):
        best_learning_rate({})


def _rows(rewards, **extra):
    return [{"step": i, "reward_mean": r, **extra} for i, r in enumerate(rewards)]


def test_side_summary_json_shape():
    side = side_summary(
        {
            1: _rows([0.0, 0.5], adv_abs_mean=0.2, optimizer_stepped=True, loss_fn="x"),
            0: _rows([0.5, 1.0], adv_abs_mean=0.4, clip_frac=None, optimizer_stepped=False),
        }
    )
    assert side["seeds"] == [0, 1]
    assert side["reward_per_seed"] == {"0": [0.5, 1.0], "1": [0.0, 0.5]}
    assert side["reward_mean"] == [0.25, 0.75]
    assert (side["reward_min"], side["reward_max"]) == ([0.0, 0.5], [0.5, 1.0])
    assert side["final"]["per_seed"] == [0.75, 0.25]
    # numeric figures only (no flags, no names), averaged over the seeds that report them
    assert side["per_step_means"] == {"adv_abs_mean": [pytest.approx(0.3)] * 2}
    assert list(side["rows"]) == ["0", "1"]
    json.dumps(side, allow_nan=False)  # the bench's JSON takes it as is


def test_group_stats_uses_lorafleet_rl_advantages():
    # two groups of 4: one split 1/0 (|adv| 0.5 each), one all equal (no gradient)
    stats = group_stats([1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5], 4)
    assert stats == {"adv_abs_mean": 0.25, "nonzero_adv_frac": 0.5}
    with pytest.raises(ValueError, match="groups of 4"):
        group_stats([1.0, 0.0, 1.0], 4)


def test_recipe_problems_are_the_tenant_draws_step_by_step():
    recipe = Recipe(prompts_per_step=3, seed=7)
    problems = recipe.problems(4)
    assert len(problems) == 12
    assert expected_questions(problems, 2, 3) == [p.question for p in problems[6:9]]
    assert recipe.problems(4) == problems  # a seed is a fixed sequence
    assert Recipe(prompts_per_step=3, seed=8).problems(4) != problems
    assert recipe.tenant("t", 8).seed == 7


def test_slug_makes_a_file_name():
    assert slug("LoRA r8 (lorafleet) lr 0.0005 seed 0") == "LoRA-r8-lorafleet-lr-0.0005-seed-0"


def test_trl_side_learning_figures():
    """bench/trl_grpo.py runs in the TRL venv, but its figures are plain Python."""
    spec = importlib.util.spec_from_file_location("trl_grpo_side", REPO / "bench" / "trl_grpo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.pop("trl_grpo_side", None)
    spec.loader.exec_module(module)
    out = module._learning(
        {"advantages": [0.5, -0.5, 0.0, 0.0], "lengths": [3.0, 5.0, 4.0, 4.0]},
        {"reward": [0.25], "clip_ratio/region_mean": [0.0], "entropy": [1.5]},
    )
    assert out == {
        "adv_abs_mean": 0.25,
        "nonzero_adv_frac": 0.5,
        "sampled_len_mean": 4.0,
        "reward_mean": 0.25,
        "clip_frac": 0.0,
        "entropy": 1.5,
    }
    assert module._learning({}, {})["reward_mean"] is None
