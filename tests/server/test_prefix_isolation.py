"""Issue 34, item 4: the prefix cache is not a side channel between tenants. A tenant's cached
prompt is found only by that tenant (the server salts each request's blocks with its tenant,
as vLLM's `cache_salt`), so another tenant's right guess hits nothing and takes as long as a
wrong one; the stats show each tenant its own counters and operators the totals; and an
operator-declared public prefix (a system prompt) is shared by everyone."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch
from tinker import types

from lorafleet.server.http.stats import own_view
from tests.server.conftest import KEY_A, KEY_B

SECRET = [(7 * i + 3) % 480 + 10 for i in range(320)]  # tenant A's 320-token prompt


def _read(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    kv = torch.arange(start, stop, dtype=torch.float32).view(1, 1, -1, 1)
    return kv, kv.clone()


def test_blocks_are_found_only_under_their_salt_or_a_public_prefix():
    from lorafleet.sample.prefix_cache import PrefixCache, public_length

    cache = PrefixCache(1 << 20, block_tokens=4)
    root = cache.root(None, None)
    tokens = list(range(100, 124))
    assert cache.insert(root, tokens, _read, "alice") == 6
    assert len(cache.lookup(root, tokens, 24, "alice")) == 6
    assert cache.lookup(root, tokens, 24, "bob") == []
    assert cache.lookup(root, tokens, 24) == []  # unsalted requests see public blocks only
    # a declared public prefix of 10 tokens: its two full blocks are shared, the rest is not
    public = [tuple(range(100, 110))]
    assert public_length(tokens, public, 4) == 8
    # a new chain: two public blocks, and alice's four after them (their parent is public)
    assert cache.insert(root, tokens, _read, "alice", public) == 6
    assert len(cache.lookup(root, tokens, 24, "alice", public)) == 6
    assert len(cache.lookup(root, tokens, 24, "bob", public)) == 2
    report = cache.report()
    assert report.tenants["alice"].inserts == 12 and "bob" not in report.tenants
    cache.record(8, 16, "bob")
    view = cache.report().tenant_view("bob")
    assert view["hit_tokens"] == 8 and view["missed_tokens"] == 16 and "bytes" not in view


def _stats(server, key: str) -> dict[str, Any]:
    answer = httpx.get(f"{server.base_url}/api/v1/lorafleet/stats", headers={"X-API-Key": key})
    assert answer.status_code == 200, answer.text
    return answer.json()["prefix_cache"]


def _sample(client, model: str, prompt: list[int]) -> None:
    sampler = client.create_sampling_client(base_model=model)
    sampler.sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=1, seed=1)
    ).result()


def test_another_tenants_right_guess_hits_nothing_and_counters_are_per_tenant(
    server, client_a, client_b
):
    model = server.service.served.names[0]
    before_b = _stats(server, KEY_B)
    _sample(client_a, model, SECRET)
    _sample(client_a, model, SECRET)  # A's own repeat: a hit, in A's counters
    a = _stats(server, KEY_A)
    assert a["enabled"] and a["hit_tokens"] >= 304
    assert set(a) == {
        "enabled",
        "block_tokens",
        "lookups",
        "hit_tokens",
        "missed_tokens",
        "hit_rate",
        "inserts",
    }
    # B guesses A's prompt exactly: no hit, and B's view moved by its own prefill alone
    _sample(client_b, model, SECRET)
    b = _stats(server, KEY_B)
    assert b["hit_tokens"] == before_b["hit_tokens"] == 0
    assert b["missed_tokens"] - before_b["missed_tokens"] == len(SECRET)
    assert b["lookups"] - before_b["lookups"] == 1
    # B's own repeat hits B's own blocks
    _sample(client_b, model, SECRET)
    assert _stats(server, KEY_B)["hit_tokens"] >= 304
    # operators read the totals and every tenant's counters
    total = server.service.stats()["prefix_cache"]
    assert total["hit_tokens"] >= 608 and len(total["tenants"]) >= 2
    assert "tenants" not in own_view(server.service.stats(), "someone")["prefix_cache"]


def test_a_declared_public_prefix_is_shared_and_the_rest_is_not(server, client_a, client_b):
    model = server.service.served.names[0]
    system = [(11 * i + 5) % 480 + 10 for i in range(100)]  # 6 full blocks of 16, and 4
    batches = server.service.executor.sample_batches
    saved = batches.public_prefixes
    batches.public_prefixes = (tuple(system),)
    try:
        tail_a = [(13 * i + 1) % 480 + 10 for i in range(60)]
        _sample(client_a, model, system + tail_a)
        before = _stats(server, KEY_B)
        _sample(client_b, model, system + tail_a)  # the same whole prompt as A's
        hits = _stats(server, KEY_B)["hit_tokens"] - before["hit_tokens"]
        assert hits == 96  # the public prefix's full blocks, none of A's own after them
    finally:
        batches.public_prefixes = saved


def test_serve_reads_public_prefix_files(tmp_path):
    from lorafleet.cli import _read_text, build_parser

    path = tmp_path / "system.txt"
    path.write_text("<|im_start|>system\nYou are helpful.<|im_end|>\n", encoding="utf-8")
    args = build_parser().parse_args(
        [
            "serve",
            "--base-model",
            "tiny-qwen3",
            "--data-dir",
            str(tmp_path),
            "--public-prefix",
            str(path),
            "--public-prefix",
            str(path),
        ]
    )
    assert [_read_text(p, "--public-prefix") for p in args.public_prefix] == [path.read_text()] * 2
    with pytest.raises(SystemExit, match="--public-prefix"):
        _read_text(str(tmp_path / "missing.txt"), "--public-prefix")
