"""TrainEngine: mixed-adapter steps equal solo training; bad inputs change nothing."""

from __future__ import annotations

import pytest
import torch

from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.train.engine import TrainEngine, TrainInputError, TrainItem
from lorafleet.train.layout import plan_microbatches
from lorafleet.train.optim import AdamHParams
from tests._models import tiny_qwen3

VOCAB = 96
ADAPTERS = [
    (AdapterSpec(rank=2, alpha=4.0, seed=1), AdamHParams(learning_rate=1e-2)),
    (AdapterSpec(rank=4, alpha=8.0, seed=2), AdamHParams(learning_rate=3e-3, weight_decay=0.1)),
    (
        AdapterSpec(rank=8, alpha=8.0, use_rslora=True, seed=3),
        AdamHParams(learning_rate=2e-2, grad_clip_norm=0.5),
    ),
    (AdapterSpec(rank=3, alpha=6.0, seed=4), AdamHParams(learning_rate=5e-3, beta2=0.999)),
]


def make_engine(num_slots=8, token_budget=4096) -> TrainEngine:
    model = tiny_qwen3()
    adapted = AdaptedModel(model, resolve_tinker_targets(model))
    adapted.add_bank("train", num_slots=num_slots, r_max=8)
    return TrainEngine(adapted, base_model_id="tiny-test", token_budget=token_budget)


def sft_item(slot: int, seed: int, length: int = 7) -> TrainItem:
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (length + 1,), generator=gen)
    weights = (torch.rand(length, generator=gen) > 0.3).float()
    return TrainItem(
        slot, seq[:-1], "cross_entropy", {"target_tokens": seq[1:], "weights": weights}
    )


def rl_item(slot: int, seed: int, loss_fn: str, length: int = 6) -> TrainItem:
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (length + 1,), generator=gen)
    inputs = {
        "target_tokens": seq[1:],
        "logprobs": -torch.rand(length, generator=gen) * 5,
        "advantages": torch.randn(length, generator=gen),
    }
    return TrainItem(slot, seq[:-1], loss_fn, inputs)


def items_for(adapter_index: int, slot: int, step: int) -> list[TrainItem]:
    base = 1000 * adapter_index + 10 * step
    kinds = ["cross_entropy", "importance_sampling", "ppo", "cispo"]
    items = [sft_item(slot, base + 1, length=5 + adapter_index), sft_item(slot, base + 2, length=9)]
    items.append(
        rl_item(slot, base + 3, kinds[adapter_index])
        if adapter_index
        else sft_item(slot, base + 3, 3)
    )
    return items


def test_mixed_step_over_four_adapters_equals_training_each_alone():
    mixed = make_engine()
    slots = [mixed.create_adapter(spec) for spec, _ in ADAPTERS]
    for step in range(3):
        batch = [item for i, slot in enumerate(slots) for item in items_for(i, slot, step)]
        out = mixed.forward_backward(batch)
        assert out.slots == tuple(slots)
        metrics = mixed.optim_step(
            {slot: hp for slot, (_, hp) in zip(slots, ADAPTERS, strict=True)}
        )
        assert set(metrics) == set(slots)
    for i, (spec, hp) in enumerate(ADAPTERS):
        solo = make_engine()
        slot = solo.create_adapter(spec, slot=7 - i)  # another slot: placement must not matter
        for step in range(3):
            solo.forward_backward(items_for(i, slot, step))
            solo.optim_step({slot: hp})
        ours, theirs = mixed.bank.slot_weights(slots[i]), solo.bank.slot_weights(slot)
        moved = 0.0
        # Alone, every slot has the same token count (batched matmul); mixed, counts differ
        # (grouped matmul): fp32 last bits differ, and Adam's normalised step turns a last-bit
        # difference of a near-zero gradient into about 0.1% of one step (lr 5e-3 to 2e-2 here).
        for path, (A, B) in ours.items():
            torch.testing.assert_close(A, theirs[path][0], atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(B, theirs[path][1], atol=2e-5, rtol=1e-5)
            moved += float(B.abs().sum())
        assert moved > 0, f"adapter {i} did not train"
        assert mixed.optimizer.slot_step(slots[i]) == 3


def test_logprobs_match_a_direct_computation_and_forward_matches_forward_backward():
    engine = make_engine()
    slot = engine.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=5))
    with torch.no_grad():
        engine.bank.params[slot].normal_(0, 0.05)
    items = [sft_item(slot, 1), sft_item(0 + slot, 2, length=3)]
    fwd = engine.forward(items)
    assert engine.bank.grads.abs().max() == 0
    fb = engine.forward_backward(items)
    for item, a, b in zip(items, fwd.items, fb.items, strict=True):
        assert a.logprobs.shape == item.loss_inputs["target_tokens"].shape
        torch.testing.assert_close(a.logprobs, b.logprobs)
        with (
            torch.no_grad(),
            engine.adapted.routing("train", torch.full((1, len(item.tokens)), slot)),
        ):
            logits = engine.adapted.model(item.tokens.unsqueeze(0)).logits[0]
        expected = (
            torch.log_softmax(logits, -1)
            .gather(-1, item.loss_inputs["target_tokens"].unsqueeze(-1))
            .squeeze(-1)
        )
        torch.testing.assert_close(a.logprobs, expected, atol=1e-5, rtol=1e-5)
        manual_loss = -(expected * item.loss_inputs["weights"]).sum()
        torch.testing.assert_close(
            torch.tensor(a.metrics["loss:sum"]), manual_loss, atol=1e-4, rtol=1e-5
        )
    assert fb.metrics["loss:sum"] == pytest.approx(
        sum(o.metrics["loss:sum"] for o in fb.items), rel=1e-6
    )


def test_microbatching_and_accumulation_give_the_same_gradients():
    items_a = [sft_item(1, s, length=4 + s % 5) for s in range(6)]
    items_b = [rl_item(2, 100 + s, "ppo") for s in range(3)]
    grads = []
    for budget, split in ((4096, False), (12, False), (4096, True)):
        engine = make_engine(token_budget=budget)
        engine.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=1), slot=1)
        engine.create_adapter(AdapterSpec(rank=2, alpha=2.0, seed=2), slot=2)
        with torch.no_grad():
            engine.bank.params[1:3].normal_(0, 0.05)
        if split:  # two calls accumulate like one
            engine.forward_backward(items_a)
            out = engine.forward_backward(items_b)
        else:
            out = engine.forward_backward(items_a + items_b)
            if budget == 12:
                assert out.num_microbatches > 3
        grads.append(engine.bank.grads.clone())
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grads[2], grads[0], atol=1e-5, rtol=1e-4)


def test_plan_microbatches_respects_budget():
    lengths = [5, 17, 3, 9, 9, 40, 1]
    plan = plan_microbatches(lengths, 20)
    assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
    for batch in plan:
        assert len(batch) == 1 or max(lengths[i] for i in batch) * len(batch) <= 20


def _state(engine):
    opt = engine.optimizer
    return [
        engine.bank.params.clone(),
        engine.bank.grads.clone(),
        opt.exp_avg.clone(),
        opt.exp_avg_sq.clone(),
    ]


BAD_ITEMS = [
    (
        "length",
        lambda s: TrainItem(
            s,
            [1, 2, 3],
            "cross_entropy",
            {"target_tokens": torch.tensor([1, 2]), "weights": torch.ones(2)},
        ),
        "target_tokens",
    ),
    (
        "vocab",
        lambda s: TrainItem(
            s,
            [1, VOCAB, 3],
            "cross_entropy",
            {"target_tokens": torch.tensor([1, 2, 3]), "weights": torch.ones(3)},
        ),
        f"token id {VOCAB}",
    ),
    (
        "negative-id",
        lambda s: TrainItem(
            s,
            [1, -4],
            "cross_entropy",
            {"target_tokens": torch.tensor([1, 2]), "weights": torch.ones(2)},
        ),
        "token id -4",
    ),
    (
        "target-vocab",
        lambda s: TrainItem(
            s,
            [1, 2],
            "cross_entropy",
            {"target_tokens": torch.tensor([1, 500]), "weights": torch.ones(2)},
        ),
        "500",
    ),
    (
        "nan-adv",
        lambda s: TrainItem(
            s,
            [1, 2],
            "importance_sampling",
            {
                "target_tokens": torch.tensor([1, 2]),
                "logprobs": torch.zeros(2),
                "advantages": torch.tensor([0.0, float("nan")]),
            },
        ),
        "advantages",
    ),
    (
        "inf-weights",
        lambda s: TrainItem(
            s,
            [1, 2],
            "cross_entropy",
            {"target_tokens": torch.tensor([1, 2]), "weights": torch.tensor([1.0, float("inf")])},
        ),
        "weights",
    ),
    (
        "unknown-loss",
        lambda s: TrainItem(s, [1, 2], "kl_magic", {"target_tokens": torch.tensor([1, 2])}),
        "kl_magic",
    ),
    (
        "unknown-slot",
        lambda s: TrainItem(
            5,
            [1, 2],
            "cross_entropy",
            {"target_tokens": torch.tensor([1, 2]), "weights": torch.ones(2)},
        ),
        "slot 5",
    ),
    (
        "empty",
        lambda s: TrainItem(
            s,
            [],
            "cross_entropy",
            {"target_tokens": torch.tensor([], dtype=torch.long), "weights": torch.ones(0)},
        ),
        "empty",
    ),
    (
        "float-tokens",
        lambda s: TrainItem(
            s,
            torch.tensor([1.0, 2.0]),
            "cross_entropy",
            {"target_tokens": torch.tensor([1, 2]), "weights": torch.ones(2)},
        ),
        "integers",
    ),
]


@pytest.mark.parametrize("name,make_bad,expected", BAD_ITEMS, ids=[b[0] for b in BAD_ITEMS])
def test_bad_items_raise_clearly_and_change_nothing(name, make_bad, expected):
    engine = make_engine()
    slot = engine.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=1))
    engine.forward_backward([sft_item(slot, 1)])
    engine.optim_step({slot: AdamHParams(learning_rate=1e-2)})
    engine.forward_backward([sft_item(slot, 2)])
    before = _state(engine)
    with pytest.raises(ValueError, match=expected):
        engine.forward_backward([sft_item(slot, 3), make_bad(slot)])
    for a, b in zip(before, _state(engine), strict=True):
        assert torch.equal(a, b)


def test_non_finite_loss_in_a_later_microbatch_rolls_back_the_whole_call():
    engine = make_engine(token_budget=8)
    slot = engine.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=1))
    engine.forward_backward([sft_item(slot, 1)])
    before = _state(engine)
    overflow = rl_item(slot, 9, "importance_sampling", length=3)
    overflow.loss_inputs["logprobs"] = torch.full((3,), -1e4)  # exp(logp - logq) overflows
    overflow.loss_inputs["advantages"] = torch.ones(3)
    with pytest.raises(TrainInputError, match="not finite|inf"):
        engine.forward_backward([sft_item(slot, 2, length=7), overflow])
    for a, b in zip(before, _state(engine), strict=True):
        assert torch.equal(a, b)


def test_negative_learning_rate_changes_nothing():
    engine = make_engine()
    a = engine.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=1))
    b = engine.create_adapter(AdapterSpec(rank=2, alpha=8.0, seed=2))
    engine.forward_backward([sft_item(a, 1), sft_item(b, 2)])
    before = _state(engine)
    with pytest.raises(ValueError, match="learning_rate"):
        engine.optim_step({a: AdamHParams(learning_rate=1e-2), b: AdamHParams(learning_rate=-1.0)})
    for x, y in zip(before, _state(engine), strict=True):
        assert torch.equal(x, y)


def test_slot_without_gradient_is_not_moved_and_others_untouched():
    engine = make_engine()
    a = engine.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=1))
    b = engine.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=2))
    engine.forward_backward([sft_item(a, 1)])
    params_b = engine.bank.params[b].clone()
    metrics = engine.optim_step(
        {a: AdamHParams(learning_rate=1e-2), b: AdamHParams(learning_rate=1e-2)}
    )
    assert torch.equal(engine.bank.params[b], params_b)
    assert metrics[a]["grad_norm"] > 0
    assert engine.optimizer.slot_step(a) == 1 and engine.optimizer.slot_step(b) == 0


def test_topk_cross_entropy_targets_gather_k_logprobs_per_position():
    """[T, K] targets (the cookbook's top-k distillation) next to ordinary [T] items."""
    engine = make_engine()
    slot = engine.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=1))
    tokens = torch.tensor([3, 7, 11, 5])
    topk = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])
    weights = torch.rand(4, 3)
    item = TrainItem(slot, tokens, "cross_entropy", {"target_tokens": topk, "weights": weights})
    out = engine.forward_backward([sft_item(slot, 1), item])
    assert out.items[1].logprobs.shape == (4, 3)
    with torch.no_grad(), engine.adapted.routing("train", torch.full((1, 4), slot)):
        logp = torch.log_softmax(engine.adapted.model(tokens.unsqueeze(0)).logits[0], -1)
    torch.testing.assert_close(out.items[1].logprobs, logp.gather(-1, topk), atol=1e-5, rtol=1e-5)
    assert out.items[1].metrics["loss:sum"] == pytest.approx(
        float(-(logp.gather(-1, topk) * weights).sum()), rel=1e-5
    )


def test_forward_scores_the_base_model_on_slot_zero_and_training_it_is_refused():
    """Slot 0 is the frozen base: `forward` scores it (a weight sync checks an engine's base
    this way, also through a sharded trainer); gradients for it are a clear error."""
    engine = make_engine()
    slot = engine.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=1))
    gen = torch.Generator().manual_seed(3)
    # a non-zero B, so that the adapter differs from the base
    weights = {
        p: (A, torch.randn(B.shape, generator=gen))
        for p, (A, B) in engine.bank.slot_weights(slot).items()
    }
    engine.bank.load_slot_weights(slot, weights)
    item = sft_item(0, 5)
    out = engine.forward([item, sft_item(slot, 5)])
    ids = item.tokens.unsqueeze(0)
    with engine.adapted.routing("train", torch.zeros_like(ids)), torch.no_grad():
        logits = engine.adapted.model(input_ids=ids).logits.float()
    want = torch.log_softmax(logits, -1)[0].gather(
        -1, item.loss_inputs["target_tokens"].unsqueeze(-1)
    )
    torch.testing.assert_close(out.items[0].logprobs, want.squeeze(-1), atol=1e-5, rtol=0)
    assert not torch.allclose(out.items[0].logprobs, out.items[1].logprobs, atol=1e-3)
    with pytest.raises(TrainInputError, match="slot 0"):
        engine.forward_backward([item])
    with pytest.raises(TrainInputError, match="slot 0"):
        engine.prepare([item])  # the default (what a server uses) never admits the base
