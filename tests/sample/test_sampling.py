"""Token choice: greedy, temperature, top-k, top-p, and per-sequence reproducible RNG."""

from __future__ import annotations

import torch

from lorafleet.sample.sampling import choose_tokens, sequence_generator

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def draw(
    n: int, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0
) -> torch.Tensor:
    logits = LOGITS.expand(n, -1).clone()
    gens = [sequence_generator(seed, i) for i in range(n)]
    return choose_tokens(logits, [temperature] * n, [top_k] * n, [top_p] * n, gens)


def freq(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=4).float() / tokens.numel()


def test_temperature_one_follows_the_model_distribution():
    torch.testing.assert_close(freq(draw(4000)), PROBS, atol=0.03, rtol=0)


def test_temperature_zero_is_argmax_and_low_temperature_sharpens():
    assert draw(50, temperature=0.0).eq(0).all()
    sharp = PROBS**2 / (PROBS**2).sum()
    torch.testing.assert_close(freq(draw(4000, temperature=0.5)), sharp, atol=0.03, rtol=0)


def test_top_k_and_top_p_restrict_the_support():
    assert set(draw(500, top_k=2).tolist()) == {0, 1}
    assert set(draw(500, top_p=0.7).tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.8
    assert set(draw(200, top_p=0.5).tolist()) == {0}  # the best token alone reaches p
    torch.testing.assert_close(
        freq(draw(4000, top_k=2)), torch.tensor([0.625, 0.375, 0, 0]), atol=0.03, rtol=0
    )


def test_each_sequence_draws_from_its_own_stream_whatever_the_batch():
    n = 16
    logits = torch.randn(n, 50, generator=torch.Generator().manual_seed(0))
    temps = [0.0 if i % 4 == 0 else 1.0 for i in range(n)]
    ks = [0 if i % 3 else 5 for i in range(n)]
    ps = [1.0 if i % 2 else 0.8 for i in range(n)]
    together = choose_tokens(logits, temps, ks, ps, [sequence_generator(7, i) for i in range(n)])
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1)).tolist()
    shuffled = choose_tokens(
        logits[order],
        [temps[i] for i in order],
        [ks[i] for i in order],
        [ps[i] for i in order],
        [sequence_generator(7, i) for i in order],
    )
    assert shuffled.tolist() == [together[i].item() for i in order]
    alone = [
        choose_tokens(
            logits[i : i + 1], [temps[i]], [ks[i]], [ps[i]], [sequence_generator(7, i)]
        ).item()
        for i in range(n)
    ]
    assert alone == together.tolist()
    assert draw(64, seed=1).tolist() != draw(64, seed=2).tolist()


def test_two_level_inverse_cdf_equals_a_full_float64_cdf():
    from lorafleet.sample.sampling import CDF_CHUNK, _inverse_cdf

    gen = torch.Generator().manual_seed(7)
    vocab = 3 * CDF_CHUNK + 37  # not a multiple of the chunk
    logits = torch.randn(64, vocab, generator=gen) * 4
    logits[:, ::3] = -torch.inf  # filtered tokens must never come back
    logits[5, :] = -torch.inf
    logits[5, 2 * CDF_CHUNK + 5] = 0.0  # all the mass on one token
    probs = torch.softmax(logits, dim=-1)
    draws = torch.rand(64, generator=gen, dtype=torch.float64)
    draws[:3] = torch.tensor([0.0, 1.0 - 1e-16, 0.5])
    ours = _inverse_cdf(probs, draws)
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(
        draws.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total))
    )
    reference = torch.searchsorted(cdf, target, right=True).squeeze(1)
    assert torch.equal(ours, reference)
    assert bool((probs.gather(1, ours.unsqueeze(1)) > 0).all())
    assert int(ours[5]) == 2 * CDF_CHUNK + 5
