"""The sampler's side of the canary: its log-probs of the canary prompt under one version.

They go through the real sampling path (prefill over the row cache, split head), one request
per call (one row, the trainer's shape), and are compared with the trainer's by
`lorafleet.canary`. Here, in `sample/`, so that a Ray sampler replica computes them without
importing the trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from lorafleet.canary import SyncVerificationError
from lorafleet.sample.types import SampleRequest, SamplingParams, VersionKey

if TYPE_CHECKING:
    from lorafleet.interfaces import Sampler

__all__ = ["sampler_canary_logprobs", "version_name"]


def version_name(key: VersionKey) -> str:
    """`<adapter>@<version>`, the name rollout engines serve a version under (and the canary's
    messages use)."""
    adapter_id, version = key
    return f"{adapter_id}@{version}"


def sampler_canary_logprobs(
    sampler: Sampler, key: VersionKey | None, tokens: Sequence[int]
) -> torch.Tensor:
    """Prompt log-probs of `tokens` under version `key` (None = the base model), from the
    second token on; a version the sampler cannot run fails the canary."""
    params = SamplingParams(max_tokens=1, temperature=0.0, stop=[])
    (result,) = sampler.generate(
        [SampleRequest(list(tokens), params, adapter=key, prompt_logprobs=True)]
    )
    if result.error is not None or result.prompt_logprobs is None:
        what = "the base model" if key is None else repr(key)
        raise SyncVerificationError(f"canary: the sampler could not run {what}: {result.error}")
    return torch.tensor(result.prompt_logprobs[1:], dtype=torch.float32)
