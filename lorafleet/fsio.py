"""Crash-safe, owner-only file output.

Everything lorafleet persists (adapter exports, training checkpoints, server state) holds a
tenant's private weights and is read back by other processes, so two rules hold everywhere:
- a reader sees either the old file/directory or the complete new one, never a torn write
  (write to a temp name in the same directory, fsync, rename, fsync the directory);
- nothing is readable by other users (files 0600, directories 0700), from the moment it is
  created, not after a chmod that a concurrent reader could race.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = [
    "atomic_directory",
    "atomic_save_safetensors",
    "atomic_write_bytes",
    "atomic_write_json",
    "ensure_private_dir",
    "safe_name",
]

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
_NAME_MAX = 128

PathLike = str | os.PathLike[str]


def safe_name(name: object, field: str) -> str:
    """Returns `name` if it can be used as a single path component, else raises ValueError.

    User-supplied names (adapter ids, run names) end up in paths; one that contains a
    separator, is `..`, or is hidden could escape or shadow the directory it is meant for.
    """
    if not isinstance(name, str):
        raise ValueError(f"{field} must be a string, got {type(name).__name__} {name!r}")
    if not name:
        raise ValueError(f"{field} must not be empty")
    if len(name) > _NAME_MAX:
        raise ValueError(
            f"{field} is {len(name)} characters long, at most {_NAME_MAX} allowed: {name[:40]!r}..."
        )
    if not _NAME_RE.fullmatch(name):
        raise ValueError(f"{field} {name!r} may only contain letters, digits, '.', '_' and '-'")
    if name.startswith("."):
        raise ValueError(f"{field} {name!r} must not start with '.'")
    return name


def ensure_private_dir(path: PathLike) -> Path:
    """mkdir -p where every directory created is 0700 (os.makedirs only sets the leaf's mode).

    Directories that already exist keep their mode: they may be shared ones like $HOME.
    """
    path = Path(path)
    missing: list[Path] = []
    current = path
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # a concurrent creator got there first
            directory.mkdir(mode=0o700)
            os.chmod(directory, 0o700)  # mkdir's mode is filtered by the umask
    if not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory")
    return path


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_replace(path: PathLike, fill: Callable[[int, Path], None]) -> Path:
    """Creates a 0600 temp file next to `path`, lets `fill` write it, then publishes it.

    `fill` gets both the open descriptor and the temp path because some writers (safetensors)
    only take a path; fsync works on the file, whichever descriptor wrote it.
    """
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        try:
            fill(fd, tmp)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: PathLike, data: bytes) -> Path:
    """Writes `data` to `path` (0600) so that readers never see a partial file."""

    def fill(fd: int, _tmp: Path) -> None:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]

    return _atomic_replace(path, fill)


def atomic_write_json(path: PathLike, obj: Any) -> Path:
    """Strict JSON (NaN/inf rejected, since other languages' parsers refuse them), sorted keys."""
    text = json.dumps(obj, indent=2, sort_keys=True, allow_nan=False)
    return atomic_write_bytes(path, (text + "\n").encode())


def atomic_save_safetensors(
    path: PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> Path:
    """safetensors' save_file, published atomically; tensors are made contiguous CPU copies."""
    if metadata is not None:
        bad = {
            k: v for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)
        }
        if bad:
            raise ValueError(f"safetensors metadata must map str to str, got {bad!r}")
    prepared = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    meta = dict(metadata) if metadata is not None else None

    def fill(_fd: int, tmp: Path) -> None:
        save_file(prepared, str(tmp), metadata=meta)

    return _atomic_replace(path, fill)


def _seal_tree(root: Path) -> None:
    """Drops group/other permission bits and fsyncs every file and directory under `root`,
    so the rename that publishes it cannot expose data that is not yet on disk."""
    for dirpath, _dirnames, filenames in os.walk(root, followlinks=False):
        directory = Path(dirpath)
        for name in filenames:
            file = directory / name
            st = os.lstat(file)
            if stat.S_ISLNK(st.st_mode):
                continue
            os.chmod(file, stat.S_IMODE(st.st_mode) & 0o700)
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.chmod(directory, stat.S_IMODE(os.lstat(directory).st_mode) & 0o700)
        _fsync_dir(directory)


@contextlib.contextmanager
def atomic_directory(dest: PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yields a private temp directory next to `dest`; publishes it as `dest` on success.

    On an exception the temp directory is removed and `dest` is untouched. With
    `overwrite=True` an existing `dest` is swapped out (old renamed aside, new renamed in,
    old deleted), so at every instant `dest` is either the complete old or the complete new
    tree. Without it an existing `dest` is refused, before the body runs and again at publish.
    """
    dest = Path(dest)
    if dest.name in ("", ".", ".."):
        raise ValueError(f"cannot publish a directory at {str(dest)!r}")
    parent = ensure_private_dir(dest.parent)
    if os.path.lexists(dest) and not overwrite:
        raise FileExistsError(f"{dest} already exists (pass overwrite=True to replace it)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=parent))
    aside: Path | None = None
    try:
        yield tmp
        _seal_tree(tmp)
        if os.path.lexists(dest):
            if not overwrite:
                raise FileExistsError(
                    f"{dest} appeared while it was being written; not replacing it"
                )
            if not dest.is_dir() or dest.is_symlink():
                raise FileExistsError(f"{dest} exists and is not a directory; not replacing it")
            aside = parent / f".{dest.name}.old-{secrets.token_hex(6)}"
            os.rename(dest, aside)
            try:
                os.rename(tmp, dest)
            except BaseException:
                os.rename(aside, dest)
                aside = None
                raise
        else:
            os.rename(tmp, dest)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the original error is the one worth reporting
        raise
    if aside is not None:
        # The new tree is published; a leftover old copy is litter, not a failed write.
        try:
            shutil.rmtree(aside)
        except OSError as exc:
            log.warning(
                "published %s but could not remove the replaced copy %s: %s", dest, aside, exc
            )
