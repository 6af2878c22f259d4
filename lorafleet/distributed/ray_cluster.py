"""Joining a Ray cluster: the one place that imports Ray (an optional dependency)."""

from __future__ import annotations

import os
from types import ModuleType


def ray_module() -> ModuleType:
    """The `ray` module, or a message that says which extra installs it."""
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "Ray placement needs the 'dist' extra: pip install 'lorafleet[dist]'"
        ) from exc
    return ray


def connect(address: str, *, num_cpus: int | None = None) -> None:
    """`address`: a Ray address (`ray://host:10001`, `host:6379`), `auto` (the cluster this
    machine belongs to), or `local` (start a private one-machine cluster, no dashboard)."""
    ray = ray_module()
    if ray.is_initialized():
        return
    env = {
        k: v for k, v in os.environ.items() if k in ("HF_HUB_OFFLINE", "LORAFLEET_CACHE", "HF_HOME")
    }
    runtime_env = {"env_vars": env} if env else None
    if address == "local":
        ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env)
    else:
        ray.init(address=address, runtime_env=runtime_env)
