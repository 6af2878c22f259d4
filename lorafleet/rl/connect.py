"""Where the Tinker API comes from: an embedded lorafleet server (default) or a remote URL.

Embedded runs keep the server's data dir and one API key per tenant inside the run dir, so
`--resume` reaches the same checkpoints and the exported PEFT directories can be copied out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tinker

from lorafleet.fsio import atomic_directory, atomic_write_json, ensure_private_dir
from lorafleet.hardware import (
    DeviceChoice,
    DtypeChoice,
    parse_device,
    resolve_device,
    resolve_dtype,
)

if TYPE_CHECKING:
    from lorafleet.engines import RolloutConfig
    from lorafleet.server.main import ServerThread

log = logging.getLogger(__name__)


@dataclass
class Backend:
    base_url: str
    base_model: str  # the name the server knows the base by
    tokenizer_dir: Path | None  # local HF dir with the tokenizer (None: ask the server)
    data_dir: Path | None = None  # embedded only: where sampler weights live as PEFT dirs
    server: ServerThread | None = field(default=None, repr=False)

    def client(self, api_key: str) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.base_url, api_key=api_key)

    def peft_dir(self, api_key: str, sampler_path: str) -> Path | None:
        """The PEFT directory behind a `tinker://.../sampler_weights/...` path (embedded only)."""
        if self.data_dir is None:
            return None
        from lorafleet.server.state.paths import checkpoint_dir, parse_tinker_path

        tenant = hashlib.sha256(api_key.encode("utf-8")).digest().hex()[:16]  # as server/auth.py
        return checkpoint_dir(self.data_dir, tenant, parse_tinker_path(sampler_path))

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


# the embedded server's per-round token budget: large enough that no call is split in practice
EMBEDDED_ROUND_TOKENS = 1 << 20


def tenant_keys(run_dir: Path, names: list[str], given: list[str] | None) -> dict[str, str]:
    """One key per tenant: given keys (remote servers), else generated once and kept (0600) in
    the run dir so a resumed embedded run authenticates as the same tenants."""
    if given:
        if len(given) < len(names):
            raise ValueError(
                f"--api-key: {len(given)} key(s) for {len(names)} tenants; give one per tenant or set one"
            )
        return dict(zip(names, given, strict=False))
    path = run_dir / "api_keys.json"
    keys: dict[str, str] = json.loads(path.read_text()) if path.is_file() else {}
    missing = [n for n in names if n not in keys]
    if missing:
        keys.update({n: f"tml-lorafleet-{secrets.token_hex(16)}" for n in missing})
        atomic_write_json(path, keys)
    return {n: keys[n] for n in names}


def embedded_device(value: str, base_url: str | None) -> DeviceChoice:
    """Where the embedded server runs (`--device` resolved and printed with the device's name
    and memory); raises DeviceUnavailableError for a CUDA device that is not here, so callers
    resolve it before writing anything. With `base_url` the remote server decides, and the
    value is only recorded."""
    if base_url:
        requested = parse_device(value)
        return DeviceChoice(
            requested, requested, "remote", None, None, f"not used: the engines run on {base_url}"
        )
    choice = resolve_device(value)
    print(f"lorafleet: device {choice.describe()}", file=sys.stderr)
    return choice


def embedded_dtype(value: str, base_url: str | None, device: str = "cpu") -> DtypeChoice:
    """The embedded server's base dtype (`auto` resolved for `device` and printed with its
    reason); with `base_url` the remote server decides, and the value is only recorded."""
    if base_url:
        return DtypeChoice(value, f"not used: the base model runs on {base_url}", auto=False)
    choice = resolve_dtype(value, device)
    print(f"lorafleet: dtype {choice.dtype} ({choice.reason})", file=sys.stderr)
    return choice


def start_backend(
    *,
    base_model: str,
    run_dir: Path,
    keys: list[str],
    base_url: str | None,
    dtype: str = "float32",
    max_adapters: int = 8,
    max_rank: int = 32,
    torch_threads: int | None = None,
    max_sample_rows: int = 64,
    rollout: RolloutConfig | None = None,
    device: str = "cpu",
    numerics: str = "fast",  # model/numerics.py DEFAULT_NUMERICS
) -> Backend:
    """Starts the embedded server on a free loopback port unless `base_url` is given."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    if base_url:
        return Backend(
            base_url=base_url.rstrip("/"),
            base_model=base_model,
            tokenizer_dir=_local_tokenizer(base_model),
        )
    from lorafleet.engines import EngineConfig
    from lorafleet.model.loader import resolve_base
    from lorafleet.model.numerics import parse_numerics
    from lorafleet.server.config import ServerConfig
    from lorafleet.server.main import ServerThread, free_port

    _model_id, model_dir = resolve_base(base_model)
    data_dir = ensure_private_dir(run_dir / "server-data")
    engine = EngineConfig(
        base_model=base_model,
        dtype=dtype,
        max_adapters=max_adapters,
        sampler_slots=max(8, 2 * max_adapters),
        max_lora_rank=max_rank,
        max_sample_rows=max_sample_rows,
        rollout=rollout,
        device=device,
        numerics=parse_numerics(numerics),
        # on CUDA the trainer's micro-batches and the prefix cache follow the free memory
        memory_planned=frozenset({"token_budget", "prefix_cache_bytes"}),
    )
    config = ServerConfig(
        base_model=base_model,
        data_dir=data_dir,
        api_keys=list(keys),
        port=free_port(),
        engine=engine,
        torch_threads=torch_threads,
        # One user's own server: its tenants are that user's runs, so throughput beats a bound
        # on one run's wait. Every round takes all ready work, as one batch (a shared server's
        # 512-token rounds cost this job about a quarter of its time; docs/tenancy.md).
        round_token_budget=EMBEDDED_ROUND_TOKENS,
    )
    server = ServerThread(config)
    return Backend(server.base_url, base_model, model_dir, data_dir=data_dir, server=server)


def _local_tokenizer(base_model: str) -> Path | None:
    """For a remote server the tokenizer still loads here: a preset or local dir if it is one."""
    from lorafleet.model.presets import is_preset

    if is_preset(base_model):
        from lorafleet.model.loader import resolve_base

        return resolve_base(base_model)[1]
    path = Path(base_model).expanduser()
    return (
        path
        if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file()
        else None
    )


def load_tokenizer(backend: Backend, training_client: tinker.TrainingClient) -> Any:  # HF type
    if backend.tokenizer_dir is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(backend.tokenizer_dir))
    return training_client.get_tokenizer()  # the server's tokenizer_id: a hub-style name


def export_adapter(backend: Backend, api_key: str, sampler_path: str, dest: Path) -> Path | None:
    """Copies the PEFT dir of a sampler checkpoint into the run dir; None when the server is
    remote (its files are not on this machine)."""
    src = backend.peft_dir(api_key, sampler_path)
    if src is None:
        return None
    if not src.is_dir():
        raise FileNotFoundError(f"sampler checkpoint {sampler_path} has no PEFT dir at {src}")
    with atomic_directory(dest, overwrite=True) as tmp:
        for item in src.iterdir():
            if item.is_file():
                shutil.copyfile(item, tmp / item.name)
    return dest
