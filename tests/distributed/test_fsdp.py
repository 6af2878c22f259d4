"""Two gloo ranks (FSDP2 base, torchrun) against the single-process engine on tiny-qwen3.

One rank group serves the whole module (starting it costs ~15 s); each test uses its own
slots. Slots 1-4 keep their optimizer state on rank 0, slots 5-8 on rank 1.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lorafleet.adapters.checkpoint import read_training_state
from lorafleet.adapters.peft_io import read_peft
from lorafleet.distributed.fsdp import deal_rows, owned_slots, slot_owner
from lorafleet.distributed.launcher import TorchrunRanks
from lorafleet.distributed.protocol import RankSettings
from lorafleet.distributed.remote import DistTrainEngine
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.loader import load_base
from lorafleet.train.engine import TrainEngine, TrainInputError, TrainItem
from lorafleet.train.optim import AdamHParams

NUM_SLOTS = 9
R_MAX = 8
BUDGET = 48  # tokens per micro-batch: the batches below need several, some rows per rank empty


@pytest.fixture(scope="module")
def engines(tiny_targets, one_torch_thread) -> Iterator[tuple[DistTrainEngine, TrainEngine]]:
    settings = RankSettings(
        base_model="tiny-qwen3",
        targets=tiny_targets,
        num_slots=NUM_SLOTS,
        r_max=R_MAX,
        dtype="float32",
        token_budget=BUDGET,
        torch_threads=1,
    )
    sharded = DistTrainEngine(TorchrunRanks(settings, 2))
    base = load_base("tiny-qwen3")
    adapted = AdaptedModel(base.model, tiny_targets)
    adapted.add_bank("train", num_slots=NUM_SLOTS, r_max=R_MAX)
    single = TrainEngine(adapted, base_model_id=base.model_id, token_budget=BUDGET)
    yield sharded, single
    sharded.close()


def sft(slot: int, seed: int, length: int) -> TrainItem:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 512, (length,), generator=g)
    return TrainItem(
        slot,
        tokens,
        "cross_entropy",
        {"target_tokens": torch.roll(tokens, -1), "weights": torch.rand(length, generator=g)},
    )


def rl(slot: int, seed: int, length: int, loss: str = "importance_sampling") -> TrainItem:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 512, (length,), generator=g)
    inputs = {
        "target_tokens": torch.roll(tokens, -1),
        "logprobs": -torch.rand(length, generator=g) * 6,
        "advantages": torch.randn(length, generator=g),
    }
    return TrainItem(slot, tokens, loss, inputs)


def both(engines, method: str, *args, **kwargs):
    sharded, single = engines
    return getattr(sharded, method)(*args, **kwargs), getattr(single, method)(*args, **kwargs)


def assert_weights_close(engines, slots, atol=2e-6, rtol=1e-5) -> None:
    sharded, single = engines
    for slot in slots:
        mine, theirs = sharded.bank.slot_weights(slot), single.bank.slot_weights(slot)
        assert list(mine) == list(theirs)
        for path in mine:
            for a, b in zip(mine[path], theirs[path], strict=True):
                torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=f"slot {slot} {path}")


def free(engines, slots) -> None:
    for slot in slots:
        both(engines, "free_adapter", slot)


def test_slot_ownership_and_row_dealing_are_deterministic():
    assert [list(owned_slots(NUM_SLOTS, 2, r)) for r in range(2)] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert [slot_owner(s, NUM_SLOTS, 2) for s in range(1, 9)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert list(owned_slots(3, 4, 3)) == []  # more ranks than adapters: some own nothing
    shares = deal_rows([30, 5, 12, 12, 7], 2)
    assert sorted(shares[0] + shares[1]) == [0, 1, 2, 3, 4]
    assert deal_rows([9], 2) == [[0], []]  # one row: the other rank runs a filler


def test_init_uses_the_full_layers_and_matches_one_process(engines, tiny_targets):
    """Each rank initialises its slot itself; A's fan-in is the whole layer's input width."""
    attn = tuple(t for t in tiny_targets if ".self_attn." in t)
    specs = {
        1: AdapterSpec(rank=4, alpha=8, seed=11),
        6: AdapterSpec(rank=8, alpha=16, seed=12, targets=attn),
    }
    for slot, spec in specs.items():
        assert both(engines, "create_adapter", spec, slot) == (slot, slot)
    sharded, single = engines
    for slot in specs:
        mine, theirs = sharded.bank.slot_weights(slot), single.bank.slot_weights(slot)
        for path, (A, B) in mine.items():
            assert torch.equal(A, theirs[path][0]) and torch.equal(B, theirs[path][1])
            bound = 1 / single.bank.layers[path].in_features ** 0.5
            assert float(A.abs().max()) <= bound and float(A.abs().max()) > 0.5 * bound
            assert not B.any()
    free(engines, specs)


def test_mixed_adapter_steps_match_one_process(engines, tiny_targets):
    mlp = tuple(t for t in tiny_targets if ".mlp." in t)
    specs = {
        2: AdapterSpec(rank=4, alpha=8, seed=1),
        3: AdapterSpec(rank=8, alpha=16, seed=2, targets=mlp),
        5: AdapterSpec(rank=2, alpha=4, seed=3),  # optimizer state on rank 1
    }
    for slot, spec in specs.items():
        both(engines, "create_adapter", spec, slot)
    batch = [
        sft(2, 1, 11),
        rl(3, 2, 17),
        sft(5, 3, 5),
        rl(2, 4, 23, "ppo"),
        sft(3, 5, 9),
        rl(5, 6, 14),
        sft(2, 7, 3),
        sft(5, 8, 30),
    ]
    hparams = {
        2: AdamHParams(learning_rate=1e-2, weight_decay=0.01),
        3: AdamHParams(
            learning_rate=5e-3, grad_clip_norm=0.05
        ),  # clipping needs the slot's whole-row norm
        5: AdamHParams(learning_rate=2e-2, beta1=0.8),
    }
    for _ in range(2):
        out, ref = both(engines, "forward_backward", batch)
        assert out.num_microbatches == ref.num_microbatches > 1
        assert out.slots == ref.slots
        for mine, theirs in zip(out.items, ref.items, strict=True):
            torch.testing.assert_close(mine.logprobs, theirs.logprobs, atol=1e-5, rtol=1e-5)
        assert out.metrics.keys() == ref.metrics.keys()
        for key in ref.metrics:
            assert out.metrics[key] == pytest.approx(ref.metrics[key], rel=1e-5, abs=1e-5), key
        metrics, ref_metrics = both(engines, "optim_step", hparams)
        for slot in hparams:
            assert metrics[slot].keys() == ref_metrics[slot].keys()
            for key, value in ref_metrics[slot].items():
                assert metrics[slot][key] == pytest.approx(value, rel=1e-5), (slot, key)
        assert metrics[3]["grad_clip_coef"] < 1.0
    assert_weights_close(engines, specs)
    # a step without a new gradient is skipped on both, and moves nothing
    again, ref_again = both(engines, "optim_step", {5: AdamHParams(learning_rate=1e-2)})
    assert again[5]["skipped"] == ref_again[5]["skipped"] == 1.0
    assert_weights_close(engines, specs)
    free(engines, specs)


def _same_state(a, b) -> None:
    assert (
        a.spec == b.spec
        and a.step == b.step
        and a.hparams == b.hparams
        and a.base_model_id == b.base_model_id
    )
    assert list(a.weights) == list(b.weights)
    for path in a.weights:
        for x, y in zip(a.weights[path], b.weights[path], strict=True):
            assert torch.equal(x, y), path
    assert (a.moments is None) == (b.moments is None)
    for name in a.moments or {}:
        for path in a.moments[name]:
            for x, y in zip(a.moments[name][path], b.moments[name][path], strict=True):
                assert torch.equal(x, y), (name, path)


@pytest.mark.parametrize("slot", [4, 7])  # optimizer state on rank 0, then on rank 1
def test_checkpoints_move_between_one_and_two_ranks(engines, tmp_path, slot):
    sharded, single = engines
    spec = AdapterSpec(rank=4, alpha=8, seed=slot)
    both(engines, "create_adapter", spec, slot)
    for _ in range(2):
        both(engines, "forward_backward", [sft(slot, 20, 13), rl(slot, 21, 8)])
        both(engines, "optim_step", {slot: AdamHParams(learning_rate=1e-2, grad_clip_norm=1.0)})
    # 1 process -> 2 ranks -> file: the same checkpoint, bit for bit
    single.save_state(slot, tmp_path / "one")
    sharded.free_adapter(slot)
    assert sharded.load_state(tmp_path / "one", slot=slot) == slot
    sharded.save_state(slot, tmp_path / "one-via-two")
    _same_state(
        read_training_state(tmp_path / "one"), read_training_state(tmp_path / "one-via-two")
    )
    # ... and training continues identically from it on both sides
    both(engines, "forward_backward", [sft(slot, 22, 10)])
    both(engines, "optim_step", {slot: AdamHParams(learning_rate=1e-2)})
    assert_weights_close(engines, [slot])
    # 2 ranks -> 1 process
    sharded.save_state(slot, tmp_path / "two")
    single.free_adapter(slot)
    single.load_state(tmp_path / "two", slot=slot)
    single.save_state(slot, tmp_path / "two-via-one")
    state = read_training_state(tmp_path / "two")
    assert state.step == 3 and state.moments is not None
    _same_state(state, read_training_state(tmp_path / "two-via-one"))
    free(engines, [slot])


def test_peft_export_equals_one_process(engines, tmp_path, tiny_targets):
    sharded, single = engines
    slot = 8
    both(engines, "create_adapter", AdapterSpec(rank=8, alpha=32, seed=5), slot)
    both(engines, "forward_backward", [sft(slot, 30, 19), sft(slot, 31, 4)])
    both(engines, "optim_step", {slot: AdamHParams(learning_rate=1e-2)})
    config, weights = read_peft(sharded.export_peft(slot, tmp_path / "sharded"))
    ref_config, ref_weights = read_peft(single.export_peft(slot, tmp_path / "single"))
    assert config == ref_config
    assert list(weights) == list(ref_weights) == list(tiny_targets)
    for path in weights:
        for a, b in zip(weights[path], ref_weights[path], strict=True):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    # the same adapter state on both sides exports to the same tensors exactly
    single.save_state(slot, tmp_path / "state")
    sharded.free_adapter(slot)
    sharded.load_state(tmp_path / "state", slot=slot)
    _, weights = read_peft(sharded.export_peft(slot, tmp_path / "sharded-again"))
    _, exact = read_peft(single.export_peft(slot, tmp_path / "single-again"))
    for path in weights:
        for a, b in zip(weights[path], exact[path], strict=True):
            assert torch.equal(a, b), path
    free(engines, [slot])


def test_a_non_finite_loss_on_one_rank_fails_the_batch_on_all(engines):
    """The bad row lands on one rank only; every rank must skip the backward and raise, or the
    other would wait forever in FSDP's backward all-gather. Nothing is applied."""
    sharded, single = engines
    slot = 1
    both(engines, "create_adapter", AdapterSpec(rank=4, alpha=8, seed=9), slot)
    overflow = rl(slot, 40, 6)
    overflow.loss_inputs["logprobs"] = torch.full((6,), -1e4)  # exp(logp - logq) overflows
    overflow.loss_inputs["advantages"] = torch.ones(6)
    for engine in (sharded, single):
        with pytest.raises(TrainInputError, match="inf|non-finite|not finite"):
            engine.forward_backward([sft(slot, 41, 12), overflow, sft(slot, 42, 25)])
    # nothing was applied: a step now is skipped, and the ranks still answer
    metrics, _ = both(engines, "optim_step", {slot: AdamHParams(learning_rate=1e-2)})
    assert metrics[slot]["skipped"] == 1.0
    out, ref = both(engines, "forward", [sft(slot, 43, 7)])
    torch.testing.assert_close(out.items[0].logprobs, ref.items[0].logprobs, atol=1e-5, rtol=1e-5)
    free(engines, [slot])


def test_base_model_scoring_through_the_ranks_matches_one_process(engines):
    """Slot 0 (the base) scored by `forward` on the ranks, as a weight sync's base check does
    (`trainer_canary_logprobs(trainer, None, ...)`, which used to need a local model)."""
    from lorafleet.train.canary_probe import trainer_canary_logprobs as trainer_logprobs

    sharded, single = engines
    items = [sft(0, 70, 9), sft(0, 71, 30), sft(0, 72, 5)]  # several micro-batches, rows dealt
    mine, theirs = both(engines, "forward", items)
    for a, b in zip(mine.items, theirs.items, strict=True):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    tokens = list(range(3, 19))
    torch.testing.assert_close(
        trainer_logprobs(sharded, None, tokens),
        trainer_logprobs(single, None, tokens),
        atol=1e-5,
        rtol=0,
    )
    with pytest.raises(TrainInputError, match="slot 0"):
        sharded.forward_backward([sft(0, 73, 6)])
