"""What an OpenAI `model` names: the base (by its served name), a `tinker://` checkpoint the
tenant may sample (its own, or a published one, as the Tinker sample route allows), or one of
the tenant's aliases. Anything else, another tenant's unpublished path included, is the same
404 `model_not_found`, so a tenant never learns what others hold."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lorafleet.server.errors import ApiError, UserError
from lorafleet.server.http.aliases import MAX_ALIASES, Aliases
from lorafleet.server.http.served import ServedBase
from lorafleet.server.openai.errors import model_not_found
from lorafleet.server.state.keys import Tenant
from lorafleet.server.state.ownership import Ownership
from lorafleet.server.state.paths import SCHEME, parse_tinker_path
from lorafleet.server.state.store import Store

MAX_LISTED_PATHS = 100  # the newest sampler paths /v1/models lists


@dataclass(frozen=True)
class Target:
    adapter: tuple[str, int] | None  # the sampler version key; None: the base model
    checkpoint_path: str | None


class Models:
    def __init__(self, store: Store, ownership: Ownership, served: ServedBase, aliases: Aliases):
        self.store = store
        self.ownership = ownership
        self.served = served
        self.aliases = aliases

    def resolve(self, tenant: Tenant, model: str) -> Target:
        try:
            self.served.check(model, "model")
            return Target(None, None)
        except UserError:
            pass  # not the base: a path or an alias
        path = model if model.startswith(SCHEME) else self.aliases.target(tenant, model)
        if path is None:
            raise model_not_found(model)
        try:
            row = self.ownership.readable_checkpoint(tenant, parse_tinker_path(path, "model"))
        except ApiError:
            raise model_not_found(model) from None
        return Target((row.tinker_path, 0), row.tinker_path)

    def listing(self, tenant: Tenant) -> dict[str, Any]:
        """The base, the tenant's aliases (newest first) and its newest sampler paths."""
        data = [_model(name, 0, "lorafleet") for name in self.served.names]
        for alias, target, at in self.store.aliases.of_tenant(tenant.id, MAX_ALIASES):
            data.append({**_model(alias, at, "you"), "root": target})
        for path, at in self.store.checkpoints.sampler_paths(tenant.id, MAX_LISTED_PATHS):
            data.append(_model(path, at, "you"))
        return {"object": "list", "data": data}

    def describe(self, tenant: Tenant, model: str) -> dict[str, Any]:
        """One model, as `GET /v1/models/{model}` answers (404 as `resolve`)."""
        target = self.resolve(tenant, model)
        if target.adapter is None:
            return _model(model, 0, "lorafleet")
        row = self.store.checkpoints.get(target.checkpoint_path or "")
        created = 0.0 if row is None else row.created_at
        owner = "you" if row is not None and row.tenant == tenant.id else "published"
        return {**_model(model, created, owner), "root": target.checkpoint_path}


def _model(name: str, created: float, owner: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(created), "owned_by": owner}
