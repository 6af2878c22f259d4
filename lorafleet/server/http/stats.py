"""lorafleet's own counters (not part of the Tinker API): batches per kind, mixed and
cross-tenant batches, loaded models, pending operations. An operator key reads them all; any
other key reads the server-wide counts and only its own per-tenant entries (`own_view`), and
rollout replicas without the names of the versions they hold, and the prefix cache's counters
of its own prompts only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from lorafleet.server.http import API
from lorafleet.server.http.bodies import tenant


def own_view(stats: dict[str, Any], tenant_id: str) -> dict[str, Any]:
    """The stats as tenant `tenant_id` may see them: the entries keyed by tenant (fair-share
    queues, weights and deficits, the turn order, training waits) cut to its own, since other
    tenants' names and activity are theirs (another tenant's models answer 404 too)."""
    view = dict(stats)
    waits = view.get("train_wait_rounds")
    if isinstance(waits, dict):
        view["train_wait_rounds"] = {t: n for t, n in waits.items() if t == tenant_id}
    fair = view.get("fair_share")
    if isinstance(fair, dict):
        fair = dict(fair)
        tenants = fair.get("tenants")
        if isinstance(tenants, dict):
            fair["tenants"] = {t: e for t, e in tenants.items() if t == tenant_id}
        order = fair.get("turn_order")
        if isinstance(order, list):
            fair["turn_order"] = [t for t in order if t == tenant_id]
        view["fair_share"] = fair
    cache = view.get("prefix_cache")
    if isinstance(cache, dict):
        view["prefix_cache"] = _own_prefix_cache(cache, tenant_id)
    rollout = view.get("rollout")
    if isinstance(rollout, dict) and isinstance(rollout.get("replicas"), list):
        # Which versions a replica holds, and the last canary's version, name other tenants'
        # runs and checkpoints: a tenant sees each replica's state and a count only.
        view["rollout"] = {
            **rollout,
            "replicas": [_replica_counts(r) for r in rollout["replicas"]],
        }
    return view


def _own_prefix_cache(cache: dict[str, Any], tenant_id: str) -> dict[str, Any]:
    """The prefix cache as one tenant sees it: on or off, its block size and the tenant's own
    counters. The totals (hit tokens, bytes, blocks, evictions) move with what other tenants
    send, which is how a guess at another tenant's prompt showed (issue 34): operators only."""
    tenants = cache.get("tenants")
    own = tenants.get(tenant_id) if isinstance(tenants, dict) else None
    counters = own if isinstance(own, dict) else {}
    return {
        "enabled": cache.get("enabled"),
        "block_tokens": cache.get("block_tokens"),
        "lookups": counters.get("lookups", 0),
        "hit_tokens": counters.get("hit_tokens", 0),
        "missed_tokens": counters.get("missed_tokens", 0),
        "hit_rate": counters.get("hit_rate", 0.0),
        "inserts": counters.get("inserts", 0),
    }


def _replica_counts(replica: Any) -> Any:
    if not isinstance(replica, dict):
        return replica
    shown = {k: v for k, v in replica.items() if k not in ("versions", "last_canary", "error")}
    # an error may quote the version it failed on
    shown["error"] = None if replica.get("error") is None else "failing (details: operator view)"
    versions = replica.get("versions")
    shown["versions"] = len(versions) if isinstance(versions, list) else 0
    canary = replica.get("last_canary")
    if isinstance(canary, dict):
        shown["last_canary"] = {k: v for k, v in canary.items() if k != "version"}
    else:
        shown["last_canary"] = None
    return shown


def add_routes(app: FastAPI, stats: Callable[[], dict[str, Any]]) -> None:

    @app.get(f"{API}/lorafleet/stats")
    async def server_stats(request: Request) -> dict[str, Any]:
        caller = tenant(request)
        return stats() if caller.operator else own_view(stats(), caller.id)
