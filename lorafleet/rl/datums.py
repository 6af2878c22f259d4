"""Rewards -> advantages -> Tinker datums, in the cookbook's layout (pure functions, so tests can
pin the layout without a server)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tinker import types


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """GRPO's baseline: each sample's reward minus its group's mean (no std scaling, which
    blows up near-uniform groups on small batches)."""
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def rl_datum(
    prompt: Sequence[int], sampled: Sequence[int], logprobs: Sequence[float], advantage: float
) -> types.Datum:
    """input = prompt + sampled[:-1]; position i predicts target i. The prompt's P-1 target slots
    carry token 0 with logprob 0 and advantage 0, so only sampled tokens move the policy."""
    if len(sampled) != len(logprobs):
        raise ValueError(f"{len(sampled)} sampled tokens but {len(logprobs)} sampler logprobs")
    if not prompt or not sampled:
        raise ValueError("an RL datum needs a non-empty prompt and at least one sampled token")
    pad = len(prompt) - 1
    inputs: dict[str, Any] = {  # plain lists: Datum converts each by its key's wire dtype
        "target_tokens": [0] * pad + list(sampled),
        "logprobs": [0.0] * pad + [float(x) for x in logprobs],
        "advantages": [0.0] * pad + [float(advantage)] * len(sampled),
    }
    return types.Datum(
        model_input=types.ModelInput.from_ints(list(prompt) + list(sampled[:-1])),
        loss_fn_inputs=inputs,
    )


def sft_datum(tokens: Sequence[int], weights: Sequence[float]) -> types.Datum:
    """Next-token prediction: `weights[i]` weighs the loss of predicting `tokens[i]` (weights[0]
    is dropped: the first token is never predicted)."""
    if len(tokens) != len(weights):
        raise ValueError(f"{len(tokens)} tokens but {len(weights)} weights")
    if len(tokens) < 2:
        raise ValueError("an SFT datum needs at least two tokens")
    inputs: dict[str, Any] = {  # plain lists: Datum converts each by its key's wire dtype
        "target_tokens": list(tokens[1:]),
        "weights": [float(w) for w in weights[1:]],
    }
    return types.Datum(
        model_input=types.ModelInput.from_ints(list(tokens[:-1])), loss_fn_inputs=inputs
    )
