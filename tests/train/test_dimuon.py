"""BankDimuon against a straightforward per-matrix reference, on a fake bank layout whose B
views are strided like the real bank's (a stored rank above the adapter's)."""

from __future__ import annotations

import math

import pytest
import torch

from lorafleet.adapters.hparams import DimuonHParams
from lorafleet.train.dimuon import NS_COEFFICIENTS, NS_STEPS, BankDimuon, matrix_sign

R_STORE = 3
LAYERS = [(6, 5), (4, 7)]  # (in, out) of two adapted layers
SPAN = sum(R_STORE * i + o * R_STORE for i, o in LAYERS)
NUM_SLOTS = 4
RANKS = {1: 2, 2: 3, 3: 1}


def views(rank: int, row: torch.Tensor) -> list[torch.Tensor]:
    out, at = [], 0
    for fan_in, fan_out in LAYERS:
        out.append(row[at : at + R_STORE * fan_in].view(R_STORE, fan_in)[:rank])
        at += R_STORE * fan_in
        out.append(row[at : at + fan_out * R_STORE].view(fan_out, R_STORE)[:, :rank])
        at += fan_out * R_STORE
    return out


def layout(slot: int, row: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    return RANKS[slot], views(RANKS[slot], row)


def make(seed: int = 0) -> BankDimuon:
    gen = torch.Generator().manual_seed(seed)
    params = torch.zeros(NUM_SLOTS, SPAN)
    for slot, rank in RANKS.items():
        for v in views(rank, params[slot]):
            v.copy_(torch.randn(v.shape, generator=gen))
    return BankDimuon(params, torch.zeros_like(params), layout)


def fill_grads(opt: BankDimuon, slots: list[int], gen: torch.Generator) -> None:
    for slot in slots:
        for v in views(RANKS[slot], opt.grads[slot]):
            v.copy_(torch.randn(v.shape, generator=gen))
    opt.note_gradient(slots)


def ref_sign(m: torch.Tensor) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    x = m / (torch.linalg.matrix_norm(m) + 1e-7)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(NS_STEPS):
        g = x @ x.T
        x = a * x + (b * g + c * g @ g) @ x
    return x.T if tall else x


def ref_step(weights, moments, grads, rank: int, hp: DimuonHParams) -> None:
    """One slot, matrix by matrix, in place."""
    norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
    coef = min(1.0, hp.grad_clip_norm / (norm + 1e-6)) if hp.grad_clip_norm > 0 else 1.0
    for w, m, g in zip(weights, moments, grads, strict=True):
        m.mul_(hp.beta1).add_(g * coef, alpha=1 - hp.beta1)
        o = ref_sign(m)
        n = float(torch.linalg.matrix_norm(o))
        if n > 0:
            w.sub_(hp.learning_rate * math.sqrt(rank) * o / n)


HPS = {
    1: DimuonHParams(learning_rate=0.05, beta1=0.9),
    2: DimuonHParams(learning_rate=0.01, beta1=0.5, grad_clip_norm=0.5),
    3: DimuonHParams(learning_rate=0.2, beta1=0.0, grad_clip_norm=-1.0),
}


def test_matches_per_matrix_reference_over_steps() -> None:
    opt = make()
    ref_w = {s: [v.clone() for v in views(r, opt.params[s])] for s, r in RANKS.items()}
    ref_m = {s: [torch.zeros_like(v) for v in ref_w[s]] for s in RANKS}
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        fill_grads(opt, list(RANKS), gen)
        grads = {s: [v.clone() for v in views(r, opt.grads[s])] for s, r in RANKS.items()}
        metrics = opt.step(HPS)
        for s, r in RANKS.items():
            ref_step(ref_w[s], ref_m[s], grads[s], r, HPS[s])
            for got, want in zip(views(r, opt.params[s]), ref_w[s], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            assert metrics[s]["step"] == step + 1 and metrics[s]["skipped"] == 0.0
    assert metrics[2]["grad_clip_coef"] < 1.0 and metrics[3]["grad_clip_coef"] == 1.0
    # outside each adapter's rank the rows stay exactly zero
    for s, r in RANKS.items():
        rest = opt.params[s].clone()
        for v in views(r, rest):
            v.zero_()
        assert not bool(rest.any())


def test_update_has_frobenius_norm_lr_sqrt_rank() -> None:
    opt = make()
    before = opt.params.clone()
    fill_grads(opt, [2], torch.Generator().manual_seed(3))
    opt.step({2: DimuonHParams(learning_rate=0.1)})
    for got, old in zip(views(3, opt.params[2]), views(3, before[2]), strict=True):
        assert float(torch.linalg.matrix_norm(old - got)) == pytest.approx(
            0.1 * math.sqrt(3), rel=1e-5
        )


def test_matrix_sign_pushes_singular_values_towards_one() -> None:
    m = torch.randn(5, 8, 3, generator=torch.Generator().manual_seed(4))
    s = torch.linalg.svdvals(matrix_sign(m))
    assert float(s.min()) > 0.6 and float(s.max()) < 1.3


def test_zero_momentum_matrix_does_not_move() -> None:
    """LoRA's A has a zero gradient while B is zero: its direction is zero, not NaN."""
    opt = make()
    before = opt.params.clone()
    mats = views(2, opt.grads[1])
    mats[1].copy_(torch.ones_like(mats[1]))  # only the first layer's B gets a gradient
    opt.note_gradient([1])
    opt.step({1: DimuonHParams(learning_rate=0.1)})
    after, old = views(2, opt.params[1]), views(2, before[1])
    assert torch.equal(after[0], old[0]) and torch.equal(after[2], old[2])
    assert not torch.equal(after[1], old[1])
    assert bool(torch.isfinite(opt.params).all())


def test_subset_step_leaves_others_and_skips_slots_without_gradient() -> None:
    opt = make()
    fill_grads(opt, [1, 2], torch.Generator().manual_seed(5))
    before = opt.params.clone()
    metrics = opt.step({1: HPS[1], 3: HPS[3]})
    assert metrics[3] == {"skipped": 1.0, "step": 0.0, "learning_rate": 0.2}
    assert torch.equal(opt.params[2], before[2]) and torch.equal(opt.params[3], before[3])
    assert opt.has_pending_gradient(2) and not opt.has_pending_gradient(1)


@pytest.mark.parametrize(
    ("hp", "fragment"),
    [
        (DimuonHParams(learning_rate=-1.0), "learning_rate"),
        (DimuonHParams(learning_rate=0.1, beta1=1.0), "beta1"),
        (DimuonHParams(learning_rate=math.nan), "finite"),
    ],
)
def test_invalid_hparams_raise_and_change_nothing(hp: DimuonHParams, fragment: str) -> None:
    opt = make()
    fill_grads(opt, [1, 2], torch.Generator().manual_seed(6))
    before = (opt.params.clone(), opt.momentum.clone(), opt.grads.clone())
    with pytest.raises(ValueError, match=fragment):
        opt.step({1: HPS[1], 2: hp})
    assert torch.equal(opt.params, before[0]) and torch.equal(opt.momentum, before[1])
    assert torch.equal(opt.grads, before[2])


def test_slot_state_round_trip_is_bit_exact() -> None:
    a, b = make(), make()
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):
        fill_grads(a, [1], gen)
        a.step({1: HPS[1]})
    b.params.copy_(a.params)
    b.load_slot_state(1, a.slot_state(1))
    g = torch.Generator().manual_seed(8)
    fill_grads(a, [1], g)
    fill_grads(b, [1], torch.Generator().manual_seed(8))
    a.step({1: HPS[1]})
    b.step({1: HPS[1]})
    assert torch.equal(a.params, b.params) and b.slot_step(1) == 3
    with pytest.raises(ValueError, match="momentum"):
        b.load_slot_state(1, {"momentum": torch.zeros(3), "step": torch.tensor(1)})
