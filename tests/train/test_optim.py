"""BankAdamW must behave, slot by slot, like stock torch AdamW on that adapter alone."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lorafleet.train.optim import AdamHParams, BankAdamW

# Deliberately not a multiple of any SIMD width so vector tails are exercised.
P = 1037
NUM_SLOTS = 6

# Four slots with different everything; slot 3's clip is above its grad norm (clamped
# coefficient of 1), slot 4 uses beta1=0 (lerp weight 1) and a tiny clip.
HPARAMS = {
    1: AdamHParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1),
    2: AdamHParams(
        learning_rate=3e-3, beta1=0.8, beta2=0.999, eps=1e-6, weight_decay=0.0, grad_clip_norm=0.5
    ),
    3: AdamHParams(
        learning_rate=1e-1, beta1=0.3, beta2=0.5, eps=1e-12, weight_decay=0.01, grad_clip_norm=1e3
    ),
    4: AdamHParams(
        learning_rate=5e-4, beta1=0.0, beta2=0.0, eps=1e-3, weight_decay=1.0, grad_clip_norm=2.0
    ),
}

# A LoRA-like split of one adapter row: (A [r, d_in], B [d_out, r]) for three modules.
SPLIT_SHAPES = [(4, 50), (60, 4), (4, 33), (21, 4), (4, 64), (64, 4)]
SPLIT_P = sum(a * b for a, b in SPLIT_SHAPES)


class TorchAdapter:
    """Reference: one adapter trained alone with torch AdamW (+ clip_grad_norm_)."""

    def __init__(
        self,
        row: torch.Tensor,
        hp: AdamHParams,
        shapes: list[tuple[int, ...]] | None = None,
        foreach: bool | None = None,
        fused: bool | None = True,
    ) -> None:
        shapes = shapes or [(row.numel(),)]
        sizes = [math.prod(s) for s in shapes]
        self.sizes = sizes
        self.hp = hp
        self.params = [
            torch.nn.Parameter(chunk.clone().view(shape))
            for chunk, shape in zip(row.split(sizes), shapes, strict=True)
        ]
        self.opt = torch.optim.AdamW(
            self.params,
            lr=hp.learning_rate,
            betas=(hp.beta1, hp.beta2),
            eps=hp.eps,
            weight_decay=hp.weight_decay,
            foreach=foreach,
            fused=fused,
        )
        self.last_total_norm: float | None = None

    def step(self, grad_row: torch.Tensor) -> None:
        for p, g in zip(self.params, grad_row.split(self.sizes), strict=True):
            p.grad = g.clone().view_as(p)
        if self.hp.grad_clip_norm > 0:
            self.last_total_norm = float(
                torch.nn.utils.clip_grad_norm_(self.params, self.hp.grad_clip_norm)
            )
        self.opt.step()

    def row(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def moments(self) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        states = [self.opt.state[p] for p in self.params]
        return (
            torch.cat([s["exp_avg"].reshape(-1) for s in states]),
            torch.cat([s["exp_avg_sq"].reshape(-1) for s in states]),
            [float(s["step"]) for s in states],
        )


def make_bank(p: int = P, seed: int = 0) -> BankAdamW:
    gen = torch.Generator().manual_seed(seed)
    params = torch.randn(NUM_SLOTS, p, generator=gen)
    params[0].zero_()
    return BankAdamW(params, torch.zeros(NUM_SLOTS, p))


def snapshot(opt: BankAdamW) -> dict[str, torch.Tensor]:
    return {
        "params": opt.params.clone(),
        "grads": opt.grads.clone(),
        "exp_avg": opt.exp_avg.clone(),
        "exp_avg_sq": opt.exp_avg_sq.clone(),
        "step_count": opt.step_count.clone(),
        "pending": opt.pending.clone(),
    }


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} changed"


def backward(opt: BankAdamW, slots: list[int], gen: torch.Generator, scale: float = 3.0) -> None:
    """Stand-in for the engine: accumulate a random gradient into some slots' rows."""
    for s in slots:
        opt.grads[s] += scale * torch.randn(opt.row_size, generator=gen)
    opt.note_gradient(slots)


# Slot layouts for the same four hyper-parameter sets: a contiguous run (stepped in
# place through views) and a scattered, unsorted one (gathered and scattered back).
LAYOUTS = {"contiguous": [1, 2, 3, 4], "scattered": [5, 3, 1, 4]}


IMPLS = {
    "fused": {"fused": True},
    "foreach": {"foreach": True, "fused": False},
    "single": {"foreach": False, "fused": False},
}


def _same(actual: torch.Tensor, expected: torch.Tensor, exact: bool) -> None:
    if exact:
        assert torch.equal(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_matches_torch_adamw_single_tensor(impl: str, layout: str) -> None:
    """Bit-exact with torch's fused AdamW; equal to float32 rounding with the others."""
    exact = impl == "fused"
    slots = LAYOUTS[layout]
    hparams = dict(zip(slots, HPARAMS.values(), strict=True))
    opt = make_bank()
    refs = {s: TorchAdapter(opt.params[s], hp, **IMPLS[impl]) for s, hp in hparams.items()}
    untouched = {s: opt.params[s].clone() for s in range(NUM_SLOTS) if s not in hparams}
    gen = torch.Generator().manual_seed(1)
    for it in range(5):
        backward(opt, slots, gen)
        grads = opt.grads.clone()
        metrics = opt.step(hparams)
        for s, ref in refs.items():
            ref.step(grads[s])
            _same(opt.params[s], ref.row(), exact)
            exp_avg, exp_avg_sq, steps = ref.moments()
            _same(opt.exp_avg[s], exp_avg, exact)
            _same(opt.exp_avg_sq[s], exp_avg_sq, exact)
            assert steps == [it + 1.0] and opt.slot_step(s) == it + 1
            assert metrics[s]["step"] == it + 1
            assert metrics[s]["skipped"] == 0.0
            assert metrics[s]["learning_rate"] == hparams[s].learning_rate
            assert metrics[s]["grad_norm"] == pytest.approx(float(grads[s].norm()), rel=1e-6)
            if ref.last_total_norm is not None:
                assert metrics[s]["grad_norm"] == ref.last_total_norm
        assert not opt.grads.any(), "stepped gradient rows must be zeroed"
    for s, row in untouched.items():
        assert torch.equal(opt.params[s], row)
    # The clip actually bit for the 2nd and 4th sets, and was a no-op for the 3rd.
    coefs = [metrics[s]["grad_clip_coef"] for s in slots]
    assert coefs[0] == 1.0 and coefs[1] < 1 and coefs[2] == 1.0 and coefs[3] < 1


def test_random_schedule_matches_torch_per_slot() -> None:
    """Slots step at their own pace, in varying subsets (both code paths, growing scratch)."""
    opt = make_bank()
    hp_cycle = list(HPARAMS.values())
    hparams = {s: hp_cycle[s % len(hp_cycle)] for s in range(1, NUM_SLOTS)}
    refs = {s: TorchAdapter(opt.params[s], hp, fused=True) for s, hp in hparams.items()}
    gen = torch.Generator().manual_seed(13)
    for _ in range(12):
        chosen = torch.randperm(NUM_SLOTS - 1, generator=gen)[
            : int(torch.randint(1, NUM_SLOTS, (1,), generator=gen))
        ]
        slots = [int(i) + 1 for i in chosen]
        with_grad = [s for s in slots if torch.rand(1, generator=gen) < 0.8]
        backward(opt, with_grad, gen)
        grads = opt.grads.clone()
        metrics = opt.step({s: hparams[s] for s in slots})
        for s in slots:
            if s in with_grad:
                refs[s].step(grads[s])
                assert metrics[s]["skipped"] == 0.0
            else:
                assert metrics[s]["skipped"] == 1.0
    for s, ref in refs.items():
        assert torch.equal(opt.params[s], ref.row()), f"slot {s}"
        assert opt.slot_step(s) == ref.opt.state[ref.params[0]].get("step", 0)


@pytest.mark.parametrize("foreach", [False, None, True])
def test_matches_torch_adamw_split_into_lora_tensors(foreach: bool | None) -> None:
    """Per-slot clipping uses the norm over the whole row = torch's global norm over
    all of that adapter's tensors (equal up to summation-order rounding)."""
    opt = make_bank(SPLIT_P)
    refs = {
        s: TorchAdapter(opt.params[s], hp, shapes=SPLIT_SHAPES, foreach=foreach, fused=False)
        for s, hp in HPARAMS.items()
    }
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        backward(opt, list(HPARAMS), gen)
        grads = opt.grads.clone()
        metrics = opt.step(HPARAMS)
        for s, ref in refs.items():
            ref.step(grads[s])
            torch.testing.assert_close(opt.params[s], ref.row(), rtol=1e-6, atol=1e-7)
            exp_avg, exp_avg_sq, _ = ref.moments()
            torch.testing.assert_close(opt.exp_avg[s], exp_avg, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(opt.exp_avg_sq[s], exp_avg_sq, rtol=1e-6, atol=1e-7)
            if ref.last_total_norm is not None:
                assert metrics[s]["grad_norm"] == pytest.approx(ref.last_total_norm, rel=1e-6)


@pytest.mark.parametrize("slots", [[1, 2], [2], [2, 4]])
def test_metrics_describe_the_update(slots: list[int]) -> None:
    """Covers steps with and without weight decay, contiguous and scattered."""
    opt = make_bank()
    gen = torch.Generator().manual_seed(3)
    backward(opt, slots, gen)
    grads = opt.grads.clone()
    before = opt.params.clone()
    metrics = opt.step({s: HPARAMS[s] for s in slots})
    for s in slots:
        m = metrics[s]
        assert m["grad_norm"] == pytest.approx(float(grads[s].norm()), rel=1e-6)
        assert not torch.equal(opt.params[s], before[s])
        assert m["param_norm"] == pytest.approx(float(opt.params[s].norm()), rel=1e-6)
        json.dumps(m)  # plain floats, ready for the API
    expected_coef = min(1.0, 0.5 / (float(grads[2].norm()) + 1e-6))
    assert metrics[2]["grad_clip_coef"] == pytest.approx(expected_coef, rel=1e-6)


@pytest.mark.parametrize("subset", [[2, 4], [3, 4]])
def test_stepping_a_subset_leaves_other_slots_bit_identical(subset: list[int]) -> None:
    opt = make_bank()
    gen = torch.Generator().manual_seed(4)
    backward(opt, [1, 2, 3, 4, 5], gen)
    opt.step(HPARAMS)  # give every slot non-trivial moments and step counts
    backward(opt, [1, 2, 3, 4, 5], gen)
    before = snapshot(opt)
    opt.step({s: HPARAMS[s] for s in subset})
    after = snapshot(opt)
    for s in range(NUM_SLOTS):
        if s in subset:
            continue
        for key in ("params", "grads", "exp_avg", "exp_avg_sq", "step_count", "pending"):
            assert torch.equal(before[key][s], after[key][s]), f"slot {s} {key} changed"
    for s in subset:
        assert not torch.equal(before["params"][s], after["params"][s])
        assert not after["grads"][s].any() and not after["pending"][s]
        assert after["step_count"][s] == 2
    expected_steps = [0, 1, 1, 1, 1, 0]
    for s in subset:
        expected_steps[s] = 2
    assert after["step_count"].tolist() == expected_steps
    assert after["pending"].tolist() == [s not in subset and s != 0 for s in range(NUM_SLOTS)]


def test_slot_without_pending_gradient_is_not_moved() -> None:
    opt = make_bank()
    gen = torch.Generator().manual_seed(5)
    backward(opt, [1], gen)
    opt.step({1: HPARAMS[1]})
    backward(opt, [2], gen)
    before = snapshot(opt)
    metrics = opt.step({1: HPARAMS[1], 2: HPARAMS[2]})
    # Slot 1 has weight decay; stepping it again without a backward would shrink it.
    assert metrics[1] == {"skipped": 1.0, "step": 1.0, "learning_rate": 1e-2}
    assert metrics[2]["skipped"] == 0.0
    assert torch.equal(opt.params[1], before["params"][1])
    assert torch.equal(opt.exp_avg[1], before["exp_avg"][1])
    assert torch.equal(opt.exp_avg_sq[1], before["exp_avg_sq"][1])
    assert (opt.slot_step(1), opt.slot_step(2), opt.slot_step(3)) == (1, 1, 0)
    assert not opt.has_pending_gradient(1) and not opt.has_pending_gradient(2)


def test_zero_gradient_from_a_backward_still_counts() -> None:
    """torch AdamW applies weight decay and moment decay on an all-zero grad; so must we."""
    opt = make_bank()
    hp = HPARAMS[1]
    ref = TorchAdapter(opt.params[1], hp)
    gen = torch.Generator().manual_seed(6)
    backward(opt, [1], gen)
    grads = opt.grads.clone()
    opt.step({1: hp})
    ref.step(grads[1])
    opt.note_gradient([1])  # a backward ran, but its gradient is exactly zero
    assert opt.has_pending_gradient(1)
    metrics = opt.step({1: hp})
    ref.step(torch.zeros(P))
    assert metrics[1]["skipped"] == 0.0 and metrics[1]["grad_norm"] == 0.0
    assert torch.equal(opt.params[1], ref.row())
    assert opt.slot_step(1) == 2


def test_zero_padded_region_stays_exactly_zero() -> None:
    """Parameters beyond an adapter's rank have zero value and gradient; nothing may leak in."""
    opt = make_bank()
    pad = torch.zeros(P, dtype=torch.bool)
    pad[100:300] = True
    pad[-37:] = True
    opt.params[:, pad] = 0.0
    gen = torch.Generator().manual_seed(7)
    for _ in range(4):
        backward(opt, list(HPARAMS), gen)
        opt.grads[:, pad] = 0.0
        opt.step(HPARAMS)
        padded = opt.params[:, pad]
        assert torch.equal(padded, torch.zeros_like(padded))
        assert not torch.signbit(padded).any(), "no -0.0 either"
        assert not opt.exp_avg[:, pad].any() and not opt.exp_avg_sq[:, pad].any()
    assert opt.params[1:5, ~pad].ne(0).all()


BAD_HPARAMS = [
    ("learning_rate", -1e-3),
    ("learning_rate", float("nan")),
    ("learning_rate", float("inf")),
    ("beta1", 1.0),
    ("beta1", -0.1),
    ("beta2", 1.5),
    ("beta2", float("nan")),
    ("eps", 0.0),
    ("eps", -1e-8),
    ("weight_decay", -0.1),
    ("grad_clip_norm", -1.0),
    ("grad_clip_norm", float("nan")),
]


@pytest.mark.parametrize(("field", "value"), BAD_HPARAMS)
def test_invalid_hparams_raise_and_change_nothing(field: str, value: float) -> None:
    opt = make_bank()
    gen = torch.Generator().manual_seed(8)
    backward(opt, [1, 2, 3], gen)
    opt.step({1: HPARAMS[1]})
    backward(opt, [1, 2, 3], gen)
    before = snapshot(opt)
    bad = AdamHParams(**{**HPARAMS[3].to_dict(), field: value})
    with pytest.raises(ValueError, match=field) as info:
        opt.step({1: HPARAMS[1], 2: HPARAMS[2], 3: bad})  # valid slots come first
    assert str(value) in str(info.value) and "slot 3" in str(info.value)
    assert_same_state(before, snapshot(opt))


@pytest.mark.parametrize("slot", [0, NUM_SLOTS, -1, 99])
def test_unknown_slot_raises_and_changes_nothing(slot: int) -> None:
    opt = make_bank()
    gen = torch.Generator().manual_seed(9)
    backward(opt, [1, 2], gen)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=f"slot {slot}"):
        opt.step({1: HPARAMS[1], slot: HPARAMS[2]})
    with pytest.raises(ValueError, match=f"slot {slot}"):
        opt.note_gradient([3, slot])
    for method in (opt.has_pending_gradient, opt.slot_step, opt.reset_slot, opt.slot_state):
        with pytest.raises(ValueError, match=f"slot {slot}"):
            method(slot)
    with pytest.raises(ValueError, match=f"slot {slot}"):
        opt.load_slot_state(slot, opt.slot_state(1))
    assert_same_state(before, snapshot(opt))


def test_non_integer_slot_and_non_hparams_rejected() -> None:
    opt = make_bank()
    with pytest.raises(ValueError, match="slot"):
        opt.note_gradient([1.5])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="slot True"):
        opt.slot_step(True)
    with pytest.raises(ValueError, match="AdamHParams"):
        opt.step({1: {"learning_rate": 1e-3}})  # type: ignore[dict-item]
    opt.note_gradient([1])
    before = snapshot(opt)
    with pytest.raises(ValueError, match="slot 1 requested more than once"):
        opt.step({1: HPARAMS[1], torch.tensor(1): HPARAMS[2]})  # type: ignore[dict-item]
    assert_same_state(before, snapshot(opt))


def test_slot_state_round_trip_into_another_slot_is_bit_exact() -> None:
    opt = make_bank()
    hp = HPARAMS[2]
    gen = torch.Generator().manual_seed(10)
    for _ in range(3):
        backward(opt, [1], gen)
        opt.step({1: hp})
    state = opt.slot_state(1)
    assert state["step"].dtype == torch.int64 and state["step"].dim() == 0
    assert int(state["step"]) == 3 and state["exp_avg"].shape == (P,)
    # Copies: stepping the source afterwards must not alter the saved state.
    saved = {k: v.clone() for k, v in state.items()}

    opt.params[4] = opt.params[1]
    opt.load_slot_state(4, state)
    assert opt.slot_step(4) == 3
    for _ in range(3):
        g = torch.randn(P, generator=gen)
        opt.grads[1] = g
        opt.grads[4] = g
        opt.note_gradient([1, 4])
        opt.step({1: hp, 4: hp})
        assert torch.equal(opt.params[1], opt.params[4])
        assert torch.equal(opt.exp_avg[1], opt.exp_avg[4])
        assert torch.equal(opt.exp_avg_sq[1], opt.exp_avg_sq[4])
    assert opt.slot_step(1) == opt.slot_step(4) == 6
    for k in saved:
        assert torch.equal(state[k], saved[k])


def test_load_slot_state_validates_before_writing() -> None:
    opt = make_bank()
    gen = torch.Generator().manual_seed(11)
    backward(opt, [1], gen)
    opt.step({1: HPARAMS[1]})
    good = opt.slot_state(1)
    cases = [
        ({k: v for k, v in good.items() if k != "step"}, "keys"),
        ({**good, "extra": torch.zeros(1)}, "keys"),
        ({**good, "exp_avg": good["exp_avg"][:-1]}, r"exp_avg.*shape"),
        ({**good, "exp_avg_sq": good["exp_avg_sq"].double()}, r"exp_avg_sq.*float32"),
        ({**good, "exp_avg": good["exp_avg"].view(1, P)}, r"exp_avg.*shape"),
        ({**good, "exp_avg": good["exp_avg"].tolist()}, r"exp_avg.*tensor"),
        ({**good, "step": torch.tensor(3, dtype=torch.int32)}, r"step.*int64"),
        ({**good, "step": torch.tensor([3])}, r"step.*0-d"),
        ({**good, "step": torch.tensor(-1)}, r"step.*>= 0"),
        ({**good, "exp_avg_sq": -good["exp_avg_sq"] - 1}, "exp_avg_sq"),
        ({**good, "exp_avg": torch.full((P,), float("nan"))}, "exp_avg"),
    ]
    before = snapshot(opt)
    for state, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            opt.load_slot_state(2, state)
    assert_same_state(before, snapshot(opt))


def test_reset_slot_restarts_like_a_fresh_adamw() -> None:
    opt = make_bank()
    gen = torch.Generator().manual_seed(12)
    for _ in range(2):
        backward(opt, [3], gen)
        opt.step({3: HPARAMS[3]})
    backward(opt, [3], gen)
    opt.reset_slot(3)
    assert opt.slot_step(3) == 0 and not opt.has_pending_gradient(3)
    assert not opt.grads[3].any() and not opt.exp_avg[3].any() and not opt.exp_avg_sq[3].any()
    ref = TorchAdapter(opt.params[3], HPARAMS[3])
    backward(opt, [3], gen)
    grads = opt.grads.clone()
    opt.step({3: HPARAMS[3]})
    ref.step(grads[3])
    assert torch.equal(opt.params[3], ref.row())


def test_empty_and_all_skipped_steps_are_no_ops() -> None:
    opt = make_bank()
    before = snapshot(opt)
    assert opt.step({}) == {}
    assert opt.step({1: HPARAMS[1], 2: HPARAMS[2]}) == {
        1: {"skipped": 1.0, "step": 0.0, "learning_rate": 1e-2},
        2: {"skipped": 1.0, "step": 0.0, "learning_rate": 3e-3},
    }
    assert_same_state(before, snapshot(opt))


def test_params_and_grads_are_updated_in_place() -> None:
    """Per-layer nn.Parameters and their .grad are views into the banks."""
    opt = make_bank()
    layer_param = opt.params[2, 10:20].view(2, 5)
    layer_grad = opt.grads[2, 10:20].view(2, 5)
    layer_grad.fill_(1.0)
    opt.note_gradient([2])
    before = layer_param.clone()
    opt.step({2: HPARAMS[2]})
    assert not torch.equal(layer_param, before)
    assert not layer_grad.any()


def test_constructor_rejects_mismatched_banks() -> None:
    with pytest.raises(ValueError, match="2-D"):
        BankAdamW(torch.zeros(P), torch.zeros(P))
    with pytest.raises(ValueError, match="float32"):
        BankAdamW(torch.zeros(2, P, dtype=torch.float64), torch.zeros(2, P, dtype=torch.float64))
    with pytest.raises(ValueError, match="grads must match"):
        BankAdamW(torch.zeros(2, P), torch.zeros(3, P))


def test_hparams_dict_round_trip_and_validation() -> None:
    for hp in HPARAMS.values():
        data = json.loads(json.dumps(hp.to_dict()))
        assert AdamHParams.from_dict(data) == hp
    assert AdamHParams.from_dict({"learning_rate": 1e-4}) == AdamHParams(learning_rate=1e-4)
    with pytest.raises(ValueError, match="lr"):
        AdamHParams.from_dict({"learning_rate": 1e-4, "lr": 1e-3})
    with pytest.raises(ValueError, match="learning_rate"):
        AdamHParams.from_dict({"beta1": 0.9})
    with pytest.raises(ValueError, match="beta2"):
        AdamHParams.from_dict({"learning_rate": 1e-4, "beta2": 1.0})
    with pytest.raises(ValueError, match="weight_decay"):
        AdamHParams(learning_rate=1e-3, weight_decay="0.1").validate()  # type: ignore[arg-type]
    AdamHParams(learning_rate=0.0, beta1=0.0, beta2=0.0).validate()  # boundaries are legal
