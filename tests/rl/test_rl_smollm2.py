"""Real SmolLM2-135M-Instruct through the embedded server: RL raises the reward of an easy
arithmetic task, SFT lowers held-out loss. Slow (still in CI): about 2-3 minutes on 2 cores."""

from __future__ import annotations

import json
import random

import pytest

from lorafleet.rl.loop import RLConfig, TenantConfig, run_rl
from lorafleet.rl.sft import SFTConfig, run_sft

pytestmark = pytest.mark.slow

# Measured with these settings (8 prompts x 4 samples, lr 5e-4; mean of steps 0-2 vs steps
# 5-7). With the chat template's own system turn, bf16: seed 0 0.13 -> 0.45, seed 1
# 0.09 -> 0.42; fp32: 0.18 -> 0.47. With the default short system turn (rl/envs.py
# DEFAULT_SYSTEM_PROMPT), fp32 (what `auto` picks without native bf16): seed 0 0.17 -> 0.45,
# seed 1 0.08 -> 0.45. The margin is well under half the smallest observed gain (0.25).
RL_MARGIN = 0.12


def test_rl_raises_arithmetic_reward(tmp_path):
    tenant = TenantConfig(
        name="add",
        task="arithmetic:10",
        learning_rate=5e-4,
        rank=8,
        prompts_per_step=8,
        group_size=4,
        max_tokens=16,
        seed=0,
    )
    results = run_rl(
        RLConfig("smollm2-135m", tmp_path, [tenant], steps=8, save_every=8, progress=False)
    )
    r = results["add"]
    assert r.error is None, r.error
    rewards = [row["reward_mean"] for row in r.metrics if "reward_mean" in row]  # not eval rows
    before, after = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"rewards {rewards}; first 3 {before:.3f} -> last 3 {after:.3f}")
    assert after >= before + RL_MARGIN, rewards
    assert (tmp_path / "reward.png").is_file() and r.adapter_dir is not None


def test_sft_lowers_held_out_loss(tmp_path):
    rng = random.Random(0)
    data = tmp_path / "data.jsonl"
    lines = []
    for _ in range(30):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        lines.append(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"What is {a} + {b}?"},
                        {"role": "assistant", "content": f"Sum: <answer>{a + b}</answer>"},
                    ]
                }
            )
        )
    data.write_text("\n".join(lines) + "\n")
    summary = run_sft(
        SFTConfig(
            "smollm2-135m",
            data,
            tmp_path / "run",
            steps=8,
            batch_size=8,
            learning_rate=1e-3,
            eval_fraction=0.2,
            eval_every=4,
            progress=False,
        )
    )
    print(summary["eval_loss_before"], summary["eval_loss_after"])
    # Measured: 3.76 -> 0.28 per token after 8 steps; half is a very safe bar.
    assert summary["eval_loss_after"] < 0.5 * summary["eval_loss_before"]
