"""Model aliases: a tenant's own short names for its `tinker://` paths, so that OpenAI clients
and eval harnesses (which take a model name from a config file) can be pointed at a new
checkpoint without editing every config.

An alias is scoped to its tenant (another tenant's alias of the same name is another alias), is
checked against the target when it is set (the tenant must be able to read the path, as the
Tinker sample route requires), and is resolved again at every request: a target deleted or
unpublished since makes the alias answer "not found", never the base model. Names take a strict
alphabet and a length bound so they are safe in URLs, logs and JSON, and a tenant holds at most
`MAX_ALIASES`, which bounds the model listing."""

from __future__ import annotations

import re
import time
from typing import Any

from lorafleet.server.errors import NotFound, UserError
from lorafleet.server.http.served import ServedBase
from lorafleet.server.state.keys import Tenant
from lorafleet.server.state.ownership import Ownership
from lorafleet.server.state.paths import SCHEME, parse_tinker_path
from lorafleet.server.state.store import Store

MAX_ALIASES = 100
MAX_ALIAS_CHARS = 64
_ALIAS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_alias_name(alias: object) -> str:
    """The name, or a UserError naming what is wrong with it."""
    if (
        not isinstance(alias, str)
        or not 1 <= len(alias) <= MAX_ALIAS_CHARS
        or _ALIAS.fullmatch(alias) is None
    ):
        raise UserError(
            f"alias {alias!r} is not a valid name: 1 to {MAX_ALIAS_CHARS} characters of A-Z, a-z, "
            "0-9, '.', '_' and '-', starting with a letter or digit"
        )
    return alias


class Aliases:
    def __init__(self, store: Store, ownership: Ownership, served: ServedBase):
        self.store = store
        self.ownership = ownership
        self.served = served

    def put(self, tenant: Tenant, alias: str, body: Any) -> dict[str, Any]:
        """Creates the alias or points it at a new target."""
        check_alias_name(alias)
        if alias in (*self.served.names, self.served.base_id):
            raise UserError(f"alias {alias!r} is the base model's name; choose another name")
        if not isinstance(body, dict) or set(body) - {"target"}:
            extra = sorted(body) if isinstance(body, dict) else body
            raise UserError(f'the body must be {{"target": "tinker://..."}}, got fields {extra!r}')
        target = body.get("target")
        self.ownership.readable_checkpoint(tenant, parse_tinker_path(target, "target"))
        assert isinstance(target, str)  # parse_tinker_path accepted it
        at = time.time()
        if not self.store.aliases.put(tenant.id, alias, target, at, MAX_ALIASES):
            raise UserError(
                f"you already have {MAX_ALIASES} aliases, this server's limit; delete one first",
                status=403,
            )
        return _view(alias, target, at)

    def get(self, tenant: Tenant, alias: str) -> dict[str, Any]:
        check_alias_name(alias)
        found = self.store.aliases.get(tenant.id, alias)
        if found is None:
            raise NotFound(f"unknown alias {alias!r}")
        return _view(alias, *found)

    def list(self, tenant: Tenant) -> dict[str, Any]:
        rows = self.store.aliases.of_tenant(tenant.id, MAX_ALIASES)
        return {"aliases": [_view(*row) for row in rows]}

    def delete(self, tenant: Tenant, alias: str) -> dict[str, Any]:
        check_alias_name(alias)
        if not self.store.aliases.delete(tenant.id, alias):
            raise NotFound(f"unknown alias {alias!r}")
        return {}

    def target(self, tenant: Tenant, name: str) -> str | None:
        """The path an alias names, or None when `name` is no alias of this tenant (a name
        outside the alias alphabet is simply not one)."""
        if name.startswith(SCHEME):
            return None
        try:
            check_alias_name(name)
        except UserError:
            return None
        found = self.store.aliases.get(tenant.id, name)
        return None if found is None else found[0]


def _view(alias: str, target: str, created_at: float) -> dict[str, Any]:
    return {"alias": alias, "target": target, "created_at": created_at}
