"""Published versions: immutable, pinned while in flight, LRU-evicted and reloaded from disk."""

from __future__ import annotations

import pytest
import torch

from lorafleet.engines import Colocated, colocate
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample import (
    NoFreeSlotError,
    SampleRequest,
    SamplingParams,
    UnknownVersionError,
    VersionError,
    VersionStore,
    VersionUnavailableError,
)
from lorafleet.train.engine import TrainItem
from lorafleet.train.optim import AdamHParams
from tests._models import tiny_qwen3

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, stop=[])
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=4, stop=[])
PROMPT = [5, 17, 33, 2, 71]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(sample_slots: int = 4, capacity: int | None = None) -> Colocated:
    model = tiny_qwen3()
    stack = colocate(
        model,
        resolve_tinker_targets(model),
        base_model_id="tiny",
        r_max=8,
        sample_slots=sample_slots,
    )
    if capacity is not None:
        stack.versions.capacity = capacity
    return stack


def nudge(stack: Colocated, slot: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    weights = {
        p: (A, B + 0.3 * torch.randn(B.shape, generator=gen))
        for p, (A, B) in stack.trainer.bank.slot_weights(slot).items()
    }
    stack.trainer.bank.load_slot_weights(slot, weights)


def run(stack: Colocated, key, params: SamplingParams = PARAMS):
    (result,) = stack.sampler.generate([SampleRequest(PROMPT, params, adapter=key, num_samples=2)])
    assert result.ok, result.error
    return [s.tokens for s in result.sequences], [s.logprobs for s in result.sequences]


def test_published_version_is_immutable_while_training_goes_on():
    stack = make()
    slot = stack.trainer.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=1))
    nudge(stack, slot, 1)
    v0 = stack.versions.publish("a", stack.trainer.bank, slot)
    assert v0 == ("a", 0)
    before = run(stack, v0, SEEDED)
    # Training keeps going in the trainer slot...
    seq = torch.tensor([*PROMPT, 9, 9, 9])
    item = TrainItem(
        slot,
        seq[:-1],
        "cross_entropy",
        {"target_tokens": seq[1:], "weights": torch.ones(len(seq) - 1)},
    )
    for _ in range(3):
        stack.trainer.forward_backward([item])
        stack.trainer.optim_step({slot: AdamHParams(learning_rate=5e-2)})
    # ...and the published version does not move.
    assert run(stack, v0, SEEDED) == before
    v1 = stack.versions.publish("a", stack.trainer.bank, slot)
    assert v1 == ("a", 1) and stack.versions.latest("a") == v1
    assert run(stack, v1, SEEDED)[1] != before[1]
    with pytest.raises(VersionError, match="immutable"):
        stack.versions.publish("a", stack.trainer.bank, slot, version=0)


def test_pins_block_eviction_and_a_full_sampler_makes_requests_wait(tmp_path):
    stack = make(sample_slots=2, capacity=1)
    slots = [stack.trainer.create_adapter(AdapterSpec(rank=2, alpha=4.0, seed=i)) for i in range(2)]
    for i, slot in enumerate(slots):
        nudge(stack, slot, 10 + i)
    keys = []
    for i, slot in enumerate(slots):
        # Saved copies so both versions can come back after eviction.
        path = stack.trainer.save_state(slot, tmp_path / f"state-{i}")
        keys.append(stack.versions.publish(f"ad{i}", stack.trainer.bank, slot, path=path))
    assert stack.versions.resident() == [keys[1]]  # capacity 1: publishing ad1 evicted ad0
    stack.versions.acquire(keys[1])
    with pytest.raises(VersionError, match="in use"):
        stack.versions.evict(keys[1])
    with pytest.raises(NoFreeSlotError):
        stack.versions.acquire(keys[0])
    stack.versions.release(keys[1])
    alone = [run(stack, k) for k in keys]
    # Both in one call with one slot: the second waits until the first one's sequences finish.
    together = stack.sampler.generate(
        [SampleRequest(PROMPT, PARAMS, adapter=k, num_samples=2) for k in keys]
    )
    assert [[s.tokens for s in r.sequences] for r in together] == [a[0] for a in alone]
    traces = stack.sampler.last_traces
    first_done = max(t.finished_step for t in traces if t.request == 0)
    assert min(t.admitted_step for t in traces if t.request == 1) > first_done
    assert all(info_pins(stack, k) == 0 for k in keys)


def info_pins(stack: Colocated, key) -> int:
    return stack.versions.info(key).pins


def test_evicted_versions_reload_from_files_with_the_same_outputs(tmp_path):
    stack = make(sample_slots=2)
    slots = [
        stack.trainer.create_adapter(AdapterSpec(rank=2 + i, alpha=6.0, seed=i)) for i in range(4)
    ]
    for i, slot in enumerate(slots):
        nudge(stack, slot, 20 + i)
    state = stack.trainer.save_state(slots[0], tmp_path / "state")
    peft = stack.trainer.export_peft(slots[1], tmp_path / "peft")
    k_state = stack.versions.publish("s", stack.trainer.bank, slots[0], path=state)
    k_peft = stack.versions.publish("p", stack.trainer.bank, slots[1], path=peft)
    before = {k: run(stack, k, SEEDED) for k in (k_state, k_peft)}
    k_mem = stack.versions.publish(
        "m", stack.trainer.bank, slots[2]
    )  # evicts the LRU one (k_state)
    mem_out = run(stack, k_mem)
    stack.versions.publish("x", stack.trainer.bank, slots[3])  # evicts k_peft
    assert set(stack.versions.resident()) == {k_mem, ("x", 0)}
    for key, (tokens, logprobs) in before.items():
        again = run(stack, key, SEEDED)  # reloaded from its files on demand
        assert again[0] == tokens
        torch.testing.assert_close(
            torch.tensor(again[1]), torch.tensor(logprobs), atol=1e-6, rtol=0
        )
    # k_mem was evicted by those reloads and has no files: a clear error, not a base-model run.
    assert k_mem not in stack.versions.resident()
    (gone,) = stack.sampler.generate([SampleRequest(PROMPT, PARAMS, adapter=k_mem)])
    assert gone.error.code == "version_unavailable" and "never saved" in gone.error.message
    with pytest.raises(VersionUnavailableError):
        stack.versions.acquire(k_mem)
    # Saved later (save_weights_for_sampler after publish) makes it reloadable.
    stack.trainer.export_peft(slots[2], tmp_path / "late")
    stack.versions.set_path(k_mem, tmp_path / "late")
    assert run(stack, k_mem) == mem_out
    # the shared paging counters (lorafleet.model.paging) saw all of it
    paging = stack.versions.paging()
    row = stack.versions.bank.row_size * 4
    assert paging["page_outs"]["cold"] >= 3 and paging["dropped"] == 2
    assert paging["page_ins"]["cold"] == 3 and paging["misses"] >= 4 and paging["hits"] >= 3
    assert paging["bytes_held"]["hot"] == 2 * row  # two versions resident
    assert paging["bytes_held"]["cold"] == row  # the third one with files, reloadable


def test_registered_versions_load_on_demand_in_a_fresh_sampler(tmp_path):
    stack = make()
    slot = stack.trainer.create_adapter(AdapterSpec(rank=3, alpha=3.0, seed=5))
    nudge(stack, slot, 5)
    key = stack.versions.publish("run", stack.trainer.bank, slot, version=7)
    expected = run(stack, key, SEEDED)
    path = stack.trainer.save_state(slot, tmp_path / "ckpt")
    fresh = make()  # e.g. after a restart: nothing resident
    assert fresh.versions.register("run", 7, path) == ("run", 7)
    assert fresh.versions.resident() == []
    assert run(fresh, ("run", 7), SEEDED) == expected
    with pytest.raises(UnknownVersionError, match="never published"):
        fresh.versions.acquire(("run", 8))
    with pytest.raises(VersionError, match="neither"):
        fresh.versions.register("run", 9, tmp_path)


def test_store_refuses_misuse():
    stack = make()
    with pytest.raises(ValueError, match="trainable"):
        VersionStore(stack.trainer.bank, base_model_id="tiny")
    with pytest.raises(ValueError, match="adapter_id"):
        stack.versions.publish("", stack.trainer.bank, 1)
    slot = stack.trainer.create_adapter(AdapterSpec(rank=2, alpha=2.0))
    key = stack.versions.publish("q", stack.trainer.bank, slot)
    with pytest.raises(VersionError, match="released more often"):
        stack.versions.release(key)
    with pytest.raises(UnknownVersionError):
        stack.versions.release(("nothing", 0))
