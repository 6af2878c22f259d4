"""API keys: each `tml-...` key is one tenant; only sha256 hashes are kept in memory.

Keys come from `LORAFLEET_API_KEYS` (comma-separated) and/or a key file (one per line, `#`
comments), or from a tenants file (tenants.py), which holds only the keys' hashes. In the simple
case the tenant id is a prefix of the key's hash (`tenant_id`), so it is stable across restarts
(the SQLite store and the data directory are keyed by it) without ever writing a key to disk.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from lorafleet.server.errors import Unauthorized

ENV_VAR = "LORAFLEET_API_KEYS"
KEY_PREFIX = "tml-"
_MIN_KEY_LENGTH = len(KEY_PREFIX) + 8


@dataclass(frozen=True)
class Tenant:
    # the tenants file's name for it, or 16 hex chars of sha256(key): safe as a directory name
    id: str
    operator: bool = False  # reads every tenant's usage and /metrics


def hash_key(key: str) -> bytes:
    """What a tenants file stores for a key (as hex): its sha256."""
    return hashlib.sha256(key.encode("utf-8")).digest()


def tenant_id(digest: bytes) -> str:
    """A key-only tenant's id: the first 16 hex digits of its key's sha256, not reversible."""
    return digest.hex()[:16]


_hash = hash_key


def parse_keys(lines: Iterable[str], source: str) -> list[str]:
    """Validates keys the way the SDK will (it refuses keys without `tml-` before sending)."""
    keys: list[str] = []
    for number, raw in enumerate(lines, 1):
        key = raw.strip()
        if not key or key.startswith("#"):
            continue
        if not key.startswith(KEY_PREFIX):
            raise ValueError(
                f"{source}: key #{number} does not start with {KEY_PREFIX!r}; the tinker SDK only sends keys that do"
            )
        if len(key) < _MIN_KEY_LENGTH or any(c.isspace() or c == "," for c in key):
            raise ValueError(f"{source}: key #{number} is too short or contains whitespace/commas")
        keys.append(key)
    return keys


def load_keys(
    key_file: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> list[str]:
    environ: Mapping[str, str] = os.environ if env is None else env
    keys = parse_keys(environ.get(ENV_VAR, "").split(","), f"${ENV_VAR}")
    if key_file is not None:
        path = Path(key_file)
        keys += parse_keys(path.read_text(encoding="utf-8").splitlines(), str(path))
    if not keys:
        raise ValueError(
            f"no API keys: set ${ENV_VAR}=tml-... (comma-separated) or pass --api-key-file"
        )
    return keys


class KeyRing:
    """Checks a presented key against every stored hash (constant time per comparison, and
    always all of them, so timing does not reveal which tenant a near-miss resembles)."""

    def __init__(self, keys: Iterable[str]):
        """One key-only tenant per key (ids from `tenant_id`)."""
        self._owners = {_hash(k): (tenant_id(_hash(k)), False) for k in keys}
        if not self._owners:
            raise ValueError("KeyRing needs at least one key")
        self._hashes = sorted(self._owners)

    @classmethod
    def from_hashes(cls, owners: Mapping[bytes, tuple[str, bool]]) -> KeyRing:
        """`owners`: key hash -> (tenant id, operator), as a tenants file names them."""
        ring = cls.__new__(cls)
        ring._owners = dict(owners)
        if not ring._owners:
            raise ValueError("KeyRing needs at least one key")
        ring._hashes = sorted(ring._owners)
        return ring

    def __len__(self) -> int:
        return len(self._hashes)

    def authenticate(self, presented: str | None) -> Tenant:
        if not presented:
            raise Unauthorized("missing API key: send it in the X-API-Key header")
        digest = _hash(presented)
        match: bytes | None = None
        for stored in self._hashes:
            if hmac.compare_digest(stored, digest):
                match = stored
        if match is None:
            raise Unauthorized("invalid API key")
        tenant, operator = self._owners[match]
        return Tenant(id=tenant, operator=operator)
