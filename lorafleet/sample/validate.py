"""Per-request validation, done before anything runs.

Each request is checked on its own and either becomes a `PreparedRequest` or a `SampleError`,
so a malformed request is answered with its own error while the rest of the batch runs as if it
were not there. Limits are explicit errors, never silent clamps (a prompt that does not fit the
context is rejected, not truncated), with one exception, vLLM's: a positive temperature below
`MIN_TEMPERATURE` is raised to it. Below it the float32 math of the shared sampling step
divides logits into infinities (1e-45 is a float32 denormal, 1e-300 is 0.0), and the
distribution at 0.01 is already greedy for any gap of a tenth of a logit or more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lorafleet.sample.types import SampleError, SampleRequest, SamplingParams, VersionKey


class RequestError(ValueError):
    """A request field that cannot be honoured; the message names the field and value."""


MAX_PROMPT_SCORES = 1 << 22
"""Bound on the per-position scores one request may ask for: `len(prompt) - 1` times the width
of `target_prompt_logprobs`, and `len(prompt) - 1` times `prompt_alt_tokens_k`. It bounds the
response (a float32 and an int64 per cell) and the draws, as Tinker bounds a top-k width; the
full-vocabulary log-softmax they read is bounded by the context length, as for prompt logprobs."""


MIN_TEMPERATURE = 1e-2
"""The lowest positive temperature sampled with (vLLM's `_MAX_TEMP` clamp); 0 is greedy."""

MAX_SEED = 1 << 64
"""Seeds are integers in (-MAX_SEED, MAX_SEED): 64-bit, signed or not."""


@dataclass(frozen=True)
class StopSpec:
    token_ids: frozenset[int]
    strings: tuple[str, ...]


@dataclass(frozen=True)
class PreparedRequest:
    index: int
    prompt: torch.Tensor  # int64 [P], CPU
    adapter: VersionKey | None
    num_samples: int
    max_new_tokens: int
    temperature: float
    top_k: int  # 0 = off
    top_p: float
    stop: StopSpec
    seed: int | None
    prompt_logprobs: bool
    topk_prompt: int
    topk_sample: int
    targets: torch.Tensor | None = None  # int64 [P - 1, K], -1 = unused
    targets_from: int = 0  # first row of `targets` that names an id (earlier rows: nothing)
    alt_k: int = 0
    cache_salt: str = ""  # the prefix cache's owner of this prompt (SampleRequest.cache_salt)
    public_prefixes: tuple[tuple[int, ...], ...] = ()

    @property
    def prompt_len(self) -> int:
        return int(self.prompt.numel())

    @property
    def prompt_logits_from(self) -> int | None:
        """The first prompt position whose next-token distribution the request reads (None:
        only the last, to sample). Target-only requests skip the rows before their first id."""
        if self.prompt_logprobs or self.topk_prompt > 0 or self.alt_k > 0:
            return 0
        if self.targets is not None:
            return self.targets_from
        return None


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    context: int
    eos_token_ids: frozenset[int]
    has_tokenizer: bool


def _int(value: object, name: str, *, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise RequestError(f"{name} must be >= {low}, got {value}")
    return value


def _float(value: object, name: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(float(value))
    ):
        raise RequestError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _adapter(value: object) -> VersionKey | None:
    if value is None:
        return None
    if (
        not isinstance(value, tuple)
        or len(value) != 2
        or not isinstance(value[0], str)
        or not value[0]
        or isinstance(value[1], bool)
        or not isinstance(value[1], int)
        or value[1] < 0
    ):
        raise RequestError(
            f"adapter must be None or (adapter_id: str, version: int >= 0), got {value!r}"
        )
    return value


def _prompt(value: object, limits: ModelLimits) -> torch.Tensor:
    try:
        tokens = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise RequestError(f"prompt must be a list of token ids: {exc}") from exc
    if tokens.numel() == 0:
        raise RequestError("prompt is empty")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise RequestError(f"prompt tokens must be integers, got dtype {tokens.dtype}")
    if tokens.dim() != 1:
        raise RequestError(f"prompt must be 1-D, got shape {tuple(tokens.shape)}")
    tokens = tokens.to(torch.int64).cpu()
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= limits.vocab_size:
        bad = low if low < 0 else high
        where = int((tokens == bad).nonzero()[0])
        raise RequestError(
            f"prompt token {bad} at position {where} is outside the vocabulary [0, {limits.vocab_size})"
        )
    if tokens.numel() >= limits.context:
        raise RequestError(
            f"prompt has {tokens.numel()} tokens; the context length is {limits.context}, "
            "which leaves no room for a sampled token"
        )
    return tokens


def _targets(value: object, prompt_len: int, limits: ModelLimits) -> tuple[torch.Tensor, int]:
    """The target ids and the first row naming one."""
    name = "target_prompt_logprobs"
    if not isinstance(value, torch.Tensor):
        raise RequestError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype != torch.int64:
        raise RequestError(f"{name} must hold int64 token ids, got dtype {value.dtype}")
    rows = prompt_len - 1
    if value.dim() != 2 or value.shape[0] != rows:
        raise RequestError(
            f"{name} must have shape [len(prompt) - 1, K] = [{rows}, K], got {list(value.shape)}"
        )
    width = int(value.shape[1])
    if rows * width > MAX_PROMPT_SCORES:
        raise RequestError(
            f"{name} of shape {list(value.shape)} asks for {rows * width} scores, more than "
            f"this sampler's limit of {MAX_PROMPT_SCORES} ((len(prompt) - 1) * K)"
        )
    ids = value.cpu()
    bad = (ids < -1) | (ids >= limits.vocab_size)
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise RequestError(
            f"{name}[{row}, {col}] = {int(ids[row, col])} is neither -1 (unused) nor a token id "
            f"in the vocabulary [0, {limits.vocab_size})"
        )
    named = (ids >= 0).any(dim=1).nonzero()
    if named.numel() == 0:
        raise RequestError(f"{name} names no token id (every cell is -1)")
    return ids, int(named[0])


def _stop(value: object, limits: ModelLimits) -> StopSpec:
    if value is None:
        return StopSpec(token_ids=limits.eos_token_ids, strings=())
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple):
        raise RequestError(
            f"stop must be None, a string, or a list of strings or token ids, got {value!r}"
        )
    if all(isinstance(s, str) for s in value):
        if any(s == "" for s in value):
            raise RequestError("stop strings must not be empty")
        if value and not limits.has_tokenizer:
            raise RequestError(
                "stop strings need a tokenizer, and this sampler has none; pass token ids"
            )
        return StopSpec(token_ids=frozenset(), strings=tuple(dict.fromkeys(value)))
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        bad = [t for t in value if not 0 <= t < limits.vocab_size]
        if bad:
            raise RequestError(
                f"stop token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})"
            )
        return StopSpec(token_ids=frozenset(value), strings=())
    raise RequestError(f"stop must be all strings or all token ids, got {list(value)[:5]!r}")


def prepare_request(index: int, request: SampleRequest, limits: ModelLimits) -> PreparedRequest:
    """Raises RequestError naming the first bad field."""
    if not isinstance(request, SampleRequest):
        raise RequestError(f"expected a SampleRequest, got {type(request).__name__}")
    params = request.params
    if not isinstance(params, SamplingParams):
        raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
    prompt = _prompt(request.prompt, limits)
    room = limits.context - prompt.numel()
    if params.max_tokens is None:
        max_new = room
    else:
        max_new = _int(params.max_tokens, "max_tokens", low=1)
        if max_new > room:
            raise RequestError(
                f"prompt ({prompt.numel()} tokens) + max_tokens ({max_new}) exceeds the context length {limits.context}"
            )
    temperature = _float(params.temperature, "temperature")
    if temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature}")
    if 0 < temperature < MIN_TEMPERATURE:
        temperature = MIN_TEMPERATURE
    top_p = _float(params.top_p, "top_p")
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}")
    top_k = _int(params.top_k, "top_k", low=-1)
    top_k = 0 if top_k in (-1, 0) or top_k >= limits.vocab_size else top_k
    seed = None if params.seed is None else _int(params.seed, "seed")
    if seed is not None and not -MAX_SEED < seed < MAX_SEED:
        raise RequestError(f"seed must be a 64-bit integer, got one of {seed.bit_length()} bits")
    num_samples = _int(request.num_samples, "num_samples", low=1)
    if not _float(request.share_weight, "share_weight") > 0:
        raise RequestError(f"share_weight must be > 0, got {request.share_weight!r}")
    if not isinstance(request.prompt_logprobs, bool):
        raise RequestError(
            f"prompt_logprobs must be true or false, got {request.prompt_logprobs!r}"
        )
    topk_prompt = _int(request.topk_prompt_logprobs, "topk_prompt_logprobs", low=0)
    topk_sample = _int(request.topk_sample_logprobs, "topk_sample_logprobs", low=0)
    for name, k in (("topk_prompt_logprobs", topk_prompt), ("topk_sample_logprobs", topk_sample)):
        if k > limits.vocab_size:
            raise RequestError(f"{name}={k} exceeds the vocabulary size {limits.vocab_size}")
    targets, targets_from = (
        (None, 0)
        if request.target_prompt_logprobs is None
        else _targets(request.target_prompt_logprobs, prompt.numel(), limits)
    )
    alt_k = _int(request.prompt_alt_tokens_k, "prompt_alt_tokens_k", low=0)
    if (prompt.numel() - 1) * alt_k > MAX_PROMPT_SCORES:
        raise RequestError(
            f"prompt_alt_tokens_k={alt_k} with a {prompt.numel()}-token prompt asks for "
            f"{(prompt.numel() - 1) * alt_k} draws, more than this sampler's limit of "
            f"{MAX_PROMPT_SCORES} ((len(prompt) - 1) * k)"
        )
    return PreparedRequest(
        index=index,
        prompt=prompt,
        adapter=_adapter(request.adapter),
        num_samples=num_samples,
        max_new_tokens=max_new,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop=_stop(params.stop, limits),
        seed=seed,
        prompt_logprobs=request.prompt_logprobs,
        topk_prompt=topk_prompt,
        topk_sample=topk_sample,
        targets=targets,
        targets_from=targets_from,
        alt_k=alt_k,
        cache_salt=_salt(request.cache_salt),
        public_prefixes=request.public_prefixes,
    )


def _salt(value: object) -> str:
    if not isinstance(value, str):
        raise RequestError(f"cache_salt must be a string, got {type(value).__name__}")
    return value


def prepare_all(
    requests: list[SampleRequest], limits: ModelLimits
) -> list[PreparedRequest | SampleError]:
    out: list[PreparedRequest | SampleError] = []
    for index, request in enumerate(requests):
        try:
            out.append(prepare_request(index, request, limits))
        except RequestError as exc:
            out.append(SampleError("invalid_request", f"request {index}: {exc}"))
    return out
