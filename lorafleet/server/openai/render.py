"""OpenAI's response objects and stream chunks, from the sampler's sequences.

A choice's text is its tokens decoded and cut before the first stop string; its log-probs cover
every sampled token (the stop string's last token and an EOS included: they were sampled, and
these are the log-probs the Tinker `sample` route returns for the same request)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from lorafleet.server.openai.asks import Ask
from lorafleet.server.openai.text import Text, cut_at_stop

TopRow = list[tuple[int, float]]


@dataclass(frozen=True)
class Sampled:
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    top: list[TopRow] | None
    # the response's prompt_cache_hit_tokens (its request's prompt, shared by every sequence)
    cached_prompt_tokens: int = 0


def sampled(body: bytes) -> list[Sampled]:
    """The sequences of a Tinker SampleResponse (what the sample op's future holds)."""
    out = []
    response = pb.SampleResponse.FromString(body)
    for seq in response.sequences:
        top: list[TopRow] | None = None
        if seq.HasField("topk_sampled_logprobs"):
            t = seq.topk_sampled_logprobs
            ids = np.frombuffer(t.token_ids, dtype="<i4").reshape(t.length, t.k)
            lps = np.frombuffer(t.logprobs, dtype="<f4").reshape(t.length, t.k)
            top = [
                list(zip(map(int, i), map(float, v), strict=True))
                for i, v in zip(ids, lps, strict=True)
            ]
        out.append(
            Sampled(
                tokens=np.frombuffer(seq.tokens, dtype="<i4").astype(int).tolist(),
                logprobs=np.frombuffer(seq.logprobs, dtype="<f4").astype(float).tolist(),
                finish_reason="stop" if seq.stop_reason == pb.STOP_REASON_STOP else "length",
                top=top,
                cached_prompt_tokens=int(response.prompt_cache_hit_tokens),
            )
        )
    return out


def final_text(seq: Sampled, ask: Ask, text: Text) -> str:
    return cut_at_stop(text.decode(seq.tokens), ask.stop)[0]


def usage(ask: Ask, seqs: list[Sampled]) -> dict[str, Any]:
    """OpenAI's usage, with `prompt_tokens_details.cached_tokens`: the prompt tokens the
    sampler read from its prefix cache instead of computing."""
    completion = sum(len(s.tokens) for s in seqs)
    prompt = len(ask.prompt)
    cached = min(seqs[0].cached_prompt_tokens, prompt) if seqs else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def logprobs(seq: Sampled, ask: Ask, text: Text) -> dict[str, Any] | None:
    if ask.logprobs is None:
        return None
    k = ask.logprobs
    rows = seq.top if seq.top is not None else [[] for _ in seq.tokens]
    names = [text.token(t) for t in seq.tokens]
    if ask.chat:
        return {
            "content": [
                {
                    **_entry(name, lp),
                    "top_logprobs": [_entry(text.token(t), v) for t, v in row[:k]],
                }
                for name, lp, row in zip(names, seq.logprobs, rows, strict=True)
            ],
            "refusal": None,
        }
    offsets, at = [], 0
    for name in names:
        offsets.append(at)
        at += len(name)
    return {
        "tokens": names,
        "token_logprobs": seq.logprobs,
        "top_logprobs": [{text.token(t): v for t, v in row[:k]} for row in rows],
        "text_offset": offsets,
    }


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def response(ask: Ask, rid: str, created: int, seqs: list[Sampled], text: Text) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    for i, seq in enumerate(seqs):
        content = final_text(seq, ask, text)
        choice: dict[str, Any] = {"index": i}
        if ask.chat:
            choice["message"] = {"role": "assistant", "content": content, "refusal": None}
        else:
            choice["text"] = content
        choice["logprobs"] = logprobs(seq, ask, text)
        choice["finish_reason"] = seq.finish_reason
        choices.append(choice)
    return {
        **_head(ask, rid, created, stream=False),
        "choices": choices,
        "usage": usage(ask, seqs),
    }


def _head(ask: Ask, rid: str, created: int, *, stream: bool) -> dict[str, Any]:
    if ask.chat:
        kind = "chat.completion.chunk" if stream else "chat.completion"
        prefix = "chatcmpl-"
    else:
        kind, prefix = "text_completion", "cmpl-"
    return {
        "id": prefix + rid,
        "object": kind,
        "created": created,
        "model": ask.model,
        "system_fingerprint": None,
    }


def chunk(
    ask: Ask,
    rid: str,
    created: int,
    index: int,
    delta: str | None,
    *,
    first: bool = False,
    finish_reason: str | None = None,
    logprobs_: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One choice's increment: chat chunks open with the role, completions carry plain text."""
    choice: dict[str, Any] = {"index": index}
    if ask.chat:
        d: dict[str, Any] = {"role": "assistant"} if first else {}
        if delta is not None:
            d["content"] = delta
        choice["delta"] = d
    else:
        choice["text"] = delta or ""
    choice["logprobs"] = logprobs_
    choice["finish_reason"] = finish_reason
    return {**_head(ask, rid, created, stream=True), "choices": [choice]}


def usage_chunk(ask: Ask, rid: str, created: int, seqs: list[Sampled]) -> dict[str, Any]:
    return {**_head(ask, rid, created, stream=True), "choices": [], "usage": usage(ask, seqs)}
