"""What a caller hands `SampleEngine.generate` and what it gets back.

These mirror Tinker's `SampleRequest` / `SampleResponse` (TINKER_PROTOCOL.md 6.4) in plain Python,
so the server only converts wire formats. A request that cannot run gets a `SampleResult` with an
`error` instead of raising: one bad request in a batch must not take its neighbours down.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

VersionKey = tuple[str, int]
"""(adapter_id, version): one immutable published adapter version."""

StopReason = Literal["stop", "length"]

TopK = list[tuple[int, float]]
"""(token id, log-prob) pairs, most likely first."""

TokenHook = Callable[[int, int], None]
"""Called as `hook(sample index, token id)` on the thread that steps the sampler, after each token
a request's sample draws (a streaming caller shows tokens as they come). It runs inside the
engine step, so it must be quick and must not raise; samplers that cannot call it (their batch
runs in another process) ignore it, and the caller gets the tokens with the result only."""


@dataclass(frozen=True)
class SamplingParams:
    """Tinker's SamplingParams.

    `stop`: None = stop at EOS only; [] = never stop early (not even at EOS); a string, a list of
    strings or a list of token ids = stop on exactly those (EOS is then not implied, as in
    Tinker, whose renderers pass the end-of-turn token explicitly). `max_tokens` None = up to
    the context length. `top_k` -1 (or 0) = off. `seed` None = non-reproducible.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop: str | Sequence[str] | Sequence[int] | None = None
    seed: int | None = None


@dataclass
class SampleRequest:
    """One prompt, sampled `num_samples` times with one adapter version (None = base model)."""

    prompt: Sequence[int] | torch.Tensor
    params: SamplingParams = field(default_factory=SamplingParams)
    adapter: VersionKey | None = None
    num_samples: int = 1
    # Who the request is for (a tenant, a client: the caller decides). When rows wait for the
    # batch, admission takes turns between share keys, so one caller's many rows never make
    # another's few wait behind all of them. None: one shared key.
    share_key: str | None = None
    # The key's share of the rows when keys wait (> 0): rows held / weight decides whose turn.
    share_weight: float = 1.0
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    # Token ids to score at prompt positions, int64 [len(prompt) - 1, K]: row i scores position
    # i + 1 (nothing predicts position 0); -1 asks for nothing there. None: no targets.
    target_prompt_logprobs: torch.Tensor | None = None
    prompt_alt_tokens_k: int = 0  # draws per prompt position (see PromptAltTokens)
    on_token: TokenHook | None = None  # progress, optional (see TokenHook)
    # Set by the caller when nobody wants the result any more (its client hung up): the
    # sampler drops the request's rows at its next step and resolves it with a "cancelled"
    # error that counts the tokens it had produced. Samplers whose batches run elsewhere may
    # finish it instead.
    cancel: threading.Event | None = None
    # Whose prompt this is, for the prefix cache (prefix_cache.py): its blocks are found only by
    # requests with the same salt, except within one of `public_prefixes` (token ids declared
    # shareable, e.g. an operator's system prompt). "": shared with every unsalted request.
    cache_salt: str = ""
    public_prefixes: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class PromptAltTokens:
    """Tinker's `prompt_alt_tokens`: `k` independent draws, with replacement and at the request's
    temperature (no top-k/top-p), from the model's distribution at every prompt position after
    the first; row i holds alternatives to prompt[i + 1]. The log-probs are the raw ones (see
    engine.py), so they equal `target_prompt_logprobs` of the same ids."""

    tokens: torch.Tensor  # int64 [len(prompt) - 1, k]
    logprobs: torch.Tensor  # float32 [len(prompt) - 1, k]


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]  # of each sampled token, under the model (see engine.py)
    stop_reason: StopReason
    adapter: VersionKey | None  # the version that produced it (None = base model)
    topk_logprobs: list[TopK] | None = None  # per sampled position, when asked for


@dataclass(frozen=True)
class SampleError:
    """Why a request did not run. `code` is stable for servers to map onto HTTP statuses."""

    # engine_unavailable: no verified rollout replica could run it now (retryable, a 503);
    # out_of_memory: the device ran out of memory running it (the others went on);
    # non_finite_logits: its adapter version made NaN/inf logits (the others went on);
    # internal_error: its own per-row work raised (the others went on), or the whole step did;
    # cancelled: its caller set the request's `cancel` event
    code: Literal[
        "invalid_request",
        "unknown_version",
        "version_unavailable",
        "engine_unavailable",
        "out_of_memory",
        "non_finite_logits",
        "internal_error",
        "cancelled",
    ]
    message: str


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    adapter: VersionKey | None
    prompt_logprobs: list[float | None] | None = None  # None at position 0 (nothing predicts it)
    topk_prompt_logprobs: list[TopK | None] | None = None
    # float32, the shape of the request's target ids; 0.0 where it had -1 or a row before the
    # first one that names an id (those rows are not computed).
    target_prompt_logprobs: torch.Tensor | None = None
    prompt_alt_tokens: PromptAltTokens | None = None
    error: SampleError | None = None
    # prompt tokens its first prefill read from the prefix cache instead of computing (the
    # SDK's SampleResponse.prompt_cache_hit_tokens); 0 for engines that do not report it
    prompt_cache_hit_tokens: int = 0
    # The work done for it, whatever the outcome (metering charges failures and cancellations
    # too): prompt tokens prefilled (once per request) and tokens drawn over all its samples.
    # Samplers that cannot tell report 0 for a failed request.
    prefill_tokens: int = 0
    sampled_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class SequenceTrace:
    """When one sequence joined and left the batch (engine steps), for scheduling tests/metrics."""

    request: int
    sample: int
    admitted_step: int
    finished_step: int
    num_tokens: int
