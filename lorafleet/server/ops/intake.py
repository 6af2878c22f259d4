"""Turning a parsed request into a future and an op in the scheduler, deduplicated by seq_id.

Per (scope, seq_id) there is one future: a retry with the same content gets the original one, a
different request under a used seq_id is a conflict. Once a request names a model the caller
owns and a seq_id, it takes that seq_id's place in the model's order even if its content is bad:
it becomes a future that fails with a user error. Refusing it at the door would leave a gap that
the model's later requests wait on.

Two refusals happen at the door all the same, before anything is recorded: over one of the
tenant's quotas (403, quotas.py; an ordered request's seq_id still takes its place, as a failed
operation, since the SDK does not retry a 403) and past the queue bound (429, admission.py; the
seq_id is not recorded, because the SDK retries a 429 with the same one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lorafleet.server.errors import ApiError, Conflict, UserError
from lorafleet.server.ops.admission import Admission
from lorafleet.server.ops.futures import FutureTable, Result
from lorafleet.server.ops.quotas import QuotaExceeded, Quotas
from lorafleet.server.ops.scheduler import Op, Scheduler
from lorafleet.server.state import ids
from lorafleet.server.state.keys import Tenant
from lorafleet.server.state.ownership import Ownership
from lorafleet.server.state.store import Store

_NOT_LOADED_BECAUSE = {"lost": "the server restarted", "unloaded": "its session finished"}


def promise(request_id: str, model_id: str | None = None) -> dict[str, Any]:
    """The SDK's UntypedAPIFuture."""
    return (
        {"request_id": request_id}
        if model_id is None
        else {"request_id": request_id, "model_id": model_id}
    )


class Intake:
    def __init__(
        self,
        store: Store,
        futures: FutureTable,
        scheduler: Scheduler,
        ownership: Ownership,
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
        self.ownership = ownership
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

    def _prior(self, tenant: Tenant, scope: str, seq_id: int, fingerprint: str) -> str | None:
        """Dedup on (scope, seq_id): a retry gets the original future, a different payload an error."""
        prior = self.store.futures.find(scope, seq_id)
        if prior is None:
            return None
        if prior.tenant == tenant.id and prior.fingerprint == fingerprint:
            return prior.request_id
        raise Conflict(f"seq_id {seq_id} of {scope!r} was already used by a different request")

    def submit(
        self,
        tenant: Tenant,
        kind: str,
        payload: Any,
        *,
        fingerprint: str,
        model_id: str | None = None,
        scope: str | None = None,
        seq_id: int | None = None,
        ordered: bool = True,
    ) -> dict[str, Any]:
        """`payload` may be the ApiError its parsing raised: the future then fails with it (in
        the model's order when `ordered`, at once otherwise)."""
        self.before_submit()
        if scope is not None and seq_id is not None:
            prior = self._prior(tenant, scope, seq_id, fingerprint)
            if prior is not None:
                return promise(prior, model_id)
        request_id = ids.new_request_id()
        failed_now = isinstance(payload, ApiError) and not ordered
        reserved: dict[str, float] = {}
        if self.quotas is not None and not isinstance(payload, ApiError):
            try:
                reserved = self.quotas.check(tenant.id, kind, payload, model_id)
            except QuotaExceeded as exc:
                if ordered and model_id is not None and seq_id is not None:
                    # The refusal still takes the seq_id's place (a failed operation), so the
                    # model's later requests do not wait on a gap for a call never retried.
                    self.submit(
                        tenant,
                        kind,
                        exc,
                        fingerprint=fingerprint,
                        model_id=model_id,
                        scope=scope,
                        seq_id=seq_id,
                    )
                raise
        if self.admission is not None and not failed_now:
            limit = (
                None if self.quotas is None else self.quotas.tenancy.quotas(tenant.id).queued_ops
            )
            self.admission.admit(
                tenant.id, request_id, model_id, seq_id if ordered else None, limit, reserved
            )
        try:
            self.futures.create(
                request_id,
                tenant.id,
                kind=kind,
                scope=scope,
                seq_id=seq_id,
                fingerprint=fingerprint,
            )
        except BaseException:
            if self.admission is not None:
                self.admission.release(request_id)
            raise
        if failed_now:
            self.futures.complete(request_id, Result.error(payload))
        else:
            op_kind = "fail" if isinstance(payload, ApiError) else kind
            self.scheduler.submit(
                Op(
                    request_id,
                    op_kind,
                    tenant.id,
                    payload,
                    model_id=model_id,
                    seq_id=seq_id if ordered else None,
                    scope=scope or model_id,
                )
            )
        return promise(request_id, model_id)

    def submit_for_model(
        self,
        tenant: Tenant,
        model_id: str,
        seq_id: int,
        kind: str,
        build: Callable[[], Any],
        fingerprint: str,
    ) -> dict[str, Any]:
        """An ordered operation on a model; `build()` parses the payload (errors fail the future)."""
        row = self.ownership.model(tenant, model_id)
        try:
            payload = build()
        except ApiError as exc:
            payload = exc
        if row.status != "active":
            reason = _NOT_LOADED_BECAUSE.get(row.status, row.status)
            payload = UserError(
                f"model {model_id!r} is not loaded any more ({reason}); resume it from a checkpoint with "
                "create_training_client_from_state"
            )
            return self.submit(
                tenant,
                kind,
                payload,
                fingerprint=fingerprint,
                model_id=model_id,
                scope=model_id,
                seq_id=seq_id,
                ordered=False,
            )
        self.store.models.touch(model_id)
        return self.submit(
            tenant,
            kind,
            payload,
            fingerprint=fingerprint,
            model_id=model_id,
            scope=model_id,
            seq_id=seq_id,
        )

    def consume_seq(self, tenant: Tenant, body: Any, error: ApiError, fingerprint: str) -> None:
        """Records `error` as the result of the seq_id a body names, when the body names one of
        the caller's models: a request the server refuses before parsing it as an operation (an
        unknown route) has still been numbered by the SDK, and leaving its seq_id empty would
        hold up the model's later requests until the gap timeout. Raises what stops the
        recording (a foreign model: NotFound; the seq_id used by another request: Conflict)."""
        if not isinstance(body, dict):
            return
        model_id, seq_id = body.get("model_id"), body.get("seq_id")
        if not isinstance(model_id, str) or type(seq_id) is not int or seq_id < 1:
            return

        def refuse() -> Any:
            raise error

        self.submit_for_model(tenant, model_id, seq_id, "unknown_route", refuse, fingerprint)
