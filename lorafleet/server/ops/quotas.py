"""Quota checks, made at intake before anything is recorded or run (tenants.py defines them):
registered runs and max LoRA rank at create, trained and sampled tokens per UTC day at
forward_backward and sample, checkpoint storage at save.

A refusal is 403, not 429: 429 tells the tinker SDK to retry (for 5 minutes), and a quota does
not clear in minutes; it clears when the day turns or the operator raises it. The message names
the quota, the limit, the current usage and what the request needs, and a per-day refusal also
carries `Retry-After` with the seconds to 00:00 UTC, for clients that read it.

Per-day tokens are checked against what the request can use at most (its forward_backward
tokens; `num_samples x max_tokens` for a sample) plus what the tenant's admitted, unfinished
requests may still use (admission.py), so concurrent requests cannot together pass the limit.
A save is checked against the bytes the tenant stores now plus the likely size of the new
checkpoint (store.checkpoints.size_estimate), so storage can pass the limit only by the error
of that estimate; a `copy_weights` reserves its source's size until its copy is written.

Every check reserves at admission: the check and the reservation happen under one lock
(`Quotas.lock`, held by intake.py across the check and `Admission.admit`; `reserve_storage`
for copies), so two concurrent requests can never both pass against the same headroom. A
reservation is held until the work ends, failed or not (admission.py drops it once the
request's future is no longer pending; by then metering has counted what it did).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from itertools import count
from typing import assert_never

from lorafleet.server.errors import ApiError
from lorafleet.server.ops.admission import Admission
from lorafleet.server.ops.metering import Metering, sample_bound, seconds_to_next_day
from lorafleet.server.ops.types import (
    CreateFromState,
    CreateModel,
    Forward,
    ForwardBackward,
    LoadWeights,
    Op,
    OptimStep,
    Refused,
    Sample,
    SaveExternal,
    SaveSampler,
    SaveWeights,
)
from lorafleet.server.state.store import Store
from lorafleet.server.state.tenants import Tenancy

_CHECKPOINT_KINDS = {
    SaveWeights: ("training",),
    SaveSampler: ("sampler",),
    SaveExternal: ("external",),
}


class QuotaExceeded(ApiError):
    status = 403

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


def _amount(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:g}"


class Quotas:
    def __init__(
        self,
        tenancy: Tenancy,
        store: Store,
        metering: Metering,
        admission: Admission,
        context_length: int | None,
    ):
        self.tenancy = tenancy
        self.store = store
        self.metering = metering
        self.admission = admission
        self.context_length = context_length
        self.refused = 0
        # held across a check and its reservation (intake.py, `reserve_storage`): re-entrant,
        # since a refusal records its failed seq_id through the same intake
        self.lock = threading.RLock()
        self._storage_held: dict[int, tuple[str, int]] = {}  # copies in flight: tenant, bytes
        self._tickets = count()

    def _refuse(
        self, tenant: str, quota: str, limit: int, used: float, needs: float, when: str = ""
    ) -> QuotaExceeded:
        self.refused += 1
        daily = quota.endswith("_per_day")
        message = (
            f"quota {quota} of tenant {tenant} exceeded: limit {limit}, used {_amount(used)}{when}, "
            f"this request needs {_amount(needs)}"
        )
        retry = None
        if daily:
            retry = seconds_to_next_day(self.metering.clock())
            message += f" (the count resets at 00:00 UTC, in {retry:.0f} s)"
        else:
            message += "; ask the operator to raise it"
        return QuotaExceeded(message, retry)

    def check(self, tenant: str, op: Op, model_id: str | None) -> dict[str, float]:
        """Raises QuotaExceeded; returns what the request reserves against per-day quotas and
        run counts while it is queued (admission holds it)."""
        quotas = self.tenancy.quotas(tenant)
        match op:
            case CreateModel() | CreateFromState():
                rank = self._rank(op)
                if quotas.max_lora_rank is not None and rank > quotas.max_lora_rank:
                    raise self._refuse(tenant, "max_lora_rank", quotas.max_lora_rank, rank, rank)
                if quotas.registered_runs is not None:
                    used = self.store.models.count_registered(tenant) + self.admission.reserved(
                        tenant, "registered_runs"
                    )
                    if used + 1 > quotas.registered_runs:
                        raise self._refuse(
                            tenant, "registered_runs", quotas.registered_runs, used, 1
                        )
                return {"registered_runs": 1.0}
            case ForwardBackward():
                return self._daily(
                    tenant, "trained_tokens", quotas.trained_tokens_per_day, op.tokens
                )
            case Sample():
                bound = sample_bound(op, self.context_length)
                return self._daily(tenant, "sampled_tokens", quotas.sampled_tokens_per_day, bound)
            case SaveWeights() | SaveSampler() | SaveExternal():
                if model_id is None or quotas.storage_bytes is None:
                    return {}
                if isinstance(op, SaveSampler) and op.name is None:
                    return {}  # ephemeral: not a stored checkpoint
                model = self.store.models.get(model_id)
                rank = model.lora_rank if model is not None else 0
                needs = self.store.checkpoints.size_estimate(
                    model_id, _CHECKPOINT_KINDS[type(op)], rank
                )
                self.check_storage(tenant, needs)
                return {"storage_bytes": float(needs)}
            case Forward() | OptimStep() | LoadWeights() | Refused():
                return {}
            case _:
                assert_never(op)

    def reserve_storage(self, tenant: str, needs: int) -> Callable[[], None]:
        """Checks and reserves `needs` bytes of checkpoint storage for work outside the queues
        (a copy); returns the release, to call once the checkpoint's row is written or the
        work failed. Raises QuotaExceeded."""
        with self.lock:
            self.check_storage(tenant, needs)
            ticket = next(self._tickets)
            self._storage_held[ticket] = (tenant, needs)

        def release() -> None:
            with self.lock:
                self._storage_held.pop(ticket, None)

        return release

    def check_storage(self, tenant: str, needs: int) -> None:
        """A new checkpoint of about `needs` bytes (a save, or a copy of one)."""
        limit = self.tenancy.quotas(tenant).storage_bytes
        if limit is None:
            return
        with self.lock:
            held = sum(size for who, size in self._storage_held.values() if who == tenant)
        used = (
            sum(size for _t, _r, size in self.store.checkpoints.bytes_per_run(tenant))
            + self.admission.reserved(tenant, "storage_bytes")
            + held
        )
        if used + needs > limit or used >= limit:
            raise self._refuse(tenant, "storage_bytes", limit, used, needs, " in checkpoints")

    def _daily(self, tenant: str, counter: str, limit: int | None, needs: int) -> dict[str, float]:
        if limit is not None:
            used = self.metering.today(tenant, counter) + self.admission.reserved(tenant, counter)
            if used + needs > limit:
                raise self._refuse(tenant, f"{counter}_per_day", limit, used, needs, " today")
        return {counter: float(needs)}

    @staticmethod
    def _rank(op: CreateModel | CreateFromState) -> int:
        if isinstance(op, CreateModel):
            return int(op.lora["rank"])
        return int(op.checkpoint.info["lora"]["rank"])
