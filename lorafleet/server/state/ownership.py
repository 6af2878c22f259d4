"""Tenant-scoped lookups: an id the caller does not own is a 404 whether it exists or not, so
tenants cannot probe each other's sessions, models, checkpoints or samplers."""

from __future__ import annotations

from lorafleet.server.errors import NotFound, UserError
from lorafleet.server.state import public_checkpoints
from lorafleet.server.state.keys import Tenant
from lorafleet.server.state.paths import TinkerPath
from lorafleet.server.state.store import (
    CheckpointRow,
    ModelRow,
    SamplingSessionRow,
    SessionRow,
    Store,
)


class Ownership:
    def __init__(self, store: Store):
        self.store = store

    def session(self, tenant: Tenant, session_id: str, *, active: bool = True) -> SessionRow:
        """`active`: a finished session is refused too (a user error, it is the caller's own)."""
        row = self.store.sessions.get(session_id)
        if row is None or row.tenant != tenant.id:
            raise NotFound(f"unknown session_id {session_id!r}")
        if active and row.finished_at is not None:
            raise UserError(f"session {session_id!r} has finished; create a new ServiceClient")
        return row

    def model(self, tenant: Tenant, model_id: str) -> ModelRow:
        row = self.store.models.get(model_id)
        if row is None or row.tenant != tenant.id:
            raise NotFound(f"unknown model_id {model_id!r}")
        return row

    def checkpoint(
        self, tenant: Tenant, path: TinkerPath, *, expired_ok: bool = False
    ) -> CheckpointRow:
        """An expired checkpoint is refused before maintenance deletes it, except to its owner's
        delete (`expired_ok`): deleting it early is what maintenance will do anyway, and until
        then its name stays taken."""
        row = self.store.checkpoints.get(str(path))
        if row is None or row.tenant != tenant.id:
            raise NotFound(f"unknown checkpoint {path}")
        if row.expired() and not expired_ok:
            raise NotFound(f"checkpoint {path} has expired (its ttl_seconds ran out)")
        return row

    def readable_checkpoint(
        self, tenant: Tenant, path: TinkerPath, *, with_optimizer: bool = False
    ) -> CheckpointRow:
        """The caller's own checkpoint, or another tenant's published one for reading its
        weights (public_checkpoints.py); its optimizer state stays the owner's (403)."""
        row = self.store.checkpoints.get(str(path))
        if (
            row is not None
            and row.tenant != tenant.id
            and public_checkpoints.is_public(row)
            and not row.expired()
        ):
            if with_optimizer:
                raise public_checkpoints.optimizer_refused(str(path))
            return row
        return self.checkpoint(tenant, path)

    def readable_model(self, tenant: Tenant, model_id: str, access_scope: str) -> ModelRow:
        """`access_scope` "accessible" (the SDK's word) also reaches another tenant's run that
        has a published checkpoint; "owned" only the caller's."""
        if access_scope not in ("owned", "accessible"):
            raise UserError(f"access_scope must be 'owned' or 'accessible', got {access_scope!r}")
        row = self.store.models.get(model_id)
        if (
            access_scope == "accessible"
            and row is not None
            and row.tenant != tenant.id
            and self.store.checkpoints.has_public(model_id)
        ):
            return row
        return self.model(tenant, model_id)

    def sampling_session(self, tenant: Tenant, sampler_id: str) -> SamplingSessionRow:
        row = self.store.sampling_sessions.get(sampler_id)
        if row is None or row.tenant != tenant.id:
            raise NotFound(f"unknown sampling_session_id {sampler_id!r}")
        return row
