"""Staging adapter directories where an engine can load them from.

`files` sync writes a PEFT directory and asks the engine to load it by path. Two cases:

- `LocalStaging`: the engine shares this machine (or a filesystem): the directory is
  published atomically under a private root (temp dir, fsync, rename; 0700/0600) and the
  engine is given its path;
- `RemoteStaging`: the engine is on another host and nothing is assumed shared: the
  directory is built locally the same way, streamed to the staging receiver next to the
  engine (staging_server.py, bearer token), which publishes it atomically there and returns
  the path *on the engine's host*; the local copy is then removed.

Staged names are `<adapter>@<version>` (plus a suffix for merged checkpoints), validated
before they touch any path.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from lorafleet.adapters.peft_io import export_peft
from lorafleet.fsio import PathLike, ensure_private_dir
from lorafleet.sync.base import AdapterUpdate, SyncError
from lorafleet.sync.httpclient import JsonClient
from lorafleet.sync.staging_server import StagingError, check_dir_name, encode_directory

__all__ = ["LocalStaging", "RemoteStaging", "Staging", "stage_peft"]

Writer = Callable[[Path], None]
"""Publishes a complete directory at the given (not yet existing) path, atomically."""


class Staging(Protocol):
    def stage(self, name: str, write: Writer) -> str:
        """Publishes a directory named `name` and returns its path as the engine sees it."""
        ...

    def remove(self, name: str) -> None: ...


def _check_root(root: PathLike) -> Path:
    path = Path(root).expanduser()
    if not path.is_absolute():
        raise ValueError(f"staging root must be an absolute path, got {str(root)!r}")
    if ".." in path.parts:
        raise ValueError(f"staging root must not contain '..': {str(root)!r}")
    return ensure_private_dir(path).resolve()


class LocalStaging:
    """Directories under `root` on this machine, which the engine reads directly."""

    def __init__(self, root: PathLike):
        self.root = _check_root(root)

    def path(self, name: str) -> Path:
        path = self.root / check_dir_name(name)
        if path.parent != self.root:
            raise StagingError(f"staging name {name!r} escapes {self.root}")
        return path

    def stage(self, name: str, write: Writer) -> str:
        dest = self.path(name)
        if dest.exists():
            raise SyncError(
                f"{dest} is already staged; versions are immutable, so a version number was reused"
            )
        write(dest)
        if not dest.is_dir():
            raise SyncError(f"staging {name!r} produced no directory at {dest}")
        return str(dest)

    def remove(self, name: str) -> None:
        dest = self.path(name)
        if dest.is_symlink():
            raise StagingError(f"{dest} is a symlink; not removing it")
        if dest.is_dir():
            shutil.rmtree(dest)


class RemoteStaging:
    """Uploads staged directories to a staging receiver on the engine's host."""

    def __init__(
        self, url: str, token: str, *, scratch: PathLike | None = None, timeout: float = 600.0
    ):
        if not isinstance(token, str) or len(token) < 16:
            raise ValueError("the staging token must be a string of at least 16 characters")
        self.client = JsonClient(url, api_key=token, timeout=timeout, what="staging receiver")
        self._scratch_owned = scratch is None
        self.scratch = (
            _check_root(scratch)
            if scratch is not None
            else Path(tempfile.mkdtemp(prefix="lorafleet-staging-"))
        )

    def stage(self, name: str, write: Writer) -> str:
        check_dir_name(name)
        local = self.scratch / name
        if local.exists():
            shutil.rmtree(local)
        write(local)
        try:
            length, chunks = encode_directory(local)
            reply = self.client.request(
                "PUT",
                f"/v1/staging/{name}",
                content=chunks,
                headers={"Content-Length": str(length), "Content-Type": "application/octet-stream"},
                ok_statuses=(201,),
            )
        finally:
            shutil.rmtree(local, ignore_errors=True)
        path = reply.get("path") if isinstance(reply, dict) else None
        if (
            not isinstance(path, str)
            or not path.startswith("/")
            or Path(path).name != name
            or ".." in Path(path).parts
        ):
            raise SyncError(f"staging receiver returned an unusable path for {name!r}: {reply!r}")
        return path

    def remove(self, name: str) -> None:
        check_dir_name(name)
        self.client.request("DELETE", f"/v1/staging/{name}")

    def close(self) -> None:
        self.client.close()
        if self._scratch_owned:
            shutil.rmtree(self.scratch, ignore_errors=True)


def stage_peft(staging: Staging, update: AdapterUpdate, *, expert_layout: str = "peft") -> str:
    """Writes the update as a PEFT LoRA directory named `<adapter>@<version>`; returns the
    engine-side path. fp32 tensors: engines cast to their own dtype, and rounding here would
    make the canary compare against something the trainer never computed. `expert_layout`
    only matters for MoE experts: "peft" (PEFT's fused `target_parameters`) or "checkpoint"
    (per-expert 2-D keys, what vLLM loads for Qwen3-MoE and Mixtral; see docs/moe.md)."""

    def write(dest: Path) -> None:
        export_peft(
            update.bank,
            update.slot,
            dest,
            base_model_name_or_path=update.base_model_id,
            expert_layout=expert_layout,
        )

    return staging.stage(update.version.name, write)
