"""A `RolloutPool` from a `RolloutConfig`: the replicas' sources and their engine clients.

`engines.build_engines` calls `build_pool` with the colocated trainer (the source of versions
and of the canary's reference) and the embedded sampler's limits (the same base, tokenizer and
EOS ids, so requests are validated by the same rules whichever engine runs them).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import tempfile
from pathlib import Path

import httpx
import torch

from lorafleet.interfaces import Trainer
from lorafleet.sample.validate import ModelLimits
from lorafleet.sync.httpclient import validate_base_url
from lorafleet.sync.pool import RolloutPool
from lorafleet.sync.replica import PoolEngine, ReplicaSource, SpawnedVllm, UrlSource
from lorafleet.sync.rollout_config import RolloutConfig
from lorafleet.sync.sglang import SglangEngine
from lorafleet.sync.vllm import VllmEngine

log = logging.getLogger(__name__)

__all__ = ["build_pool", "served_base_name"]


def served_base_name(url: str, api_key: str | None) -> str:
    """The base model's name on an OpenAI-style server (`/v1/models`, the entry without a
    parent: LoRA entries name the base as their parent)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    reply = httpx.get(f"{url}/v1/models", headers=headers, timeout=10.0)
    reply.raise_for_status()
    models = [m for m in reply.json().get("data", []) if isinstance(m, dict) and "id" in m]
    bases = [m["id"] for m in models if not m.get("parent")]
    if len(bases) != 1:
        raise ValueError(
            f"{url}/v1/models lists {len(bases)} base models ({bases[:4]}); name the one to use"
        )
    return str(bases[0])


def build_pool(
    config: RolloutConfig,
    trainer: Trainer,
    *,
    limits: ModelLimits,
    dtype: str,
    model_dir: Path,
    max_lora_rank: int,
) -> RolloutPool:
    torch_dtype = getattr(torch, dtype)
    sources: list[ReplicaSource]
    # spawned servers listen on loopback ports any local process can reach: a key of their
    # own (sent in the child's environment, not on its command line) keeps other processes
    # from loading or unloading adapters under the names the pool has verified
    spawn_key = secrets.token_urlsafe(32) if config.spawn else None
    if config.spawn:
        context = min(limits.context, config.max_model_len)
        limits = dataclasses.replace(limits, context=context)
        log_dir = Path(tempfile.mkdtemp(prefix="lorafleet-vllm-logs-"))
        log.info("spawned vLLM replicas log to %s", log_dir)
        sources = [
            SpawnedVllm(
                f"vllm-{i}",
                model_dir,
                dtype=dtype,
                max_loras=config.max_loras,
                max_lora_rank=max_lora_rank,
                max_model_len=context,
                log_dir=log_dir,
                api_key=spawn_key,
            )
            for i in range(config.spawn)
        ]
    else:
        sources = [
            UrlSource(
                f"{config.engine}-{i}",
                validate_base_url(url, "--rollout-engine URL"),
                config.api_key,
            )
            for i, url in enumerate(config.urls)
        ]

    def engine(url: str) -> PoolEngine:
        name = (
            "base"
            if config.spawn
            else config.served_model_name or served_base_name(url, config.api_key)
        )
        cls = VllmEngine if config.engine == "vllm" else SglangEngine
        key = spawn_key if config.spawn else config.api_key
        return cls(url, dtype=torch_dtype, model_name=name, api_key=key)

    return RolloutPool(
        config,
        trainer,
        sources,
        limits=limits,
        dtype=torch_dtype,
        engine_factory=engine,
        base_model_id=trainer.base_model_id,
    )
