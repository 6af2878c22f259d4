"""Reading what was metered: a tenant's own usage (`GET /api/v1/lorafleet/usage`), everyone's
for an operator key, and the Prometheus exposition of `/metrics` (operator only).

The Prometheus side is a custom collector on a registry of this server's own (never the
process-wide default registry), so several servers in one process (tests, notebooks) do not
collide, and every scrape reads the current values instead of mirroring them into metric
objects as they change."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lorafleet.server.errors import NotFound, UserError
from lorafleet.server.http import API
from lorafleet.server.http.off_loop import OffLoop
from lorafleet.server.ops.admission import Admission
from lorafleet.server.ops.metering import COUNTERS, Metering, usage_report, utc_day
from lorafleet.server.ops.quotas import Quotas
from lorafleet.server.state.keys import Tenant
from lorafleet.server.state.store import Store
from lorafleet.server.state.tenants import Tenancy

MAX_DAYS = 366
ALL_TENANTS = "*"
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST


class Forbidden(UserError):
    status = 403


class Usage:
    def __init__(
        self,
        store: Store,
        metering: Metering,
        tenancy: Tenancy,
        admission: Admission,
        quotas: Quotas,
        scheduler_stats: Callable[[], dict[str, Any]],
    ):
        self.store = store
        self.metering = metering
        self.tenancy = tenancy
        self.admission = admission
        self.quotas = quotas
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self, scheduler_stats))

    def _one(self, tenant: str, since: str) -> dict[str, Any]:
        report = usage_report(
            tenant,
            self.metering.rows(tenant, since),
            self.metering.totals(tenant),
            self.store.checkpoints.bytes_per_run(tenant),
        )
        report["since_day"] = since
        return report

    def report(self, caller: Tenant, tenant: str | None, days: int) -> dict[str, Any]:
        """The caller's own usage; `tenant` another's (or "*", everyone's): operators only.
        Per day for the last `days` UTC days, totals over all time."""
        if type(days) is not int or not 1 <= days <= MAX_DAYS:
            raise UserError(f"days must be a whole number from 1 to {MAX_DAYS}, got {days!r}")
        since = utc_day(time.time() - (days - 1) * 86400)
        wanted = caller.id if tenant is None else tenant
        if wanted != caller.id and not caller.operator:
            raise Forbidden(
                f"tenant={tenant!r}: only an operator key reads another tenant's usage; "
                "leave tenant out to read your own"
            )
        if wanted not in (ALL_TENANTS, caller.id) and not self._known(wanted):
            # zeros would read as "used nothing", and hide a typo in an operator's query
            raise NotFound(
                f"tenant={tenant!r}: no such tenant (not in the tenants file, and nothing "
                "metered or stored under that id)"
            )
        if wanted != ALL_TENANTS:
            return self._one(wanted, since)
        everyone = set(self.tenancy.current.tenants)
        everyone.update(t for t, _run, _c, _v in self.metering.totals(None))
        everyone.update(t for t, _run, _b in self.store.checkpoints.bytes_per_run(None))
        return {"tenants": {t: self._one(t, since) for t in sorted(everyone)}}

    def _known(self, tenant: str) -> bool:
        """In the tenants file now, or with usage or checkpoints recorded (a tenant removed
        from the file keeps its history)."""
        return (
            tenant in self.tenancy.current.tenants
            or bool(self.metering.totals(tenant))
            or bool(self.store.checkpoints.bytes_per_run(tenant))
        )

    def metrics(self, caller: Tenant) -> bytes:
        if not caller.operator:
            raise Forbidden("/metrics is for operator keys (operator = true in the tenants file)")
        return generate_latest(self.registry)


_PREFIX_CACHE_COUNTERS = {
    "lookups": "Prompt prefills that looked up the sampler's prefix cache",
    "hit_tokens": "Prompt tokens taken from the prefix cache instead of computed",
    "missed_tokens": "Prompt tokens computed by prefills",
    "inserts": "KV blocks added to the prefix cache",
    "evictions": "KV blocks evicted from the prefix cache (byte budget, LRU)",
    "invalidated": "KV blocks dropped because their version was dropped or published again",
}
_PREFIX_CACHE_GAUGES = {
    "bytes": "Bytes of KV the prefix cache holds",
    "max_bytes": "The prefix cache's byte budget (0 = off)",
    "blocks": "KV blocks the prefix cache holds",
    "hit_rate": "hit_tokens / (hit_tokens + missed_tokens) since start",
}


def _prefix_cache_metrics(stats: dict[str, Any] | None) -> Iterator[Metric]:
    """The sampler's prefix cache (lorafleet/sample/prefix_cache.py); nothing when it has none."""
    if stats is None:
        return
    for name, doc in _PREFIX_CACHE_COUNTERS.items():
        yield CounterMetricFamily(
            f"lorafleet_prefix_cache_{name}", doc, value=float(stats.get(name, 0))
        )
    for name, doc in _PREFIX_CACHE_GAUGES.items():
        yield GaugeMetricFamily(
            f"lorafleet_prefix_cache_{name}", doc, value=float(stats.get(name, 0))
        )


class _Collector(Collector):
    def __init__(self, usage: Usage, scheduler_stats: Callable[[], dict[str, Any]]):
        self.usage = usage
        self.scheduler_stats = scheduler_stats

    def collect(self) -> Iterator[Metric]:
        usage = self.usage
        counters = CounterMetricFamily(
            "lorafleet_usage",
            "Metered use per tenant since the data dir was made (metering.py names the counters)",
            labels=["tenant", "counter"],
        )
        per_tenant: dict[tuple[str, str], float] = defaultdict(float)
        for tenant, _run, counter, value in usage.metering.totals(None):
            per_tenant[(tenant, counter)] += value
        for tenant in usage.tenancy.current.tenants:
            for counter in COUNTERS:
                per_tenant.setdefault((tenant, counter), 0.0)
        for (tenant, counter), value in sorted(per_tenant.items()):
            counters.add_metric([tenant, counter], value)
        yield counters

        storage = GaugeMetricFamily(
            "lorafleet_checkpoint_storage_bytes",
            "Bytes of checkpoints stored per tenant (expired ones until deleted)",
            labels=["tenant"],
        )
        stored: dict[str, int] = defaultdict(int)
        for tenant, _run, size in usage.store.checkpoints.bytes_per_run(None):
            stored[tenant] += size
        for tenant, size in sorted(stored.items()):
            storage.add_metric([tenant], size)
        yield storage

        queued = GaugeMetricFamily(
            "lorafleet_queued_ops", "Requests admitted and not finished", labels=["tenant"]
        )
        for tenant, count in sorted(usage.admission.queued_by_tenant().items()):
            queued.add_metric([tenant], count)
        yield queued
        yield GaugeMetricFamily(
            "lorafleet_max_queued_ops",
            "The queue bound: past it requests get 429",
            value=usage.admission.max_queued_ops,
        )
        yield CounterMetricFamily(
            "lorafleet_queue_refused", "Requests refused with 429", value=usage.admission.refused
        )
        yield CounterMetricFamily(
            "lorafleet_quota_refused", "Requests refused over a quota", value=usage.quotas.refused
        )
        weights = GaugeMetricFamily(
            "lorafleet_tenant_weight", "Fair-share weight per tenant", labels=["tenant"]
        )
        for tenant, spec in sorted(usage.tenancy.current.tenants.items()):
            weights.add_metric([tenant], spec.weight)
        yield weights
        yield CounterMetricFamily(
            "lorafleet_tenant_reloads",
            "Tenants file reloads that took effect",
            value=usage.tenancy.reloads,
        )
        yield CounterMetricFamily(
            "lorafleet_tenant_reload_failures",
            "Tenants file reloads refused (the old config stayed)",
            value=usage.tenancy.reload_failures,
        )
        stats = self.scheduler_stats()
        requests = CounterMetricFamily(
            "lorafleet_requests", "Operations completed per kind", labels=["kind"]
        )
        for kind, count in sorted(stats.get("requests", {}).items()):
            requests.add_metric([kind], count)
        yield requests
        failed = CounterMetricFamily(
            "lorafleet_requests_failed", "Operations failed per kind", labels=["kind"]
        )
        for kind, count in sorted(stats.get("failed", {}).items()):
            failed.add_metric([kind], count)
        yield failed
        batches = CounterMetricFamily(
            "lorafleet_batches", "Engine batches per kind", labels=["kind"]
        )
        for kind, count in sorted(stats.get("batches", {}).items()):
            batches.add_metric([kind], count)
        yield batches
        yield CounterMetricFamily(
            "lorafleet_rounds", "Engine rounds", value=float(stats.get("rounds", 0))
        )
        yield from _prefix_cache_metrics(stats.get("prefix_cache"))


# Metering read back (lorafleet's own, not the Tinker API): `GET /api/v1/lorafleet/usage`
# for a tenant's own usage (an operator key: `?tenant=<id>` or `?tenant=*`), and `GET /metrics`,
# Prometheus text, for operator keys only. Both are behind the key gate like every route.


METRICS_ROUTE = "/metrics"


def add_routes(app: FastAPI, usage: Usage, off: OffLoop) -> None:

    @app.get(f"{API}/lorafleet/usage")
    async def read_usage(
        request: Request,
        of: Annotated[str | None, Query(alias="tenant")] = None,
        days: int = 30,
    ) -> dict[str, Any]:
        return await off.call(request, lambda who: usage.report(who, of, days))

    @app.get(METRICS_ROUTE)
    async def metrics(request: Request) -> Response:
        text = await off.call(request, usage.metrics)
        return Response(text, media_type=METRICS_CONTENT_TYPE)
