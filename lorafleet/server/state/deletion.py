"""Deleting a checkpoint or version directory so that a crash never leaves it half-deleted in
view."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path


def remove_tree(path: Path) -> None:
    """Hides the directory with one rename, then deletes it (recovery.sweep removes the hidden
    remains of a crash in between)."""
    if not path.exists():
        return
    hidden = path.with_name(f".{path.name}.deleted-{secrets.token_hex(6)}")
    os.rename(path, hidden)
    shutil.rmtree(hidden)


def prune_empty_parents(path: Path, stop: Path) -> None:
    """Removes `path`'s parent directories up to (not including) `stop` while they are empty:
    deleting a run's last checkpoint frees its run directory too. Every writer creates the
    parents it needs, so an empty one is never relied on."""
    directory = path.parent
    while directory != stop and stop in directory.parents:
        try:
            directory.rmdir()
        except OSError:  # not empty (or already gone): the parents above are not empty either
            return
        directory = directory.parent
