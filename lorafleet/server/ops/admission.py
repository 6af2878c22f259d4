"""The queue bound: requests wait in the scheduler's queues, and only past `max_queued_ops` in
all (or a tenant's `queued_ops` quota) is one refused, with 429 and `Retry-After`, which the
tinker SDK retries (its HTTP client honours Retry-After up to 60 s, then its submit loop retries
429 for 5 minutes). A refused request is recorded nowhere, its seq_id included, so the retry is
accepted as the first attempt: nothing is lost and nothing runs twice.

One rule keeps that true under load: a request that work already admitted waits on (an earlier
seq_id of a model with later ones queued) is never refused. The SDK sends a call's chunks
concurrently, the first one last; refusing that one would leave the admitted chunks holding
queue places while they wait for it, and with the queue full of such waiters only the gap
timeout would move them, refusing the retry when it came.

The ledger also holds what each admitted request may still consume against a per-day quota
(quotas.py), so concurrent requests cannot together pass a limit that each passes alone. An
entry leaves once its future is no longer pending; that is checked lazily (a tenant's entries
at its own bound or when a per-day quota is checked, everyone's only at the global bound), so
submitting costs nothing per queued request until a bound is near.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import NoReturn

from lorafleet.server.errors import ApiError
from lorafleet.server.ops.futures import FutureTable


class QueueFull(ApiError):
    """Past the queue bound: try again shortly (the SDK does, by itself)."""

    status = 429
    category = "server"

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


@dataclass
class _Held:
    tenant: str
    model_id: str | None
    seq_id: int | None
    reserved: dict[str, float] = field(default_factory=dict)


class Admission:
    def __init__(self, futures: FutureTable, max_queued_ops: int, retry_after_s: float = 1.0):
        if type(max_queued_ops) is not int or max_queued_ops < 1:
            raise ValueError(f"max_queued_ops must be a whole number >= 1, got {max_queued_ops!r}")
        if not 0 < retry_after_s <= 60:
            raise ValueError(
                f"queue_retry_after_s must be in (0, 60] (the SDK ignores longer), got {retry_after_s!r}"
            )
        self.futures = futures
        self.max_queued_ops = max_queued_ops
        self.retry_after_s = retry_after_s
        self.refused = 0
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._by_tenant: dict[str, set[str]] = {}
        self._by_model: dict[str, dict[int, str]] = {}  # model -> seq_id -> request_id

    def _drop(self, request_id: str) -> None:
        held = self._held.pop(request_id)
        mine = self._by_tenant.get(held.tenant)
        if mine is not None:
            mine.discard(request_id)
            if not mine:
                del self._by_tenant[held.tenant]
        if held.model_id is not None and held.seq_id is not None:
            seqs = self._by_model.get(held.model_id)
            if seqs is not None:
                seqs.pop(held.seq_id, None)
                if not seqs:
                    del self._by_model[held.model_id]

    def _prune(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if request_id in self._held and not self.futures.is_pending(request_id):
                self._drop(request_id)

    def _awaited(self, model_id: str | None, seq_id: int | None) -> bool:
        if model_id is None or seq_id is None:
            return False
        return any(later > seq_id for later in self._by_model.get(model_id, {}))

    def admit(
        self,
        tenant: str,
        request_id: str,
        model_id: str | None,
        seq_id: int | None,
        tenant_limit: int | None,
        reserved: dict[str, float] | None = None,
    ) -> None:
        """Holds a place for `request_id`, or raises QueueFull."""
        with self._lock:
            refusal = self._refusal(tenant, model_id, seq_id, tenant_limit)
            if refusal is not None:
                self.refused += 1
                raise refusal
            self._held[request_id] = _Held(tenant, model_id, seq_id, dict(reserved or {}))
            self._by_tenant.setdefault(tenant, set()).add(request_id)
            if model_id is not None and seq_id is not None:
                self._by_model.setdefault(model_id, {})[seq_id] = request_id

    def refusal(
        self, tenant: str, model_id: str | None, seq_id: int | None, tenant_limit: int | None
    ) -> QueueFull | None:
        """The QueueFull `admit` would raise now, holding and counting nothing: lets a large
        request be refused before its body is decoded (a body decoded only to be answered 429
        is work every other request waits behind). `admit` still decides."""
        with self._lock:
            return self._refusal(tenant, model_id, seq_id, tenant_limit)

    def refuse(self, refusal: QueueFull) -> NoReturn:
        """Counts and raises a refusal that `refusal` returned."""
        with self._lock:
            self.refused += 1
        raise refusal

    def _refusal(
        self, tenant: str, model_id: str | None, seq_id: int | None, tenant_limit: int | None
    ) -> QueueFull | None:
        if tenant_limit is not None and len(self._by_tenant.get(tenant, ())) >= tenant_limit:
            self._prune(list(self._by_tenant.get(tenant, ())))
        if self._awaited(model_id, seq_id):
            return None
        mine = len(self._by_tenant.get(tenant, ()))
        if tenant_limit is not None and mine >= tenant_limit:
            return QueueFull(
                f"tenant {tenant} has {mine} requests queued, its limit (quota queued_ops "
                f"{tenant_limit}); retry when some have finished (the SDK retries by itself)",
                self.retry_after_s,
            )
        if len(self._held) >= self.max_queued_ops:
            self._prune(list(self._held))
        if len(self._held) >= self.max_queued_ops:
            return QueueFull(
                f"the server has {len(self._held)} requests queued, its limit "
                f"(max_queued_ops {self.max_queued_ops}); retry shortly (the SDK retries by itself)",
                self.retry_after_s,
            )
        return None

    def release(self, request_id: str) -> None:
        """Gives back a place whose request was not recorded after all (its future failed to
        be created)."""
        with self._lock:
            if request_id in self._held:
                self._drop(request_id)

    def queued(self, tenant: str | None = None) -> int:
        with self._lock:
            ids = list(self._held) if tenant is None else list(self._by_tenant.get(tenant, ()))
            self._prune(ids)
            return len(self._held) if tenant is None else len(self._by_tenant.get(tenant, ()))

    def queued_by_tenant(self) -> dict[str, int]:
        with self._lock:
            self._prune(list(self._held))
            return {tenant: len(ids) for tenant, ids in self._by_tenant.items()}

    def reserved(self, tenant: str, counter: str) -> float:
        """What the tenant's admitted, unfinished requests may still use of `counter`."""
        with self._lock:
            ids = list(self._by_tenant.get(tenant, ()))
            self._prune(ids)
            return sum(
                self._held[r].reserved.get(counter, 0.0)
                for r in self._by_tenant.get(tenant, ())
                if r in self._held
            )
