"""A typed op in, a future and a queued job out: the one door between the HTTP stage and the
scheduler.

The HTTP stage has already parsed the request into an `Op` (or a `Refused` holding the error
its parsing raised) and checked that the caller may name what it names. Here, in one pass:

1. a model that is no longer loaded turns the op into a `Refused` (failed at once, not in order);
2. dedup on `(scope, seq_id)`: a retry with the same content gets the original future, a
   different request under a used seq_id is a conflict;
3. quotas (403, quotas.py): the request's cost is reserved, or it is refused; an ordered
   request's seq_id still takes its place as a failed operation, since the SDK does not retry
   a 403;
4. the queue bound (429, admission.py): nothing is recorded, because the SDK retries a 429
   with the same seq_id;
5. the future is recorded and the job queued.

Once a request names a model the caller owns and a seq_id, it takes that seq_id's place in
the model's order even if its content is bad: a `Refused` op fails in order. Refusing it at
the door would leave a gap that the model's later requests wait on.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

from lorafleet.server.errors import Conflict, UserError
from lorafleet.server.ops.admission import Admission
from lorafleet.server.ops.futures import FutureTable, Result
from lorafleet.server.ops.quotas import QuotaExceeded, Quotas
from lorafleet.server.ops.scheduler import Scheduler
from lorafleet.server.ops.types import Job, Op, Refused
from lorafleet.server.state import ids
from lorafleet.server.state.keys import Tenant
from lorafleet.server.state.store import ModelRow, Store

_NOT_LOADED_BECAUSE = {"lost": "the server restarted", "unloaded": "its session finished"}


@dataclass(frozen=True)
class Promise:
    """The SDK's UntypedAPIFuture."""

    request_id: str
    model_id: str | None = None

    def json(self) -> dict[str, str]:
        if self.model_id is None:
            return {"request_id": self.request_id}
        return {"request_id": self.request_id, "model_id": self.model_id}


@dataclass(frozen=True)
class Place:
    """Where a request sits: its model (None: not a model's request), the scope its seq_id is
    deduplicated in (a model or a sampling session), and whether that seq_id orders it."""

    model_id: str | None = None
    scope: str | None = None
    seq_id: int | None = None
    ordered: bool = False

    @staticmethod
    def in_model(model_id: str, seq_id: int) -> Place:
        return Place(model_id, model_id, seq_id, ordered=True)


class Intake:
    def __init__(
        self,
        store: Store,
        futures: FutureTable,
        scheduler: Scheduler,
        before_submit: Callable[[], None],
        *,
        admission: Admission | None = None,
        quotas: Quotas | None = None,
    ):
        """`before_submit` runs at the start of every submission: the service's periodic
        maintenance rides on incoming work rather than on a timer thread of its own.
        `admission` bounds the queued requests (429 past it), `quotas` refuses a request over
        one of its tenant's quotas (403); both decide before anything is recorded."""
        self.store = store
        self.futures = futures
        self.scheduler = scheduler
        self.before_submit = before_submit
        self.admission = admission
        self.quotas = quotas

    def check_new_model(self, model_id: str) -> None:
        """A create under an id that already names a model is a conflict, unless it is a retry
        of the create that made it (which dedup answers with the original future)."""
        if (
            self.store.futures.find(model_id, 0) is None
            and self.store.models.get(model_id) is not None
        ):
            raise Conflict(f"model {model_id!r} already exists")

    def check_room(self, tenant: Tenant, model: ModelRow, seq_id: int) -> None:
        """Raises the 429 that submitting a request for `seq_id` of `model` would get at the
        queue bound, before the caller decodes a large body for it. A retry of a recorded
        request is never refused here: it gets its first future, whatever the queue holds."""
        if self.admission is None or model.status != "active":
            return
        refusal = self.admission.refusal(
            tenant.id, model.model_id, seq_id, self._queue_limit(tenant)
        )
        # the store is read only when the queue is full: a retry there gets its first future
        if refusal is not None and self.store.futures.find(model.model_id, seq_id) is None:
            self.admission.refuse(refusal)

    def submit_to_model(
        self, tenant: Tenant, model: ModelRow, seq_id: int, op: Op, fingerprint: str
    ) -> Promise:
        """An op on one of the caller's models (`model`: its row, ownership already checked),
        in the model's seq_id order."""
        if model.status != "active":
            reason = _NOT_LOADED_BECAUSE.get(model.status, model.status)
            refused = Refused(
                UserError(
                    f"model {model.model_id!r} is not loaded any more ({reason}); resume it from "
                    "a checkpoint with create_training_client_from_state"
                ),
                op.kind,
            )
            place = Place(model.model_id, model.model_id, seq_id, ordered=False)
            return self.submit(tenant, refused, place, fingerprint)
        self.store.models.touch(model.model_id)
        return self.submit(tenant, op, Place.in_model(model.model_id, seq_id), fingerprint)

    def submit(self, tenant: Tenant, op: Op, place: Place, fingerprint: str) -> Promise:
        """Records `op` as a future and queues it, or answers a retry with its first future. A
        `Refused` op fails in its model's order when `place.ordered`, at once otherwise."""
        self.before_submit()
        if place.scope is not None and place.seq_id is not None:
            prior = self._prior(tenant, place.scope, place.seq_id, fingerprint)
            if prior is not None:
                return Promise(prior, place.model_id)
        request_id = ids.new_request_id()
        failed_now = isinstance(op, Refused) and not place.ordered
        # The quota check and the admission that holds its reservation are one step under the
        # quotas' lock: concurrent requests cannot both pass against the same headroom.
        with self.quotas.lock if self.quotas is not None else nullcontext():
            reserved: dict[str, float] = {}
            if self.quotas is not None and not isinstance(op, Refused):
                try:
                    reserved = self.quotas.check(tenant.id, op, place.model_id)
                except QuotaExceeded as exc:
                    if place.ordered:
                        # The refusal still takes the seq_id's place (a failed operation), so
                        # the model's later requests do not wait on a gap for a call never
                        # retried.
                        self.submit(tenant, Refused(exc, op.kind), place, fingerprint)
                    raise
            if self.admission is not None and not failed_now:
                self.admission.admit(
                    tenant.id,
                    request_id,
                    place.model_id,
                    place.seq_id if place.ordered else None,
                    self._queue_limit(tenant),
                    reserved,
                )
        try:
            self.futures.create(
                request_id,
                tenant.id,
                kind=op.asked if isinstance(op, Refused) else op.kind,
                scope=place.scope,
                seq_id=place.seq_id,
                fingerprint=fingerprint,
            )
        except BaseException:
            if self.admission is not None:
                self.admission.release(request_id)
            raise
        if failed_now:
            assert isinstance(op, Refused)
            self.futures.complete(request_id, Result.error(op.error))
        else:
            self.scheduler.submit(
                Job(
                    request_id,
                    tenant.id,
                    op,
                    model_id=place.model_id,
                    seq_id=place.seq_id if place.ordered else None,
                    scope=place.scope or place.model_id,
                )
            )
        return Promise(request_id, place.model_id)

    def _queue_limit(self, tenant: Tenant) -> int | None:
        """The tenant's `queued_ops` quota, None without quotas."""
        return None if self.quotas is None else self.quotas.tenancy.quotas(tenant.id).queued_ops

    def _prior(self, tenant: Tenant, scope: str, seq_id: int, fingerprint: str) -> str | None:
        """Dedup on (scope, seq_id): a retry gets the original future, a different payload an error."""
        prior = self.store.futures.find(scope, seq_id)
        if prior is None:
            return None
        if prior.tenant == tenant.id and prior.fingerprint == fingerprint:
            return prior.request_id
        raise Conflict(f"seq_id {seq_id} of {scope!r} was already used by a different request")
