"""The sampler's prefix cache as an operator sees it: a prompt sampled twice through the SDK
hits the cache the second time, and the counters reach `/api/v1/lorafleet/stats` and the
Prometheus text of `/metrics`."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from lorafleet.cli import build_parser
from tests.server.conftest import KEY_A, VOCAB


def _prefix_stats(server) -> dict:
    response = httpx.get(
        f"{server.base_url}/api/v1/lorafleet/stats", headers={"X-API-Key": KEY_A}, timeout=30
    )
    response.raise_for_status()
    return response.json()["prefix_cache"]


def test_a_repeated_prompt_hits_and_the_counters_reach_stats_and_metrics(
    client_a, base_model, server
):
    sampler = client_a.create_sampling_client(base_model=base_model).result()
    tokens = [(7 * i + 3) % VOCAB for i in range(41)]  # 40 cacheable positions: 2 full blocks
    prompt = types.ModelInput.from_ints(tokens)
    params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=5)
    before = _prefix_stats(server)
    first = sampler.sample(prompt, 1, params).result()
    second = sampler.sample(prompt, 1, params).result()
    after = _prefix_stats(server)
    assert after["enabled"] and after["lookups"] == before["lookups"] + 2
    assert after["hit_tokens"] - before["hit_tokens"] == 32
    assert after["missed_tokens"] - before["missed_tokens"] == 41 + 9
    # the cache's size is the operator's to read (issue 34: it moves with other tenants' use)
    assert "bytes" not in after and "blocks" not in after
    total = server.service.stats()["prefix_cache"]
    assert 0 < total["bytes"] <= total["max_bytes"] and total["blocks"] >= 2
    assert 0 < after["hit_rate"] <= 1
    assert (
        first.sequences[0].tokens == second.sequences[0].tokens
    )  # seeded: the hit changes nothing

    # /metrics renders the same registry (operator auth is test_metering.py's subject)
    text = generate_latest(server.service.usage.registry).decode()
    samples = {
        s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
    }
    assert samples["lorafleet_prefix_cache_hit_tokens_total"] >= after["hit_tokens"]
    assert samples["lorafleet_prefix_cache_bytes"] > 0
    assert "lorafleet_prefix_cache_evictions_total" in samples


def test_serve_takes_a_prefix_cache_budget_and_refuses_a_negative_one(capsys):
    args = ["serve", "--base-model", "tiny-qwen3", "--data-dir", "unused"]
    assert build_parser().parse_args(args).prefix_cache_bytes is None  # the engine's default
    assert build_parser().parse_args([*args, "--prefix-cache-bytes", "0"]).prefix_cache_bytes == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args([*args, "--prefix-cache-bytes", "-5"])
    err = capsys.readouterr().err
    assert "--prefix-cache-bytes" in err and "-5" in err
