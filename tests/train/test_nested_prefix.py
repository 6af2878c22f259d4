"""Nested prefixes (multi-turn data: turn 1 ⊂ turn 2 ⊂ ...): an item whose tokens are a prefix of
another item of its slot runs nothing and reads the longer item's rows. Log-probs, metrics and
every slot's gradient equal the unshared engine's (share_prefixes=False) and each item alone,
to test_prefix.py's tolerances, and the model runs only the tokens expected."""

from __future__ import annotations

import pytest
import torch

from lorafleet.train.engine import BatchOutput, TrainEngine, TrainItem
from lorafleet.train.layout import Unit, build_layout, plan_units, resolve
from lorafleet.train.prefix_trie import find_hosts, plan_sharing
from tests.train.test_prefix import (
    GRAD_TOL,
    LOGPROB_TOL,
    VOCAB,
    count_tokens,
    make_engine,
    per_item_reference,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")


def loss_inputs(loss_fn: str, tokens: torch.Tensor, gen: torch.Generator) -> dict:
    """Inputs that differ per item at every position, shared ones included: own targets (the
    last one random, as a re-sampled action would be), own weights or advantages."""
    length = tokens.numel()
    targets = torch.cat([tokens[1:], torch.randint(0, VOCAB, (1,), generator=gen)])
    some = (torch.rand(length, generator=gen) < 0.6).float()
    if loss_fn == "cross_entropy":
        return {"target_tokens": targets, "weights": some * torch.rand(length, generator=gen)}
    return {
        "target_tokens": targets,
        "logprobs": -torch.rand(length, generator=gen) * 3 - 4,
        "advantages": some * torch.randn(length, generator=gen),
    }


def episode(slot, turns, seed, *, start=None, obs=6, act=4, losses=LOSSES):
    """One conversation's turn items: each the whole history up to that turn's action."""
    gen = torch.Generator().manual_seed(seed)
    history = start if start is not None else torch.randint(0, VOCAB, (obs,), generator=gen)
    items = []
    for turn in range(turns):
        history = torch.cat([history, torch.randint(0, VOCAB, (act,), generator=gen)])
        loss_fn = losses[(seed + turn) % len(losses)]
        items.append(TrainItem(slot, history.clone(), loss_fn, loss_inputs(loss_fn, history, gen)))
        history = torch.cat([history, torch.randint(0, VOCAB, (obs,), generator=gen)])
    return items


@pytest.fixture(scope="module")
def engines() -> tuple[TrainEngine, TrainEngine]:
    """(shared, unshared) over one model and bank, so both see the same adapters."""
    shared = make_engine("tiny-qwen3")
    plain = TrainEngine(shared.adapted, base_model_id="tiny-qwen3", share_prefixes=False)
    return shared, plain


def run_both(engines, items) -> tuple[BatchOutput, list[int], BatchOutput]:
    """Runs `items` shared (counting what the model runs), then unshared; each on a zeroed
    gradient, and checks logprobs, metrics and every slot's gradient agree."""
    shared, plain = engines
    shared.bank.grads.zero_()
    counts = count_tokens(shared)
    out = shared.forward_backward(items)
    ran = list(counts)
    counts.clear()
    grads = shared.bank.grads.clone()
    shared.bank.grads.zero_()
    ref = plain.forward_backward(items)
    torch.testing.assert_close(grads, plain.bank.grads, **GRAD_TOL)
    for used in {item.slot for item in items}:
        assert float(grads[used].abs().sum()) > 0
    for a, b in zip(out.items, ref.items, strict=True):
        torch.testing.assert_close(a.logprobs, b.logprobs, **LOGPROB_TOL)
        assert a.metrics.keys() == b.metrics.keys()
        for key in a.metrics:
            assert a.metrics[key] == pytest.approx(b.metrics[key], rel=1e-4, abs=1e-5), key
    shared.bank.grads.zero_()
    return out, ran, ref


def test_a_chain_of_five_runs_its_longest_turn_once(engines):
    items = episode(1, 5, seed=0)
    out, ran, ref = run_both(engines, items)
    assert ran == [len(items[-1].tokens)] == [50]  # one forward, one row: the last turn
    assert out.tokens_run == 50 and ref.tokens_run == 5 * 50  # unshared pads 5 rows to 50
    # and each item against its own run through the whole HF model
    shared = engines[0]
    out = shared.forward_backward(items)
    ref_logprobs, ref_grads = per_item_reference(shared, items)
    for got, want in zip(out.items, ref_logprobs, strict=True):
        torch.testing.assert_close(got.logprobs, want, **LOGPROB_TOL)
    torch.testing.assert_close(shared.bank.grads, ref_grads, **GRAD_TOL)
    shared.bank.grads.zero_()


def test_chains_of_two_slots_mixed_never_cross_slots(engines):
    items = episode(1, 4, seed=1) + episode(2, 3, seed=2) + episode(1, 3, seed=3, obs=9)
    same_tokens_other_slot = episode(2, 2, seed=1)  # slot 1's first two turns, under slot 2
    duplicate = episode(2, 3, seed=2)[1:2]  # slot 2's second turn again: rides entirely
    items = [items[5], *items[:5], *same_tokens_other_slot, *items[6:], *duplicate]
    assert torch.equal(items[6].tokens, items[1].tokens) and items[6].slot != items[1].slot
    out, ran, ref = run_both(engines, items)
    # Leaves: slot 1's chains (40 and 39 tokens), slot 2's chain (30) and its copy of slot 1's
    # second turn (20). No two leaves share 16 tokens, so one forward of 4 rows padded to 40.
    assert ran == [4 * 40] and out.tokens_run == 160
    assert ref.tokens_run == len(items) * 40


def test_a_branching_trie_shares_its_system_prompt_and_its_chains():
    """Three episodes behind one 24-token system prompt, one of them branching after two turns
    (two continuations of one conversation): the leaves share the system prompt's KV, each
    branch's earlier turns ride on the branch."""
    engine = make_engine("tiny-qwen3")
    plain = TrainEngine(engine.adapted, base_model_id="tiny-qwen3", share_prefixes=False)
    system = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(9))
    a = episode(1, 4, seed=10, start=system)
    b = episode(1, 3, seed=11, start=system)
    stem = episode(1, 2, seed=12, start=system)
    branch_one = episode(1, 2, seed=13, start=stem[-1].tokens)
    branch_two = episode(1, 3, seed=14, start=stem[-1].tokens)
    items = [*a, *b, *stem, *branch_one, *branch_two]
    hosts = find_hosts([1] * len(items), [torch.as_tensor(i.tokens) for i in items])
    leaves = sorted(set(range(len(items))) - set(hosts))
    assert leaves == [3, 6, 10, 13]
    assert all(hosts[i] == 3 for i in range(3)) and all(hosts[i] == 6 for i in (4, 5))
    assert {hosts[i] for i in (7, 8)} <= {10, 13} and hosts[9] == 10
    assert hosts[11] == hosts[12] == 13
    out, ran, _ = run_both((engine, plain), items)
    # First forward: the system prompt once (sharing it among all 4 saves 3 x 24 tokens, more
    # than the branches' 38-token stem among 2); second: the leaves' suffixes, padded to the
    # longest (branch two: 62 tokens, 38 of its own). Unshared, 14 rows of up to 62 tokens.
    assert [len(items[i].tokens) for i in leaves] == [58, 48, 52, 62]
    assert ran == [24, 4 * 38] and out.tokens_run == 176
    assert sum(len(i.tokens) for i in items) == 602


def test_a_small_budget_keeps_riders_with_their_host_and_stays_exact(engines):
    shared, plain = engines
    items = episode(1, 5, seed=20) + episode(2, 4, seed=21) + episode(3, 3, seed=22)
    shared.token_budget = plain.token_budget = 60
    try:
        out, ran, ref = run_both(engines, items)
    finally:
        shared.token_budget = plain.token_budget = 4096
    # one chain per micro-batch (two would pad to more than 60); unshared: 12 rows in 7
    assert ran == [50, 40, 30] and out.tokens_run == 120
    assert out.num_microbatches == 3 and ref.num_microbatches == 7
    units = plan_sharing([i.slot for i in items], [torch.as_tensor(i.tokens) for i in items])
    for batch in plan_units(units, [len(i.tokens) for i in items], 60):
        for unit in batch:
            assert all(host in unit.items for _, host in unit.riders)


def test_a_group_cut_by_the_budget_takes_its_riders_along(engines):
    """Three episodes behind one system prompt: their last turns would share it as a group of
    3 (24 + 3 x 34 tokens), over the budget of 100; the group is cut, and each cut part keeps
    its hosts' earlier turns."""
    shared, plain = engines
    system = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(40))
    items = [
        *episode(1, 4, seed=41, start=system),
        *episode(1, 3, seed=42, start=system),
        *episode(1, 3, seed=43, start=system),
    ]
    shared.token_budget = plain.token_budget = 100
    try:
        out, ran, _ = run_both(engines, items)
    finally:
        shared.token_budget = plain.token_budget = 4096
    # the 58- and 48-token episodes share the prompt (24, then 2 suffixes of up to 34); the
    # third runs alone (48)
    assert ran == [24, 2 * 34, 48] and out.num_microbatches == 2


def test_tokens_that_only_look_nested_do_not_ride(engines):
    """A turn re-tokenized (its last token changed in the next turn's history) is not a prefix:
    it runs on its own, or shares only the common part in a group."""
    items = episode(1, 3, seed=30, obs=12, act=8)
    retokenized = items[1].tokens.clone()
    retokenized[-1] = (int(retokenized[-1]) + 1) % VOCAB
    items[1] = TrainItem(1, retokenized, items[1].loss_fn, items[1].loss_inputs)
    hosts = find_hosts([1, 1, 1], [torch.as_tensor(i.tokens) for i in items])
    assert list(hosts) == [0]  # turn 1 is still a prefix of both
    out, ran, _ = run_both(engines, items)
    # turns 2 and 3 share 39 tokens as a group: 39 once, then their suffixes of 1 and 21 tokens
    assert ran == [39, 2 * 21] and out.tokens_run == 81


def rerendered_episode(slot, turns, seed, *, obs=16, act=5, start=None):
    """A conversation whose history re-renders each action's header (as the cookbook's
    role_colon renderer does for guess_number's "player" turns): turn k is not a prefix of turn
    k + 1, they share turn k's history and diverge at its action's header."""
    gen = torch.Generator().manual_seed(seed)
    history = torch.randint(0, VOCAB, (obs,), generator=gen)
    if start is not None:
        history = torch.cat([start, history])
    sampled, rendered = torch.tensor([1]), torch.tensor([2])
    items = []
    for turn in range(turns):
        action = torch.randint(0, VOCAB, (act,), generator=gen)
        tokens = torch.cat([history, sampled, action])
        loss_fn = LOSSES[(seed + turn) % len(LOSSES)]
        items.append(TrainItem(slot, tokens, loss_fn, loss_inputs(loss_fn, tokens, gen)))
        history = torch.cat(
            [history, rendered, action, torch.randint(0, VOCAB, (obs,), generator=gen)]
        )
    return items


def test_rerendered_turns_hang_off_the_last_turn(engines):
    """No turn rides (none is a prefix of another), but each shares its whole history with the
    last turn: the last turn runs whole, each other turn only its header and action (6 tokens)
    against the last turn's cache, at its own depth. A group would share only the first 16."""
    items = rerendered_episode(1, 5, seed=50)
    assert [len(i.tokens) for i in items] == [22, 44, 66, 88, 110]
    assert not find_hosts([1] * 5, [torch.as_tensor(i.tokens) for i in items])
    units = plan_sharing([1] * 5, [torch.as_tensor(i.tokens) for i in items])
    assert units == [Unit((4, 0, 1, 2, 3), depths=(16, 38, 60, 82))]
    out, ran, ref = run_both(engines, items)
    assert ran == [110, 4 * 6] and out.tokens_run == 134 and ref.tokens_run == 5 * 110


def test_a_stem_cut_by_the_budget_hangs_its_rest_off_a_shared_prefix(engines):
    """Budget 122: the last turn with turns 4 and 3 (110 + 2 x 6), then turns 2 and 1 as a group
    on the first 38 tokens, turn 1 reading only its first 16 of them."""
    shared, plain = engines
    items = rerendered_episode(1, 5, seed=51)
    lengths = [len(i.tokens) for i in items]
    units = plan_sharing([1] * 5, [torch.as_tensor(i.tokens) for i in items])
    assert plan_units(units, lengths, 122) == [
        [Unit((4, 3, 2), depths=(82, 60))],
        [Unit((1, 0), 38, depths=(38, 16))],
    ]
    shared.token_budget = plain.token_budget = 122
    try:
        out, ran, _ = run_both(engines, items)
    finally:
        shared.token_budget = plain.token_budget = 4096
    assert ran == [110, 2 * 6, 38, 2 * 6] and out.tokens_run == 172


def test_episodes_behind_one_prompt_each_hang_off_their_own_last_turn(engines):
    """Two re-rendered episodes behind one 24-token prompt: a stem each (saving 40 + 62 + 84
    tokens per episode) beats one unit over both (the other episode would share only 24)."""
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(60))
    items = [
        *rerendered_episode(1, 4, seed=61, start=prompt),
        *rerendered_episode(1, 4, seed=62, start=prompt),
    ]
    units = plan_sharing([1] * 8, [torch.as_tensor(i.tokens) for i in items])
    assert sorted((u.items[0], u.depths) for u in units) == [(3, (40, 62, 84)), (7, (40, 62, 84))]
    _, ran, _ = run_both(engines, items)
    assert ran == [2 * 112, 6 * 6]


# ----------------------------------------------------------------------------- layout


def test_riders_point_at_their_hosts_first_rows():
    tokens = [torch.arange(10), torch.arange(4), torch.arange(7), torch.arange(4)]
    slots = [1, 1, 1, 2]
    units = plan_sharing(slots, tokens)
    assert sorted(units, key=lambda u: u.items) == [Unit((0,), 0, ((1, 0), (2, 0))), Unit((3,))]
    layout = build_layout(slots, tokens, units)
    assert layout.tokens_run == 2 * 10
    for rider, length in ((1, 4), (2, 7)):
        assert torch.equal(layout.positions[rider], layout.positions[0][:length])
    assert not set(layout.positions[3].tolist()) & set(layout.positions[0].tolist())


def test_dissolving_or_cutting_a_group_keeps_each_rider_with_its_host():
    lengths = [40, 44, 12, 30, 20]
    group = Unit((0, 1), 36, ((3, 1), (4, 0)))
    assert resolve([group, Unit((2,))], lengths) == [group, Unit((2,))]
    # long suffixes beside a long lone item: sharing would run more padded tokens than not
    padded = Unit((0, 1), 16, ((3, 1), (4, 0)))
    assert resolve([padded, Unit((2,))], [17, 100, 100, 30, 10]) == [
        Unit((0,), riders=((4, 0),)),
        Unit((1,), riders=((3, 1),)),
        Unit((2,)),
    ]
    cut = plan_units([group], lengths, token_budget=36 + 6)
    assert sorted((u.items, u.riders) for batch in cut for u in batch) == [
        ((0,), ((4, 0),)),
        ((1,), ((3, 1),)),
    ]
