"""Choosing the next token of many sequences at once, each with its own parameters and RNG.

Reproducibility: every sequence owns a `torch.Generator` seeded from (request seed, sample
index) and draws exactly one uniform number per sampled token, then inverts the CDF of its own
filtered distribution. What else is in the batch (or in which row the sequence sits) therefore
never changes which random number a token uses, so the same seed and request give the same
tokens alone or batched (up to float noise in the logits themselves).

Filtering order is vLLM's: temperature, then top-k, then top-p. Temperature 0 is greedy
(argmax of the raw logits, no random draw).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

import torch


def sequence_generator(seed: int | None, sample_index: int) -> torch.Generator:
    """A private RNG per sequence; seed None draws fresh OS entropy (not reproducible)."""
    if seed is None:
        return torch.Generator().manual_seed(secrets.randbits(63))
    digest = hashlib.sha256(f"lorafleet.sample|{seed}|{sample_index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _filter_top_k(scaled: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keeps each row's k best logits (k = 0: all); ties at the k-th value are all kept."""
    active = top_k > 0
    if not bool(active.any()):
        return scaled
    k_max = int(top_k.max())
    kth = torch.topk(scaled, k_max, dim=-1).values  # [R, k_max], descending
    threshold = kth.gather(1, (top_k.clamp(min=1) - 1).unsqueeze(1))
    threshold = torch.where(active.unsqueeze(1), threshold, torch.full_like(threshold, -torch.inf))
    return scaled.masked_fill(scaled < threshold, -torch.inf)


def _filter_top_p(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keeps the smallest set of best tokens whose probability reaches p (at least one)."""
    rows = torch.nonzero(top_p < 1.0).reshape(-1)
    if rows.numel() == 0:
        return scaled
    sub = scaled[rows]
    sorted_logits, order = torch.sort(sub, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    remove_sorted = mass_before >= top_p[rows].unsqueeze(1)
    remove_sorted[:, 0] = False
    remove = torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)
    out = scaled.clone()
    out[rows] = sub.masked_fill(remove, -torch.inf)
    return out


CDF_CHUNK = 1024
"""Vocabulary chunk of the two-level inverse CDF (see `_inverse_cdf`)."""


def _inverse_cdf(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds draw * total mass.

    A float64 softmax and cumsum over the whole vocabulary, for every row and step, cost a
    third of a SmolLM2 decode step; instead the mass is summed per chunk of `CDF_CHUNK` tokens,
    the chunk holding the draw is found on that short float64 CDF, and only that chunk is
    cumsummed (in float64). Tokens with zero probability (filtered out) are never returned.
    """
    rows, vocab = probs.shape
    num_chunks = -(-vocab // CDF_CHUNK)
    padded = (
        torch.nn.functional.pad(probs, (0, num_chunks * CDF_CHUNK - vocab))
        if vocab % CDF_CHUNK
        else probs
    )
    chunks = padded.view(rows, num_chunks, CDF_CHUNK)
    chunk_cdf = chunks.sum(-1).to(torch.float64).cumsum(-1)  # [R, C]
    total = chunk_cdf[:, -1:]
    # Strictly below the total, so the chunk found has non-zero mass.
    targets = torch.minimum(
        draws.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total))
    )
    chunk = torch.searchsorted(chunk_cdf, targets, right=True).clamp_(max=num_chunks - 1)  # [R, 1]
    before = torch.where(
        chunk > 0, chunk_cdf.gather(1, (chunk - 1).clamp(min=0)), torch.zeros_like(targets)
    )
    picked_chunk = chunks.gather(1, chunk.unsqueeze(2).expand(rows, 1, CDF_CHUNK)).squeeze(
        1
    )  # [R, CHUNK]
    within = before + picked_chunk.to(torch.float64).cumsum(-1)
    index = torch.searchsorted(within, targets, right=True)
    # Summation order differs between the chunk total and its cumsum, so a draw at the very top
    # of a chunk can land one past its end: take the chunk's last token with non-zero mass.
    positions = torch.arange(CDF_CHUNK, device=probs.device).expand(rows, CDF_CHUNK)
    last_nonzero = torch.where(picked_chunk > 0, positions, torch.full_like(positions, -1)).amax(
        -1, keepdim=True
    )
    index = torch.minimum(index, last_nonzero)
    return (chunk * CDF_CHUNK + index).squeeze(1)


def draw_uniforms(
    temperature: Sequence[float], generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """One uniform in [0, 1) per row that samples (temperature > 0), from that row's own
    generator; greedy rows draw nothing (0.0). Drawn apart from the token choice, so that a
    choice that is redone (a batch that failed, retried row by row) reuses the same numbers."""
    values = [
        float(torch.rand(1, generator=generators[r], dtype=torch.float64)) if t > 0 else 0.0
        for r, t in enumerate(temperature)
    ]
    return torch.tensor(values, dtype=torch.float64)


def choose_tokens(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    generators: Sequence[torch.Generator],
) -> torch.Tensor:
    """Next token per row of fp32 `logits` [R, V]; row r follows its own params and generator."""
    return choose_tokens_drawn(
        logits, temperature, top_k, top_p, draw_uniforms(temperature, generators)
    )


def choose_tokens_drawn(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    draws: torch.Tensor,
) -> torch.Tensor:
    """`choose_tokens` with each sampling row's uniform already drawn (`draw_uniforms`)."""
    rows, vocab = logits.shape
    random_rows = [r for r in range(rows) if temperature[r] > 0]
    if len(random_rows) < rows:
        chosen = torch.argmax(logits, dim=-1)
    else:
        chosen = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not random_rows:
        return chosen
    device = logits.device
    every_row = len(random_rows) == rows
    idx = torch.tensor(random_rows, dtype=torch.int64, device=device)
    temps = torch.tensor([temperature[r] for r in random_rows], dtype=torch.float32, device=device)
    ks = torch.tensor([top_k[r] for r in random_rows], dtype=torch.int64, device=device)
    ps = torch.tensor([top_p[r] for r in random_rows], dtype=torch.float32, device=device)
    subset = logits if every_row else logits.index_select(0, idx)
    scaled = subset.float() / temps.unsqueeze(1)
    scaled = _filter_top_p(_filter_top_k(scaled, ks), ps)
    probs = torch.softmax(scaled, dim=-1)
    row_draws = draws if every_row else draws.index_select(0, torch.tensor(random_rows))
    picked = _inverse_cdf(probs, row_draws.to(device)).clamp_(max=vocab - 1)
    if every_row:
        return picked
    chosen[idx] = picked
    return chosen


def alternatives_generator(seed: int | None) -> torch.Generator:
    """The RNG of a request's `prompt_alt_tokens` draws: a stream of its own, so asking for
    them never changes which tokens the request's sequences sample."""
    if seed is None:
        return torch.Generator().manual_seed(secrets.randbits(63))
    digest = hashlib.sha256(f"lorafleet.prompt_alt|{seed}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


ALT_CHUNK_ELEMENTS = 1 << 22
"""Rows x vocabulary of one float64 CDF in `draw_alternatives` (bounds its scratch memory)."""


def draw_alternatives(
    logprobs: torch.Tensor, temperature: float, k: int, generator: torch.Generator
) -> torch.Tensor:
    """`k` draws with replacement per row of log-probs [R, V] at `temperature` (0: the argmax,
    k times), int64 [R, k]. All uniforms come from `generator` up front, on the CPU, so the
    draws do not depend on the device or on how the rows are chunked."""
    rows, vocab = logprobs.shape
    device = logprobs.device
    if temperature == 0:
        return logprobs.argmax(dim=-1, keepdim=True).expand(rows, k).contiguous()
    draws = torch.rand((rows, k), generator=generator, dtype=torch.float64).to(device)
    out = torch.empty((rows, k), dtype=torch.int64, device=device)
    step = max(1, ALT_CHUNK_ELEMENTS // vocab)
    for start in range(0, rows, step):
        part = slice(start, start + step)
        probs = torch.softmax(logprobs[part] / temperature, dim=-1)
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        total = cdf[:, -1:]
        # Strictly below the total, so the token found has non-zero probability.
        below = torch.nextafter(total, torch.zeros_like(total))
        targets = torch.minimum(draws[part] * total, below)
        out[part] = torch.searchsorted(cdf, targets, right=True).clamp_(max=vocab - 1)
    return out


def gather_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def topk_lists(logprobs: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Per row, the k most likely (token, log-prob) pairs, best first."""
    values, ids = torch.topk(logprobs, k, dim=-1)
    return [
        list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)
    ]
