"""`copy_weights`: a checkpoint copied under a new training run, which holds only the copy and
cannot be trained (its model row has status "copy"). The files are copied, not shared, so
deleting either checkpoint never affects the other; the copy is published atomically and its
rows are written after it, like every save (recovery.sweep removes a copy whose row never came).
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from lorafleet.fsio import atomic_directory
from lorafleet.server.errors import UserError


def copy_tree(source: Path, dest: Path) -> None:
    """Copies the regular files and directories under `source` to `dest` (owner-only, atomic).
    A symlink or special file in a checkpoint is refused: no save writes one."""
    with atomic_directory(dest) as tmp:
        for dirpath, dirnames, filenames in os.walk(source, followlinks=False):
            here = Path(dirpath)
            target = tmp / here.relative_to(source)
            for name in sorted(dirnames):
                if (here / name).is_symlink():
                    where = (here / name).relative_to(source)
                    raise UserError(f"checkpoint file {where} is a symlink; not copying it")
                (target / name).mkdir(mode=0o700)
            for name in sorted(filenames):
                if not stat.S_ISREG(os.lstat(here / name).st_mode):
                    where = (here / name).relative_to(source)
                    raise UserError(
                        f"checkpoint file {where} is not a regular file; not copying it"
                    )
                shutil.copyfile(here / name, target / name, follow_symlinks=False)
