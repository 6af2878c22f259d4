"""Jobs for scheduler tests whose executors are fakes: real op types, placeholder contents."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lorafleet.sample.types import SamplingParams
from lorafleet.server.errors import UserError
from lorafleet.server.ops.types import (
    CreateModel,
    Forward,
    ForwardBackward,
    Job,
    Op,
    OptimStep,
    Refused,
    Sample,
    SaveSampler,
    SaveWeights,
    WireDatum,
)
from lorafleet.train.optim import AdamHParams


def train_op(
    sizes: Sequence[int], costs: Sequence[int] | None = None, *, backward: bool = True
) -> Forward | ForwardBackward:
    data = [WireDatum(torch.zeros(n, dtype=torch.int64), {}) for n in sizes]
    kind = ForwardBackward if backward else Forward
    return kind("cross_entropy", None, data, tuple(sizes), tuple(costs or sizes))


def sample_op(steps: int = 1, num_samples: int = 1) -> Sample:
    """`steps`: the fake executors here read it as the steps the sample takes (max_tokens)."""
    return Sample(
        prompt=[1],
        params=SamplingParams(max_tokens=steps),
        num_samples=num_samples,
        prompt_logprobs=False,
        topk_prompt=0,
        topk_sample=0,
        last_n=None,
        adapter=None,
        checkpoint_path=None,
    )


def op_of(kind: str) -> Op:
    """A placeholder op of `kind` (the kinds the scheduler tests name)."""
    match kind:
        case "forward_backward":
            return train_op([1])
        case "forward":
            return train_op([1], backward=False)
        case "optim_step":
            return OptimStep(AdamHParams(learning_rate=1e-4))
        case "sample":
            return sample_op()
        case "create_model":
            return CreateModel("session", "base", {"rank": 1}, None)
        case "save_weights":
            return SaveWeights("name", False, None, None)
        case "save_sampler":
            return SaveSampler("name", None, None, None)
        case "refused":
            return Refused(UserError("refused"), "forward_backward")
    raise ValueError(f"no placeholder op of kind {kind!r}")


def job(
    request_id: str,
    kind: str | Op,
    tenant: str = "t",
    *,
    model_id: str | None = None,
    seq_id: int | None = None,
    scope: str | None = None,
) -> Job:
    op = op_of(kind) if isinstance(kind, str) else kind
    return Job(request_id, tenant, op, model_id=model_id, seq_id=seq_id, scope=scope)
