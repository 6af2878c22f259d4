"""Shared fixtures for the scale-out tests: one Ray cluster per session, tiny-qwen3's targets."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from lorafleet.model.loader import load_base
from lorafleet.model.targets import resolve_tinker_targets


@pytest.fixture(scope="session")
def tiny_targets() -> tuple[str, ...]:
    """Every Tinker target of tiny-qwen3 (attention, MLP, unembedding), as the server wraps."""
    return resolve_tinker_targets(load_base("tiny-qwen3").model)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[object]:
    """One local Ray cluster for the whole session: 2 CPUs, no dashboard. Actors take no CPU
    while they run (Ray's default), so a trainer and two samplers fit."""
    ray = pytest.importorskip("ray")
    env = {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "LORAFLEET_CACHE") if k in os.environ}
    ray.init(
        num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False
    )
    yield ray
    ray.shutdown()
