"""Joining a Ray cluster, and where on it an actor should run: the one place that imports Ray
(an optional dependency).

Placement by node role: a cluster's nodes are started with a Ray custom resource that names
what they are for (`ray start --resources '{"lorafleet_sampler": 1}'`), and `--trainer-resource`
/ `--sampler-resource` name those resources. The resource is read as a marker, not reserved:
each actor gets a *soft* affinity to one live node that offers it (spread round robin by the
actor's index), so when that node dies its replacement goes to any live node instead of waiting
for one that may never come back.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)


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


def nodes_offering(resource: str) -> list[str]:
    """The ids of the live nodes whose resources include `resource`, sorted."""
    ray = ray_module()
    return sorted(
        str(node["NodeID"])
        for node in ray.nodes()
        if node.get("Alive") and float(node.get("Resources", {}).get(resource, 0)) > 0
    )


def placement_options(resource: str | None, index: int) -> dict[str, Any]:
    """Actor options that prefer a live node offering `resource` (see the module docstring);
    none when `resource` is None or no live node offers it (Ray then places it anywhere)."""
    if resource is None:
        return {}
    nodes = nodes_offering(resource)
    if not nodes:
        log.warning("no live Ray node offers resource %r: placing the actor anywhere", resource)
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = nodes[index % len(nodes)]
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=True)}


def current_node() -> dict[str, str]:
    """This actor's node id and address (reported in the server's stats)."""
    ray = ray_module()
    return {
        "node_id": str(ray.get_runtime_context().get_node_id()),
        "node_ip": str(ray.util.get_node_ip_address()),
    }
