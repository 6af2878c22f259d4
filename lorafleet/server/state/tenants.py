"""Who the tenants are: their keys (as sha256 hashes), scheduling weight, operator flag and
quotas, from `LORAFLEET_API_KEYS` / `--api-key-file` (the simple case) or a tenants file
(`--tenants-file tenants.toml`).

A tenant's id names its directory (`tenants/<id>/...`) and owns its rows in SQLite, so it must
stay the same across restarts and reloads. In the simple case it is the first 16 hex digits of
the key's sha256 (auth.tenant_id). In a tenants file it is the table's name, checked to be a safe
directory name; to keep a key-only tenant's data when moving to a tenants file, name its table
after that id (`lorafleet keyhash` prints both the hash and the id).

```toml
[tenants.alice]
key_sha256 = ["<64 hex digits: sha256 of the key>"]  # never the key itself
weight = 2.0                # share of the engine under contention (default 1)
operator = true             # reads everyone's usage and /metrics (default false)
[tenants.alice.quotas]      # every quota optional; absent = unlimited
registered_runs = 100
resident_runs = 4
max_lora_rank = 32
trained_tokens_per_day = 5_000_000
sampled_tokens_per_day = 5_000_000
storage_bytes = 20_000_000_000
queued_ops = 512
```

The config is one immutable object; a reload parses the whole file and swaps it in at once, so a
request sees either the old config or the new one, never a mix, and a file that does not parse
or validate leaves the old one in force (the error names the line).
"""

from __future__ import annotations

import logging
import math
import re
import threading
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from lorafleet.server.state.keys import KeyRing, hash_key, tenant_id

log = logging.getLogger(__name__)

TENANT_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
"""Lower case (no two names that a case-insensitive filesystem would merge), no dots or slashes:
a tenant name becomes a directory name."""
_HASH = re.compile(r"[0-9a-f]{64}")
_TENANT_KEYS = frozenset({"key_sha256", "weight", "operator", "quotas"})
_AT_LEAST_ONE = {
    "queued_ops": "0 would answer every request with 429, which the SDK retries for minutes",
    "resident_runs": "a run trains only in a slot",
}
"""Quotas for which 0 means nothing useful (to shut a tenant out, remove its table)."""


class TenantsFileError(ValueError):
    """The tenants file is not valid; the message names the file, the line and the problem."""


@dataclass(frozen=True)
class Quotas:
    """Per tenant; None is unlimited. Tokens count per UTC day."""

    registered_runs: int | None = None
    resident_runs: int | None = None
    max_lora_rank: int | None = None
    trained_tokens_per_day: int | None = None
    sampled_tokens_per_day: int | None = None
    storage_bytes: int | None = None
    queued_ops: int | None = None


QUOTA_NAMES = tuple(f.name for f in fields(Quotas))
UNLIMITED = Quotas()


@dataclass(frozen=True)
class TenantSpec:
    id: str
    key_hashes: tuple[bytes, ...]
    weight: float = 1.0
    operator: bool = False
    quotas: Quotas = field(default_factory=Quotas)


@dataclass(frozen=True)
class TenantsConfig:
    """One generation of the tenant config: the keys and what each tenant may do."""

    tenants: Mapping[str, TenantSpec]
    keys: KeyRing
    source: str

    @staticmethod
    def from_specs(specs: Iterable[TenantSpec], source: str) -> TenantsConfig:
        by_id = {spec.id: spec for spec in specs}
        ring = KeyRing.from_hashes(
            {h: (spec.id, spec.operator) for spec in by_id.values() for h in spec.key_hashes}
        )
        return TenantsConfig(by_id, ring, source)

    @staticmethod
    def from_keys(keys: Iterable[str], source: str = "API keys") -> TenantsConfig:
        """The simple case: one tenant per key, weight 1, no quotas, no operator."""
        specs = [TenantSpec(tenant_id(hash_key(k)), (hash_key(k),)) for k in keys]
        if not specs:
            raise ValueError("no API keys: a server needs at least one tenant")
        return TenantsConfig.from_specs(specs, source)

    def spec(self, tenant: str) -> TenantSpec | None:
        return self.tenants.get(tenant)

    def quotas(self, tenant: str) -> Quotas:
        spec = self.tenants.get(tenant)
        return UNLIMITED if spec is None else spec.quotas

    def weight_of(self, tenant: str) -> float:
        spec = self.tenants.get(tenant)
        return 1.0 if spec is None else spec.weight

    def max_resident(self, tenant: str) -> int | None:
        return self.quotas(tenant).resident_runs


def _line_of(text: str, table: str, key: str | None = None) -> int | None:
    """The line of `[table]` (or of `key = ...` inside it): tomllib gives positions only for
    syntax errors, and a validation error is as useless without one."""
    lines = text.splitlines()
    header = re.compile(r"\s*\[\s*" + r"\s*\.\s*".join(map(re.escape, table.split("."))) + r"\s*\]")
    for i, line in enumerate(lines):
        if header.match(line):
            if key is None:
                return i + 1
            pattern = re.compile(r"\s*" + re.escape(key) + r"\s*=")
            for j in range(i + 1, len(lines)):
                if lines[j].lstrip().startswith("["):
                    break
                if pattern.match(lines[j]):
                    return j + 1
            return i + 1
    return None


class _Checker:
    def __init__(self, text: str, source: str):
        self.text = text
        self.source = source

    def fail(self, table: str, key: str | None, problem: str) -> TenantsFileError:
        line = _line_of(self.text, table, key)
        where = f"{self.source}, line {line}" if line is not None else self.source
        name = f"[{table}]" + (f" {key}" if key is not None else "")
        return TenantsFileError(f"{where}: {name}: {problem}")

    def quota(self, table: str, key: str, value: Any) -> int:
        if type(value) is not int or value < 0:
            raise self.fail(table, key, f"must be a whole number >= 0, got {value!r}")
        if value == 0 and key in _AT_LEAST_ONE:
            raise self.fail(table, key, f"must be >= 1, got 0 ({_AT_LEAST_ONE[key]})")
        return value

    def tenant(self, name: str, body: Any) -> TenantSpec:
        table = f"tenants.{name}"
        if not TENANT_NAME.fullmatch(name):
            raise self.fail(
                table,
                None,
                f"tenant name {name!r} must be 1-64 of a-z 0-9 _ - starting with a letter or "
                "digit (it names the tenant's directory)",
            )
        if not isinstance(body, dict):
            raise self.fail(table, None, f"must be a table, got {type(body).__name__}")
        unknown = sorted(set(body) - _TENANT_KEYS)
        if unknown:
            raise self.fail(
                table, unknown[0], f"unknown key (allowed: {', '.join(sorted(_TENANT_KEYS))})"
            )
        hashes = body.get("key_sha256")
        if not isinstance(hashes, list) or not hashes:
            raise self.fail(
                table,
                "key_sha256",
                "must be a non-empty list of sha256 hex digests of the tenant's keys "
                "(`lorafleet keyhash` prints one)",
            )
        digests: list[bytes] = []
        for i, value in enumerate(hashes):
            if not isinstance(value, str) or not _HASH.fullmatch(value.lower()):
                # the value itself is not echoed: it may be a key pasted by mistake
                shown = (
                    f"{len(value)} characters" if isinstance(value, str) else type(value).__name__
                )
                raise self.fail(
                    table,
                    "key_sha256",
                    f"entry {i} ({shown}) is not 64 hex digits; write the sha256 of the key "
                    "(`lorafleet keyhash`), never the key itself",
                )
            digests.append(bytes.fromhex(value))
        weight = body.get("weight", 1.0)
        if (
            type(weight) not in (int, float)
            or not math.isfinite(float(weight))
            or float(weight) <= 0
        ):
            raise self.fail(table, "weight", f"must be a number > 0, got {weight!r}")
        operator = body.get("operator", False)
        if type(operator) is not bool:
            raise self.fail(table, "operator", f"must be true or false, got {operator!r}")
        raw_quotas = body.get("quotas", {})
        quota_table = f"{table}.quotas"
        if not isinstance(raw_quotas, dict):
            raise self.fail(table, "quotas", "must be a table")
        unknown = sorted(set(raw_quotas) - set(QUOTA_NAMES))
        if unknown:
            raise self.fail(
                quota_table, unknown[0], f"unknown quota (known: {', '.join(QUOTA_NAMES)})"
            )
        quotas = Quotas(**{k: self.quota(quota_table, k, v) for k, v in raw_quotas.items()})
        return TenantSpec(name, tuple(digests), float(weight), operator, quotas)


def parse_tenants(text: str, source: str) -> TenantsConfig:
    """Raises TenantsFileError naming `source`, the line and the problem."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # its message says "(at line N, column M)", or "(at end of document)": the last line
        found = re.search(r"at line (\d+)", str(exc))
        line = int(found.group(1)) if found else max(1, len(text.splitlines()))
        raise TenantsFileError(f"{source}, line {line}: not valid TOML: {exc}") from None
    check = _Checker(text, source)
    unknown = sorted(set(data) - {"tenants"})
    if unknown:
        raise check.fail(unknown[0], None, "unknown table (the file holds [tenants.<name>] tables)")
    tenants = data.get("tenants")
    if not isinstance(tenants, dict) or not tenants:
        raise TenantsFileError(f"{source}: no tenants: add a [tenants.<name>] table per tenant")
    specs = [check.tenant(name, body) for name, body in tenants.items()]
    owner: dict[bytes, str] = {}
    for spec in specs:
        for digest in spec.key_hashes:
            if digest in owner:
                raise check.fail(
                    f"tenants.{spec.id}",
                    "key_sha256",
                    f"key {digest.hex()[:8]}... is also tenant {owner[digest]!r}'s; a key "
                    "belongs to one tenant",
                )
            owner[digest] = spec.id
    return TenantsConfig.from_specs(specs, source)


def load_tenants_file(path: str | Path) -> TenantsConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TenantsFileError(f"{path}: cannot read the tenants file: {exc}") from None
    return parse_tenants(text, str(path))


class Tenancy:
    """The config in force, swapped whole on reload. Readers take `current` once per decision;
    the swap is one attribute assignment, so they never see half a config."""

    def __init__(self, config: TenantsConfig, path: Path | None = None):
        self.current = config
        self.path = path
        self.reloads = 0
        self.reload_failures = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()  # one reload at a time (SIGHUP and a test's call)

    def reload(self) -> TenantsConfig:
        """Reads the file again. On any error the old config stays in force and the error is
        raised (and kept in `last_error`); on success the new one is used from the next request
        on, and work already admitted runs as it was."""
        if self.path is None:
            raise TenantsFileError("this server has no tenants file to reload (it uses API keys)")
        with self._lock:
            try:
                config = load_tenants_file(self.path)
            except TenantsFileError as exc:
                self.reload_failures += 1
                self.last_error = str(exc)
                raise
            self.current = config
            self.reloads += 1
            self.last_error = None
            return config

    def weight_of(self, tenant: str) -> float:
        """For the scheduler's fair share."""
        return self.current.weight_of(tenant)

    def max_resident(self, tenant: str) -> int | None:
        """For paging: how many of the tenant's runs may hold a bank slot at once."""
        return self.current.max_resident(tenant)

    def quotas(self, tenant: str) -> Quotas:
        return self.current.quotas(tenant)


class Reloader:
    """Reloads the tenants file when asked from a signal handler: `request()` only sets an
    event (safe in a handler, which runs on the main thread that uvicorn's loop owns); this
    thread does the reading. A failed reload is logged and the loop goes on."""

    def __init__(self, tenancy: Tenancy):
        self.tenancy = tenancy
        self._wanted = threading.Event()
        self._stop = threading.Event()
        self.done = threading.Event()  # set after each attempt (tests wait on it)
        self._thread = threading.Thread(target=self._loop, name="lorafleet-tenants", daemon=True)
        self._thread.start()

    def request(self) -> None:
        self._wanted.set()

    def _loop(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._stop.is_set():
                return
            try:
                config = self.tenancy.reload()
                log.info(
                    "tenants reloaded from %s: %d tenant(s)", config.source, len(config.tenants)
                )
            except TenantsFileError as exc:
                log.error("tenants file not reloaded, the previous config stays in force: %s", exc)
            except Exception:
                self.tenancy.reload_failures += 1
                log.exception("tenants reload failed; the previous config stays in force")
            finally:
                self.done.set()

    def close(self) -> None:
        self._stop.set()
        self._wanted.set()
        self._thread.join(5)
