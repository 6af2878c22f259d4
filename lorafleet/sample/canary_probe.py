"""The sampler's side of the canary: its log-probs of the canary prompt under one version.

They go through the sampling path's forward (a one-row prefill over a row cache, split head,
the trainer's shape) and are compared with the trainer's by `lorafleet.canary`. The probe runs
beside the running batch (`Sampler.probe_logprobs`), never queued behind other callers' rows: a
publish must not wait for someone else's long samples. Here, in `sample/`, so that a Ray
sampler replica computes them without importing the trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from lorafleet.canary import SyncVerificationError
from lorafleet.sample.types import SampleRequest, SampleResult, SamplingParams, VersionKey
from lorafleet.sample.versions import VersionError, VersionUnavailableError

if TYPE_CHECKING:
    from lorafleet.interfaces import Sampler

__all__ = ["generated_prompt_logprobs", "sampler_canary_logprobs", "version_name"]


class _Generates(Protocol):
    def generate(self, requests: Sequence[SampleRequest]) -> list[SampleResult]: ...


def version_name(key: VersionKey) -> str:
    """`<adapter>@<version>`, the name rollout engines serve a version under (and the canary's
    messages use)."""
    adapter_id, version = key
    return f"{adapter_id}@{version}"


def generated_prompt_logprobs(
    sampler: _Generates, key: VersionKey | None, tokens: Sequence[int]
) -> torch.Tensor:
    """`probe_logprobs` for a sampler with no running batch in this process (Ray replicas run
    each batch to completion): the tokens as one prompt-log-prob request through `generate`.
    Raises ValueError for a bad prompt, VersionUnavailableError for a version it cannot run."""
    params = SamplingParams(max_tokens=1, temperature=0.0, stop=[])
    (result,) = sampler.generate(
        [SampleRequest(list(tokens), params, adapter=key, prompt_logprobs=True)]
    )
    if result.error is not None and result.error.code == "invalid_request":
        raise ValueError(result.error.message)
    if result.error is not None or result.prompt_logprobs is None:
        raise VersionUnavailableError(f"the sampler could not run {key!r}: {result.error}")
    return torch.tensor(result.prompt_logprobs[1:], dtype=torch.float32)


def sampler_canary_logprobs(
    sampler: Sampler, key: VersionKey | None, tokens: Sequence[int]
) -> torch.Tensor:
    """Prompt log-probs of `tokens` under version `key` (None = the base model), from the
    second token on; a version the sampler cannot run fails the canary."""
    try:
        return sampler.probe_logprobs(key, tokens)
    except (ValueError, VersionError) as exc:
        what = "the base model" if key is None else repr(key)
        raise SyncVerificationError(f"canary: the sampler could not run {what}: {exc}") from exc
