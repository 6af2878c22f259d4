"""The memory plan (model/memory.py, engines.plan_engine_config): sizes from free device
memory with a stated headroom, flags override, clamps, and a clear refusal when nothing fits;
the row and KV estimates it relies on match what the engines really allocate."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lorafleet.engines import EngineConfig, build_engines, plan_engine_config
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.loader import load_base
from lorafleet.model.memory import (
    HEADROOM,
    MAX_PLANNED_SLOTS,
    PLANNED,
    PLANNED_ROW_TOKENS,
    SHARES,
    SLOT_ROWS,
    MemoryInputs,
    bank_row_bytes,
    consumer_bytes,
    kv_bytes_per_token,
    plan_memory,
)
from lorafleet.model.targets import resolve_tinker_targets
from tests._models import tiny_llama, tiny_qwen3

GIB = 1 << 30
# qwen3-1.7b-shape in bf16, rank 32 on every target (the numbers the plan sees on an H200)
QWEN_1_7B = MemoryInputs(
    free_bytes=130 * GIB,
    total_bytes=141 * GIB,
    row_bytes=160 << 20,
    sampler_slots=16,
    kv_bytes_per_token=114688,
    train_bytes_per_token=2 << 20,
)


def test_a_large_device_is_split_by_the_stated_shares_within_the_headroom():
    plan = plan_memory("cuda:0", QWEN_1_7B, {})
    assert plan.planned and plan.headroom == HEADROOM
    assert plan.usable_bytes == int(130 * GIB * HEADROOM)
    assert set(plan.values) == PLANNED and set(plan.sources.values()) == {"planned"}
    assert sum(plan.costs.values()) <= plan.usable_bytes
    left = plan.usable_bytes - plan.costs["sampler_bank"]
    for name, share in SHARES.items():  # each takes about its share (clamps aside)
        assert plan.costs[name] <= left * share + 1, name
    # an H200 holds about 24 resident qwen3-1.7b runs of rank 32, micro-batches of 20k
    # tokens and 138 sampler rows of 2048 tokens
    assert 16 <= plan.values["max_adapters"] <= MAX_PLANNED_SLOTS
    assert plan.values["token_budget"] >= 16384
    assert plan.values["max_sample_rows"] >= 128
    assert "80% of the memory free" in plan.note


def test_given_sizes_stay_and_come_off_the_top():
    given = {"max_adapters": 4, "max_sample_rows": 32}
    plan = plan_memory("cuda:0", QWEN_1_7B, given)
    assert plan.values["max_adapters"] == 4 and plan.sources["max_adapters"] == "given"
    assert plan.values["max_sample_rows"] == 32 and plan.sources["max_sample_rows"] == "given"
    assert plan.sources["token_budget"] == plan.sources["prefix_cache_bytes"] == "planned"
    # the planned two share what the given two leave, in their own ratio
    free = plan.usable_bytes - plan.costs["sampler_bank"] - plan.costs["max_adapters"]
    free -= plan.costs["max_sample_rows"]
    ratio = SHARES["prefix_cache_bytes"] / (SHARES["prefix_cache_bytes"] + SHARES["token_budget"])
    assert plan.values["prefix_cache_bytes"] == int(free * ratio)
    everything = plan_memory("cuda:0", QWEN_1_7B, {name: 1 for name in PLANNED})
    assert not everything.planned and set(everything.sources.values()) == {"given"}


def test_a_small_device_gets_the_floors_and_one_that_holds_nothing_is_refused():
    small = dataclasses.replace(QWEN_1_7B, free_bytes=6 * GIB, total_bytes=8 * GIB)
    plan = plan_memory("cuda:0", small, {})
    huge = plan_memory("cuda:0", dataclasses.replace(QWEN_1_7B, row_bytes=1 << 20), {})
    assert huge.values["max_adapters"] == MAX_PLANNED_SLOTS  # capped: more runs page out
    assert plan.values["max_adapters"] >= 1 and plan.values["max_sample_rows"] >= 8
    assert plan.values["token_budget"] >= 256
    full = dataclasses.replace(QWEN_1_7B, free_bytes=1 << 30)
    with pytest.raises(ValueError, match="does not even hold the sampler bank and the given sizes"):
        plan_memory("cuda:0", full, {"max_sample_rows": 256})


@pytest.mark.parametrize(
    "given,match",
    [({"warm_bytes": 1}, "cannot plan"), ({"max_adapters": -1}, "integer >= 0")],
)
def test_bad_plan_input_is_refused(given, match):
    with pytest.raises(ValueError, match=match):
        plan_memory("cuda:0", QWEN_1_7B, given)
    with pytest.raises(ValueError, match="headroom"):
        plan_memory("cuda:0", QWEN_1_7B, {}, headroom=1.5)
    with pytest.raises(ValueError, match="row_bytes must be > 0"):
        plan_memory("cuda:0", dataclasses.replace(QWEN_1_7B, row_bytes=0), {})


def test_costs_follow_their_rules():
    assert consumer_bytes("max_adapters", 3, QWEN_1_7B) == 4 * SLOT_ROWS * QWEN_1_7B.row_bytes
    assert consumer_bytes("max_sample_rows", 2, QWEN_1_7B) == 2 * PLANNED_ROW_TOKENS * 114688
    with pytest.raises(ValueError, match="no memory rule"):
        consumer_bytes("warm_bytes", 1, QWEN_1_7B)


@pytest.mark.parametrize("make", [tiny_qwen3, tiny_llama])
def test_the_row_estimate_matches_the_bank(make):
    model = make()
    targets = resolve_tinker_targets(model)
    estimate = bank_row_bytes(model, targets, 12)
    bank = AdaptedModel(model, targets).add_bank("b", num_slots=2, r_max=12)
    actual = bank.row_size * 4
    assert actual <= estimate <= actual + 4 * 8 * 2 * len(targets)  # alignment padding only


def test_the_kv_estimate_matches_the_row_cache():
    model = tiny_qwen3()
    config = model.config
    want = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    assert kv_bytes_per_token(config, torch.bfloat16) == want


def test_plan_engine_config_sizes_what_was_left_to_it_and_build_engines_uses_it():
    base = load_base("tiny-qwen3")
    targets = resolve_tinker_targets(base.model)
    config = EngineConfig(
        base_model="tiny-qwen3",
        max_adapters=3,
        max_lora_rank=8,
        memory_planned=frozenset({"token_budget", "max_sample_rows", "prefix_cache_bytes"}),
    )
    cpu = plan_engine_config(config, base, targets)  # the CPU: nothing planned
    assert cpu.memory_plan is not None and not cpu.memory_plan.planned
    assert (cpu.token_budget, cpu.max_sample_rows) == (config.token_budget, config.max_sample_rows)
    planned = plan_engine_config(config, base, targets, memory=lambda: (2 * GIB, 4 * GIB))
    plan = planned.memory_plan
    assert plan is not None and plan.planned and plan.free_bytes == 2 * GIB
    assert planned.max_adapters == 3 and plan.sources["max_adapters"] == "given"
    assert planned.token_budget == plan.values["token_budget"] != config.token_budget
    assert planned.max_sample_rows == plan.values["max_sample_rows"]
    assert plan_engine_config(planned, base, targets) is planned  # done once
    engines = build_engines(planned, base, targets)
    assert engines.trainer.token_budget == planned.token_budget
    assert engines.sampler.max_rows == planned.max_sample_rows
    assert engines.sampler.prefix_cache.max_bytes == planned.prefix_cache_bytes
    with pytest.raises(ValueError, match="cannot plan"):
        plan_engine_config(
            dataclasses.replace(config, memory_planned=frozenset({"warm_bytes"})), base, targets
        )
