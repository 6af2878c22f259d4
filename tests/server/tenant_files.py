"""Tenants files for tests: keys in, TOML with their sha256 out (what an operator writes)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from lorafleet.server.config import ServerConfig
from tests.server.conftest import server_config


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def tenants_toml(tenants: dict[str, dict[str, Any]]) -> str:
    """`{"alice": {"keys": [...], "weight": 2, "operator": True, "quotas": {...}}}` as TOML."""
    lines: list[str] = []
    for name, spec in tenants.items():
        lines.append(f"[tenants.{name}]")
        hashes = ", ".join(f'"{key_hash(k)}"' for k in spec["keys"])
        lines.append(f"key_sha256 = [{hashes}]")
        for field in ("weight", "operator"):
            if field in spec:
                value = spec[field]
                lines.append(
                    f"{field} = {str(value).lower() if isinstance(value, bool) else value}"
                )
        if spec.get("quotas"):
            lines.append(f"[tenants.{name}.quotas]")
            lines += [f"{k} = {v}" for k, v in spec["quotas"].items()]
        lines.append("")
    return "\n".join(lines)


def write_tenants(path: Path, tenants: dict[str, dict[str, Any]]) -> Path:
    path.write_text(tenants_toml(tenants))
    return path


def tenants_server_config(data_dir: Path, tenants_file: Path, **overrides: Any) -> ServerConfig:
    """A test server whose tenants come from `tenants_file` (no plain API keys)."""
    config = server_config(data_dir, **overrides)
    return dataclasses.replace(config, api_keys=[], tenants_file=tenants_file)
