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


def choose_tokens(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    generators: Sequence[torch.Generator],
) -> torch.Tensor:
    """Next token per row of fp32 `logits` [R, V]; row r follows its own params and generator."""
    rows, vocab = logits.shape
    chosen = torch.argmax(logits, dim=-1)
    random_rows = [r for r in range(rows) if temperature[r] > 0]
    if not random_rows:
        return chosen
    idx = torch.tensor(random_rows, dtype=torch.int64, device=logits.device)
    temps = torch.tensor([temperature[r] for r in random_rows], dtype=torch.float32, device=logits.device)
    ks = torch.tensor([top_k[r] for r in random_rows], dtype=torch.int64, device=logits.device)
    ps = torch.tensor([top_p[r] for r in random_rows], dtype=torch.float32, device=logits.device)
    scaled = logits[idx].float() / temps.unsqueeze(1)
    scaled = _filter_top_p(_filter_top_k(scaled, ks), ps)
    probs = torch.softmax(scaled, dim=-1, dtype=torch.float64)
    cdf = torch.cumsum(probs, dim=-1)
    draws = torch.cat([torch.rand(1, generator=generators[r], dtype=torch.float64) for r in random_rows])
    total = cdf[:, -1:]
    # Strictly below the total, so the first index whose CDF exceeds it has non-zero probability.
    targets = torch.minimum(draws.to(cdf.device).unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=vocab - 1)
    chosen[idx] = picked
    return chosen


def gather_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def topk_lists(logprobs: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Per row, the k most likely (token, log-prob) pairs, best first."""
    values, ids = torch.topk(logprobs, k, dim=-1)
    return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
