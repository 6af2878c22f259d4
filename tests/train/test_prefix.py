"""Shared-prefix forwards and the partial head: the engine's log-probs and bank gradients equal an
independent per-item computation (each item alone through the whole model), in fp32 within
1e-5 (log-probs) / 1e-5 + 1e-4 relative (gradients), and the prompt really runs once."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config

from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.loader import load_base
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.train.engine import TrainEngine, TrainInputError, TrainItem
from lorafleet.train.layout import (
    MIN_SHARED_PREFIX,
    Unit,
    find_groups,
    plan_units,
    tokens_run,
)
from lorafleet.train.loss_inputs import (
    LOSS_NAMES,
    SAMPLED_SEQUENCE,
    STABLE_REINFORCE,
    validate_loss,
)
from lorafleet.train.losses import compute_loss, gradient_mask

LOGPROB_TOL = {"atol": 1e-5, "rtol": 1e-5}
GRAD_TOL = {"atol": 1e-5, "rtol": 1e-4}
VOCAB = 500  # token ids drawn below every tiny preset's vocabulary

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_engine(preset: str, *, num_slots: int = 5, **flags) -> TrainEngine:
    model = load_base(preset).model
    adapted = AdaptedModel(model, resolve_tinker_targets(model))  # lm_head carries LoRA too
    adapted.add_bank("train", num_slots=num_slots, r_max=8)
    engine = TrainEngine(adapted, base_model_id=preset, **flags)
    for slot in range(1, num_slots):
        engine.create_adapter(AdapterSpec(rank=2 + 2 * (slot % 3), alpha=8.0, seed=slot), slot=slot)
    with torch.no_grad():  # B starts at zero; give every slot a non-trivial adapter
        engine.bank.params[1:].normal_(0, 0.05, generator=torch.Generator().manual_seed(7))
    return engine


def rl_inputs(loss_fn: str, tokens: torch.Tensor, prompt: int, gen: torch.Generator) -> dict:
    """Cookbook-shaped loss inputs: nothing to learn on the prompt (advantage or weight 0)."""
    length = tokens.numel()
    targets = torch.cat([tokens[1:], torch.randint(0, VOCAB, (1,), generator=gen)])
    on_completion = (torch.arange(length) >= prompt - 1).float()
    if loss_fn == "cross_entropy":
        weights = on_completion * torch.rand(length, generator=gen).round()  # some zeros
        return {"target_tokens": targets, "weights": weights}
    advantage = float(torch.randn((), generator=gen))
    logprobs = torch.where(on_completion > 0, -torch.rand(length, generator=gen) * 3, 0.0)
    inputs = {
        "target_tokens": targets,
        "logprobs": logprobs,
        "advantages": on_completion * advantage,
    }
    if loss_fn == "gspo":
        inputs["sequence_ratio_mask"] = on_completion
    if loss_fn == STABLE_REINFORCE:
        # the completion is one recorded sampled run, sampled by a policy close to the tiny
        # random model (log-probs near -log VOCAB), so its ratios pass the sequence mask
        inputs[SAMPLED_SEQUENCE] = on_completion
        near = -math.log(VOCAB) + 0.1 * torch.randn(length, generator=gen)
        inputs["logprobs"] = torch.where(on_completion > 0, near, 0.0)
    return inputs


def group_items(slot, loss_fn, prompt_len, sizes, seed, prompt=None):
    """One sampling group: a shared prompt, then completions of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    if prompt is None:
        prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
    items = []
    for size in sizes:
        tokens = torch.cat([prompt, torch.randint(0, VOCAB, (size,), generator=gen)])
        items.append(
            TrainItem(slot, tokens, loss_fn, rl_inputs(loss_fn, tokens, prompt.numel(), gen))
        )
    return items


def lone_item(slot, loss_fn, length, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (length,), generator=gen)
    return TrainItem(slot, tokens, loss_fn, rl_inputs(loss_fn, tokens, length // 2, gen))


def mixed_batch(loss_fn: str) -> list[TrainItem]:
    """3 adapters; groups of 4 with prompts of 17, 23 and 40 tokens; a group whose members
    differ in length; items that share nothing, or too short a prefix, with anything."""
    items = group_items(1, loss_fn, 23, [5, 9, 3, 7], seed=1)
    items += group_items(2, loss_fn, 40, [6, 6, 2, 11], seed=2)
    items.append(lone_item(1, loss_fn, 19, seed=3))
    items += group_items(3, loss_fn, 17, [4, 8, 1, 5], seed=4)
    items.append(lone_item(3, loss_fn, 31, seed=5))
    # shares 5 tokens (< MIN_SHARED_PREFIX) with slot 2's group: runs alone
    short_share = items[4].tokens[:5].tolist() + lone_item(2, loss_fn, 20, seed=6).tokens.tolist()
    gen = torch.Generator().manual_seed(6)
    items.append(
        TrainItem(
            2,
            torch.tensor(short_share),
            loss_fn,
            rl_inputs(loss_fn, torch.tensor(short_share), 10, gen),
        )
    )
    # slot 2's prompt under slot 1: a group of its own (the KV differs across adapters)
    items += group_items(1, loss_fn, 0, [3, 4], seed=7, prompt=items[4].tokens[:40])
    return items


def per_item_reference(engine: TrainEngine, items: list[TrainItem], *, backward: bool = True):
    """Each item alone, through the whole HF model and its full logits (no engine layout)."""
    grads = torch.zeros_like(engine.bank.grads)
    saved = engine.bank.grads.clone()
    engine.bank.grads.zero_()
    logprobs = []
    for item in items:
        tokens = torch.as_tensor(item.tokens)
        spec = validate_loss(
            item.loss_fn, item.loss_inputs, item.loss_config, tokens.numel(), engine.vocab_size
        )
        with (
            torch.set_grad_enabled(backward),
            engine.adapted.routing("train", torch.full((1, tokens.numel()), item.slot)),
        ):
            logits = engine.adapted.model(input_ids=tokens[None]).logits[0]
        targets = spec.inputs["target_tokens"]
        logp = (
            torch.log_softmax(logits.float(), -1)
            .gather(-1, targets.reshape(tokens.numel(), -1))
            .reshape(targets.shape)
        )
        loss, _ = compute_loss(spec, logp)
        if backward:
            loss.backward()
        logprobs.append(logp.detach())
    grads.copy_(engine.bank.grads)
    engine.bank.grads.copy_(saved)
    return logprobs, grads


def count_tokens(engine: TrainEngine) -> list[int]:
    """Token ids entering the embedding, per forward call: what the model really runs."""
    counts: list[int] = []
    embed = engine.adapted.model.get_input_embeddings()
    embed.register_forward_hook(lambda _m, args, _out: counts.append(int(args[0].numel())))
    return counts


def assert_matches_reference(engine, items, out, grads_before):
    ref_logprobs, ref_grads = per_item_reference(engine, items)
    for item, got, want in zip(items, out.items, ref_logprobs, strict=True):
        assert got.logprobs.shape == torch.as_tensor(item.loss_inputs["target_tokens"]).shape
        torch.testing.assert_close(got.logprobs, want, **LOGPROB_TOL)
    torch.testing.assert_close(engine.bank.grads - grads_before, ref_grads, **GRAD_TOL)
    assert float(ref_grads.abs().sum()) > 0


@pytest.mark.parametrize("loss_fn", LOSS_NAMES)
def test_shared_prefixes_equal_per_item_training(loss_fn):
    engine = make_engine("tiny-qwen3")
    items = mixed_batch(loss_fn)
    counts = count_tokens(engine)
    out = engine.forward_backward(items)
    ran = list(counts)
    assert_matches_reference(engine, items, out, torch.zeros_like(engine.bank.grads))
    # Two forwards: 4 group prompts + 3 lone items (7 rows, padded to 40), then 14 member
    # suffixes (padded to 11); the items hold 549 tokens, and 18 rows x 51 when padded.
    assert ran == [7 * 40, 14 * 11] and out.tokens_run == sum(ran)
    assert sum(len(item.tokens) for item in items) == 549


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-moe"])
def test_other_families_share_prefixes_exactly(preset):
    """tiny-llama ties its head to the embeddings; tiny-qwen3-moe routes tokens to experts."""
    engine = make_engine(preset, num_slots=4)
    items = group_items(1, "importance_sampling", 30, [4, 7, 2, 6], seed=11)
    items += [
        *group_items(2, "importance_sampling", 18, [5, 3, 3], seed=12),
        lone_item(2, "ppo", 12, 13),
    ]
    counts = count_tokens(engine)
    out = engine.forward_backward(items)
    ran = list(counts)
    assert_matches_reference(engine, items, out, torch.zeros_like(engine.bank.grads))
    assert len(ran) == 2 and sum(ran) == out.tokens_run < sum(len(i.tokens) for i in items)


def test_forward_returns_the_same_logprobs_and_touches_no_gradient():
    engine = make_engine("tiny-qwen3")
    items = mixed_batch("importance_sampling")
    out = engine.forward(items)
    assert float(engine.bank.grads.abs().max()) == 0
    ref_logprobs, _ = per_item_reference(engine, items, backward=False)
    for got, want in zip(out.items, ref_logprobs, strict=True):
        torch.testing.assert_close(got.logprobs, want, **LOGPROB_TOL)
    fb = engine.forward_backward(items)
    for a, b in zip(out.items, fb.items, strict=True):
        torch.testing.assert_close(a.logprobs, b.logprobs, **LOGPROB_TOL)
        assert a.metrics.keys() == b.metrics.keys()


def test_plain_engine_runs_every_token_and_agrees():
    shared = make_engine("tiny-qwen3")
    plain = TrainEngine(
        shared.adapted,
        base_model_id="tiny-qwen3",
        share_prefixes=False,
        head_grad_where_needed=False,
    )
    items = mixed_batch("importance_sampling")
    counts = count_tokens(shared)
    a = shared.forward_backward(items)
    grads = shared.bank.grads.clone()
    shared.bank.grads.zero_()
    b = plain.forward_backward(items)
    assert len(counts) == 3 and counts[2] == b.tokens_run  # one forward, every token
    assert b.tokens_run >= sum(len(i.tokens) for i in items) > a.tokens_run
    torch.testing.assert_close(grads, plain.bank.grads, **GRAD_TOL)
    for x, y in zip(a.items, b.items, strict=True):
        torch.testing.assert_close(x.logprobs, y.logprobs, **LOGPROB_TOL)


def test_small_budget_keeps_groups_whole_or_cuts_them_and_stays_exact():
    engine = make_engine("tiny-qwen3", token_budget=60)
    items = group_items(1, "importance_sampling", 24, [5, 9, 3, 7, 4, 6], seed=21)
    items += [*group_items(2, "cross_entropy", 30, [8, 2], seed=22), lone_item(1, "cispo", 50, 23)]
    counts = count_tokens(engine)
    out = engine.forward_backward(items)
    assert out.num_microbatches > 2
    assert max(counts) <= 60 and sum(counts) == out.tokens_run
    counts.clear()
    assert_matches_reference(engine, items, out, torch.zeros_like(engine.bank.grads))


def test_non_finite_loss_after_a_shared_microbatch_rolls_back():
    engine = make_engine("tiny-qwen3", token_budget=40)  # the group, then the overflow
    items = group_items(1, "importance_sampling", 20, [4, 6, 5], seed=31)
    engine.forward_backward(items)
    before = engine.bank.grads.clone()
    overflow = lone_item(2, "importance_sampling", 10, seed=32)
    overflow.loss_inputs["logprobs"] = torch.full((10,), -1e4)  # exp(logp - logq) overflows
    overflow.loss_inputs["advantages"] = torch.ones(10)
    with pytest.raises(TrainInputError, match="inf"):
        engine.forward_backward([*items, overflow])
    assert torch.equal(engine.bank.grads, before)


def test_a_batch_without_any_gradient_still_runs_backward():
    """All advantages 0 (the filler row of a sharded rank, too): zero gradient, no error."""
    engine = make_engine("tiny-qwen3")
    items = group_items(1, "importance_sampling", 20, [4, 6], seed=41)
    for item in items:
        item.loss_inputs["advantages"] = torch.zeros(len(item.tokens))
    out = engine.forward_backward(items)
    assert float(engine.bank.grads.abs().max()) == 0 and out.metrics["loss:sum"] == 0


def test_other_families_and_sliding_windows_keep_the_plain_path():
    """Decided at construction: a family outside the list (mistral) or a sliding-window layer
    runs one whole-model forward, every token, and is still exact."""
    mistral = MistralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        sliding_window=None,
    )
    windowed = Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        use_sliding_window=True,
        max_window_layers=1,
        sliding_window=64,
    )
    for config in (mistral, windowed):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        adapted = AdaptedModel(model, resolve_tinker_targets(model))
        adapted.add_bank("train", num_slots=2, r_max=4)
        engine = TrainEngine(adapted, base_model_id=config.model_type)
        assert engine.split is None and not engine.share_prefixes
        slot = engine.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=1))
        with torch.no_grad():
            engine.bank.params[slot].normal_(0, 0.05)
        items = group_items(slot, "importance_sampling", 20, [4, 6, 3], seed=51)
        out = engine.forward_backward(items)
        assert out.tokens_run == 3 * 26
        assert_matches_reference(engine, items, out, torch.zeros_like(engine.bank.grads))


# ----------------------------------------------------------------------------- layout


def test_groups_follow_each_prompt_not_a_system_prompt_common_to_all():
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(0, VOCAB, (20,), generator=gen)
    tokens, slots = [], []
    for _ in range(3):  # 3 prompts behind one system prompt, 4 samples each
        prompt = torch.cat([system, torch.randint(0, VOCAB, (30,), generator=gen)])
        for _ in range(4):
            tokens.append(torch.cat([prompt, torch.randint(0, VOCAB, (6,), generator=gen)]))
            slots.append(1)
    tokens.append(torch.cat([system, torch.tensor([1, 2])]))  # only the system prompt in common
    slots.append(1)
    tokens.append(tokens[0].clone())  # same tokens, another slot: never shared
    slots.append(2)
    units = find_groups(slots, tokens)
    grouped = sorted(sorted(u.items) for u in units if u.prefix)
    assert grouped == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert {u.prefix for u in units if u.prefix} == {50}
    assert sorted(i for u in units for i in u.items) == list(range(len(tokens)))


def test_prefix_leaves_each_member_a_token_and_short_prefixes_are_not_shared():
    same = torch.arange(30)
    units = find_groups([1, 1], [same, same.clone()])
    assert units == [Unit((0, 1), 29)]
    short = [
        torch.cat([torch.arange(MIN_SHARED_PREFIX - 1), torch.tensor([400 + i])]) for i in range(3)
    ]
    assert all(not u.prefix for u in find_groups([1, 1, 1], short))


def test_planner_counts_the_tokens_really_run_and_respects_the_budget():
    lengths = [40, 44, 42, 41, 12, 60]
    group = Unit((0, 1, 2, 3), 36)
    assert tokens_run([group], lengths) == 36 + 4 * 8
    assert tokens_run([group, Unit((4,))], lengths) == 2 * 36 + 4 * 8
    plan = plan_units([group, Unit((4,)), Unit((5,))], lengths, token_budget=110)
    assert sorted(i for batch in plan for u in batch for i in u.items) == list(range(6))
    for batch in plan:
        assert len(batch) == 1 or tokens_run(batch, lengths) <= 110
    # a group over budget is cut into smaller groups that fit
    cut = plan_units([group], lengths, token_budget=36 + 2 * 8)
    assert [sorted(u.items) for batch in cut for u in batch] == [[1, 2], [0, 3]]
    assert all(u.prefix == 36 for batch in cut for u in batch)


# ----------------------------------------------------------------------------- gradient_mask


@pytest.mark.parametrize("loss_fn", LOSS_NAMES)
def test_gradient_mask_covers_every_non_zero_gradient(loss_fn):
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (24,), generator=gen)
    inputs = rl_inputs(loss_fn, tokens, 10, gen)
    spec = validate_loss(loss_fn, inputs, None, 24, 512)
    logp = -torch.rand(24, generator=gen) * 4
    if loss_fn in ("gspo", STABLE_REINFORCE):  # sequence ratios their clips and masks keep
        logp = inputs["logprobs"] + 0.1 * torch.randn(24, generator=gen)
    logp.requires_grad_()
    loss, _ = compute_loss(spec, logp)
    loss.backward()
    assert bool((logp.grad != 0).any())
    mask = gradient_mask(spec)
    assert mask.shape == spec.inputs["target_tokens"].shape and mask.dtype == torch.bool
    assert bool((logp.grad[~mask] == 0).all())
    if loss_fn == "dro":  # the KL penalty reaches every position
        assert bool(mask.all())
    else:
        assert not bool(mask[:9].any()) and bool(mask.any())
    if loss_fn == "dro":
        no_penalty = validate_loss(loss_fn, inputs, {"beta": 0.0}, 24, 512)
        assert torch.equal(gradient_mask(no_penalty), inputs["advantages"] != 0)
    assert math.isfinite(float(loss.detach()))
