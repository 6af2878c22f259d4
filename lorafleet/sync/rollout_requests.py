"""The server's sample requests as rollout-engine requests, and the replies back.

A request is validated by the embedded sampler's own rules first (`prepare_request`: same
limits, same messages), then what a rollout engine cannot honour is refused by name, never
dropped: top-k log-probs, prompt targets, `prompt_alt_tokens` and stop strings (engines take
token ids; tokenization must not differ between trainer and engine). `num_samples` becomes
one engine request per sample, each with its own seed derived from the request's, so a
seeded request is reproducible on the engine (not equal to the embedded sampler's draws:
another RNG).
"""

from __future__ import annotations

import hashlib

from lorafleet.sample.types import SampledSequence, SampleRequest, SampleResult, VersionKey
from lorafleet.sample.validate import ModelLimits, PreparedRequest, RequestError, prepare_request
from lorafleet.sync.base import BASE, AdapterVersion, RolloutParams, RolloutRequest, RolloutResult

__all__ = ["from_results", "prepare", "sample_seed", "to_rollouts"]


def prepare(request: SampleRequest, limits: ModelLimits, engine: str) -> PreparedRequest:
    """Raises RequestError naming the field the engine cannot honour."""
    prepared = prepare_request(0, request, limits)
    refused = [
        ("topk_prompt_logprobs", prepared.topk_prompt > 0),
        ("topk_sample_logprobs", prepared.topk_sample > 0),
        ("target_prompt_logprobs", prepared.targets is not None),
        ("prompt_alt_tokens_k", prepared.alt_k > 0),
    ]
    for name, asked in refused:
        if asked:
            raise RequestError(
                f"{name} is not supported by the {engine} rollout engine this server samples with"
            )
    if prepared.stop.strings:
        raise RequestError(
            f"stop strings {list(prepared.stop.strings)[:3]!r} are not supported by the {engine} "
            "rollout engine this server samples with; pass stop token ids"
        )
    return prepared


def sample_seed(seed: int | None, sample: int) -> int | None:
    """Sample `sample`'s engine seed: distinct per sample, fixed for a seeded request."""
    if seed is None:
        return None
    digest = hashlib.sha256(f"lorafleet.rollout|{seed}|{sample}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def to_rollouts(prepared: PreparedRequest, version: AdapterVersion | None) -> list[RolloutRequest]:
    """One engine request per sample; prompt log-probs asked for on the first only."""
    stop = tuple(sorted(prepared.stop.token_ids))
    return [
        RolloutRequest(
            prepared.prompt.tolist(),
            BASE if version is None else version,
            RolloutParams(
                max_tokens=prepared.max_new_tokens,
                temperature=prepared.temperature,
                top_p=prepared.top_p,
                top_k=prepared.top_k if prepared.top_k > 0 else -1,
                seed=sample_seed(prepared.seed, sample),
                stop_token_ids=stop,
            ),
            prompt_logprobs=prepared.prompt_logprobs and sample == 0,
            cache_salt=prepared.cache_salt,
        )
        for sample in range(prepared.num_samples)
    ]


def from_results(results: list[RolloutResult], key: VersionKey | None) -> SampleResult:
    """The engine's replies as one SampleResult, each sequence naming the version that
    produced it (the pool checked the engine's own word for it)."""
    return SampleResult(
        sequences=[SampledSequence(r.tokens, r.logprobs, r.finish_reason, key) for r in results],
        adapter=key,
        prompt_logprobs=results[0].prompt_logprobs if results else None,
    )
