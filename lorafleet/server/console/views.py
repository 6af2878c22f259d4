"""What the console shows, as JSON: a tenant's own runs, curves, checkpoints, sampler versions
and usage, and the operator's view of the fleet.

Every read takes a tenant id from the signed-in session and asks only for that tenant's rows;
a run or checkpoint id of another tenant is a 404 exactly as the Tinker API answers it. The
reads are snapshots (SQLite, and short holds of the scheduler's lock); none of them waits for
the engine worker, so the page's refreshes never slow a training step down."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from lorafleet.server.errors import NotFound, UserError
from lorafleet.server.http.resources import Rest
from lorafleet.server.http.usage import ALL_TENANTS, Usage
from lorafleet.server.ops.run_metrics import RunMetrics
from lorafleet.server.state.keys import Tenant
from lorafleet.server.state.paths import parse_tinker_path
from lorafleet.server.state.store import Store
from lorafleet.server.state.tenants import Tenancy

MAX_RUNS = 200  # the newest runs a tenant's page lists
MAX_CHECKPOINTS = 1000
MAX_ZIP_BYTES = 2 << 30  # a download bigger than this is refused (use the SDK's export)
USAGE_DAYS = 30
EMBEDDED: dict[str, Any] = {"engine": "embedded sampler", "sync": None, "replicas": []}


@dataclass(frozen=True)
class Sources:
    """The server's parts the console reads, named so the console never reaches past them."""

    store: Store
    rest: Rest
    usage: Usage
    run_metrics: RunMetrics
    tenancy: Tenancy
    run_ops: Callable[[str], dict[str, dict[str, int]]]  # scheduler.model_ops
    run_tiers: Callable[[str], Mapping[str, str]]  # live_models.run_tiers
    stats: Callable[[], dict[str, Any]]  # Service.stats


class ConsoleViews:
    def __init__(self, sources: Sources):
        self.s = sources

    # ------------------------------------------------------------------ tenant
    def overview(self, tenant: Tenant) -> dict[str, Any]:
        """Runs with their state, sampler versions with where they are held, usage and quotas."""
        rows, total = self.s.store.models.page(tenant.id, MAX_RUNS, 0)
        ops = self.s.run_ops(tenant.id)
        tiers = self.s.run_tiers(tenant.id)
        runs = []
        for row in rows:
            mine = ops.get(row.model_id, {"queued": 0, "in_flight": 0})
            runs.append(
                {
                    "id": row.model_id,
                    "base_model": row.base_model,
                    "lora_rank": row.lora_rank,
                    "status": row.status,
                    # hot (a trainer slot), warm (host memory), cold (disk); a run that is not
                    # live (unloaded, lost in a restart, a copy) has no tier
                    "state": tiers.get(row.model_id, row.status),
                    "queued": mine["queued"],
                    "in_flight": mine["in_flight"],
                    "created_at": row.created_at,
                    "last_activity": row.last_request_time,
                }
            )
        run_ids = [row.model_id for row in rows]
        rollout = self._rollout(run_ids)
        samplers, _ = self.s.store.checkpoints.page(tenant.id, None, MAX_CHECKPOINTS, 0)
        sampler_versions = [
            {
                "tinker_path": c.tinker_path,
                "run": c.model_id,
                "created_at": c.created_at,
                "held_by": [
                    r["name"]
                    for r in rollout["replicas"]
                    if any(c.model_id in v and c.name in v for v in r["versions"])
                ],
            }
            for c in samplers
            if c.kind == "sampler" and not c.expired()
        ]
        return {
            "tenant": tenant.id,
            "operator": tenant.operator,
            "runs": runs,
            "runs_total": total,
            "samplers": sampler_versions,
            "rollout": rollout,
            "usage": self.usage(tenant),
        }

    def _rollout(self, run_ids: list[str] | None) -> dict[str, Any]:
        """The rollout engine and its replicas (`Service.stats()["rollout"]`); for a tenant
        (`run_ids` given) each replica lists only the versions of that tenant's runs."""
        rollout = self.s.stats().get("rollout")
        if not isinstance(rollout, dict):
            return dict(EMBEDDED)
        replicas = []
        for replica in rollout.get("replicas") or []:
            versions = [str(v) for v in replica.get("versions") or []]
            if run_ids is not None:
                versions = [v for v in versions if any(run in v for run in run_ids)]
            replicas.append(
                {
                    "name": str(replica.get("name")),
                    "url": replica.get("url") if run_ids is None else None,
                    "state": replica.get("state"),
                    "versions": versions,
                    "last_canary": _own_canary(replica.get("last_canary"), run_ids),
                    "restarts": replica.get("restarts", 0),
                    "error": replica.get("error") if run_ids is None else None,
                }
            )
        return {"engine": rollout.get("engine"), "sync": rollout.get("sync"), "replicas": replicas}

    def usage(self, tenant: Tenant) -> dict[str, Any]:
        """Own usage per day (the last USAGE_DAYS) and in total, beside the tenant's quotas."""
        report = self.s.usage.report(Tenant(tenant.id), None, USAGE_DAYS)
        quotas = self.s.tenancy.current.quotas(tenant.id)
        report["quotas"] = {f.name: getattr(quotas, f.name) for f in fields(quotas)}
        return report

    def check_run(self, tenant: Tenant, run: str) -> None:
        """404 unless `run` is the tenant's own (another tenant's run is unknown)."""
        row = self.s.store.models.get(run)
        if row is None or row.tenant != tenant.id:
            raise NotFound(f"unknown model_id {run!r}")

    def run(self, tenant: Tenant, run: str, after_step: int = -1) -> dict[str, Any]:
        """One run's curves and checkpoints."""
        self.check_run(tenant, run)
        return {
            "id": run,
            "series": self.s.run_metrics.series(tenant.id, run, after_step),
            "checkpoints": self.checkpoints(tenant, run),
        }

    def checkpoints(self, tenant: Tenant, run: str) -> list[dict[str, Any]]:
        """The run's newest MAX_CHECKPOINTS, oldest first: a run's listing is in the order they
        were saved, and a long run saving every few steps must keep its latest in view."""
        first = self.s.rest.list_checkpoints(tenant, run, MAX_CHECKPOINTS, 0)
        offset = max(0, first["cursor"]["total_count"] - MAX_CHECKPOINTS)
        if offset:
            first = self.s.rest.list_checkpoints(tenant, run, MAX_CHECKPOINTS, offset)
        listed: list[dict[str, Any]] = first["checkpoints"]
        rows = {
            c.tinker_path: c
            for c in self.s.store.checkpoints.page(tenant.id, run, MAX_CHECKPOINTS, offset)[0]
        }
        for entry in listed:
            row = rows.get(entry["tinker_path"])
            entry["expires_at_s"] = None if row is None else row.expires_at
            entry["created_at_s"] = None if row is None else row.created_at
            entry["downloadable"] = row is not None and row.kind == "sampler"
        return listed

    def set_ttl(self, tenant: Tenant, run: str, checkpoint: str, body: Any) -> dict[str, Any]:
        return self.s.rest.set_checkpoint_ttl(tenant, run, checkpoint, body)

    def delete(self, tenant: Tenant, run: str, checkpoint: str) -> Future[None]:
        return self.s.rest.delete_checkpoint(tenant, run, checkpoint)

    def peft_zip(self, tenant: Tenant, run: str, checkpoint: str) -> tuple[str, bytes]:
        """A sampler checkpoint (a PEFT adapter directory) as a zip: (file name, bytes)."""
        path = parse_tinker_path(f"tinker://{run}/{checkpoint}", "checkpoint_id")
        row = self.s.store.checkpoints.get(str(path))
        if row is None or row.tenant != tenant.id or row.expired():
            raise NotFound(f"unknown checkpoint {path}")
        if row.kind != "sampler":
            raise UserError(
                f"checkpoint {path} is a training checkpoint (weights and optimizer state); "
                "only sampler checkpoints download as a PEFT zip"
            )
        directory = Path(row.dir)
        files = sorted(p for p in directory.rglob("*") if p.is_file())
        size = sum(p.stat().st_size for p in files)
        if size > MAX_ZIP_BYTES:
            raise UserError(
                f"checkpoint {path} holds {size} bytes, more than the console's download limit "
                f"of {MAX_ZIP_BYTES}; export it with save_weights_external instead"
            )
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for file in files:
                archive.write(file, file.relative_to(directory).as_posix())
        return f"{row.name}.zip", buffer.getvalue()

    # ------------------------------------------------------------------ operator
    def operator(self, tenant: Tenant) -> dict[str, Any]:
        """The fleet: fair share per tenant, rounds, mixed batches, tiers, rollout replicas and
        everyone's usage with totals. Operator keys only."""
        if not tenant.operator:
            raise UserError(
                "the operator view is for operator keys (operator = true in the tenants file)",
                status=403,
            )
        stats = self.s.stats()
        everyone = self.s.usage.report(tenant, ALL_TENANTS, USAGE_DAYS)["tenants"]
        totals: dict[str, float] = {}
        for report in everyone.values():
            for counter, value in report["totals"].items():
                totals[counter] = totals.get(counter, 0.0) + value
        fair = stats.get("fair_share", {})
        paging = stats.get("paging", {})
        return {
            "tenants": {
                name: {
                    "usage": report["totals"],
                    "storage_bytes": report["storage"]["checkpoint_bytes"],
                    "queued_ops": 0,
                    "deficit": 0.0,
                    **fair.get("tenants", {}).get(name, {}),
                    "weight": self.s.tenancy.current.weight_of(name),
                }
                for name, report in everyone.items()
            },
            "usage_totals": totals,
            "rounds": stats.get("rounds", 0),
            "rounds_per_s": fair.get("rounds_per_s", 0.0),
            "train_tokens_per_round": fair.get("train_tokens_per_round"),
            "batches": stats.get("batches", {}),
            "mixed_batches": stats.get("mixed_batches", {}),
            "cross_tenant_batches": stats.get("cross_tenant_batches", {}),
            "max_batch_clients": stats.get("max_batch_clients", {}),
            "tiers": (paging.get("training") or {}).get("runs", {}),
            "sampler_paging": paging.get("sampler"),
            "queued_ops": stats.get("queued_ops", 0),
            "max_queued_ops": stats.get("max_queued_ops"),
            "rollout": self._rollout(None),
        }


def _own_canary(canary: Any, run_ids: list[str] | None) -> Any:
    """A replica's last canary as a tenant (`run_ids` given) may see it: its `version` names
    the run and checkpoint it checked, another tenant's as often as not, so it is kept only
    when it is one of the tenant's runs (as `/api/v1/lorafleet/stats` drops it for a tenant)."""
    if run_ids is None or not isinstance(canary, dict):
        return canary
    version = str(canary.get("version"))
    if any(run in version for run in run_ids):
        return canary
    return {k: v for k, v in canary.items() if k != "version"}
