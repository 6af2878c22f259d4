"""`build_pool` for `vllm=spawn`: the spawned servers get a key of their own and no dev
endpoints, and the pool's engine clients send that key (no vLLM started: the pool is
replaced by a recorder)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from lorafleet.sample.validate import ModelLimits
from lorafleet.sync import pool_builder
from lorafleet.sync.replica import SpawnedVllm
from lorafleet.sync.rollout_config import RolloutConfig


def test_spawned_replicas_answer_only_the_pool(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    built: dict[str, Any] = {}

    def record(config: Any, trainer: Any, sources: list[Any], **kw: Any) -> str:
        built.update(sources=sources, **kw)
        return "pool"

    monkeypatch.setattr(pool_builder, "RolloutPool", record)
    monkeypatch.setattr(pool_builder.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    limits = ModelLimits(
        vocab_size=512, context=4096, eos_token_ids=frozenset({2}), has_tokenizer=True
    )
    pool_builder.build_pool(
        RolloutConfig.parse("vllm=spawn:2"),
        cast(Any, SimpleNamespace(base_model_id="tiny-llama")),
        limits=limits,
        dtype="float32",
        model_dir=tmp_path,
        max_lora_rank=8,
    )
    sources = built["sources"]
    assert len(sources) == 2 and all(isinstance(s, SpawnedVllm) for s in sources)
    keys = {s.options["api_key"] for s in sources}
    assert len(keys) == 1 and None not in keys and len(next(iter(keys))) >= 32
    assert all(s.options["dev_mode"] is False for s in sources)
    engine = built["engine_factory"]("http://127.0.0.1:1")
    assert engine.client.http.headers["Authorization"] == f"Bearer {next(iter(keys))}"
