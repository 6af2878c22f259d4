"""Start-up repair of the data directory after a crash (kill -9, power loss, OOM kill).

Every checkpoint is written as a hidden temp directory that is renamed into place
(`fsio.atomic_directory`), and the SQLite row that makes it visible to clients is written only
after the rename, so a crash can leave exactly these traces, each repaired here before the
server answers anything:

- `.<name>.<random>.tmp`: a write that never published; removed;
- `.<name>.old-<hex>`: the previous copy set aside by an overwrite. If `<name>` exists the
  new copy was published and the old one is litter (removed); if not, the crash fell between
  the two renames and the old copy is renamed back, so a checkpoint never disappears;
- `.<name>.deleted-<hex>`: a deletion that was cut short; removed;
- a checkpoint directory with no database row: its save crashed after the rename and before
  the row (the client was never told it completed); removed, so files and rows agree.

Rows whose directory is missing are reported (and logged), not deleted: that is damage from
outside the server, and silently forgetting a user's checkpoint would hide it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from lorafleet.server.paths import SEGMENTS
from lorafleet.server.store import Store

log = logging.getLogger(__name__)

TENANTS_DIR = "tenants"
_TEMP = re.compile(r"^\..+\.tmp$")
_ASIDE = re.compile(r"^\.(?P<name>.+)\.old-[0-9a-f]+$")
_DELETED = re.compile(r"^\..+\.deleted-[0-9a-f]+$")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def sweep(data_dir: Path, store: Store) -> dict[str, int]:
    """Repairs `<data_dir>/tenants` (see the module docstring); returns what it did."""
    counts = {
        "temp_removed": 0,
        "asides_restored": 0,
        "asides_removed": 0,
        "orphans_removed": 0,
        "missing_dirs": 0,
    }
    root = data_dir / TENANTS_DIR
    if root.is_dir():
        for dirpath, dirnames, filenames in os.walk(root, topdown=True):
            here = Path(dirpath)
            for name in sorted(dirnames + filenames):
                entry = here / name
                if _TEMP.match(name) or _DELETED.match(name):
                    _remove(entry)
                    counts["temp_removed"] += 1
                elif (aside := _ASIDE.match(name)) is not None:
                    original = here / aside["name"]
                    if os.path.lexists(original):
                        _remove(entry)
                        counts["asides_removed"] += 1
                    else:
                        os.rename(entry, original)
                        counts["asides_restored"] += 1
                        log.warning(
                            "restored %s, set aside by an overwrite that a crash cut short",
                            original,
                        )
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and (here / d).is_dir()]
        known = {Path(d) for d in store.all_checkpoint_dirs()}
        # tenants/<tenant>/runs/<run>/<segment>/<name>
        for segment in SEGMENTS:
            for directory in root.glob(f"*/runs/*/{segment}/*"):
                if directory.name.startswith(".") or directory in known:
                    continue
                _remove(directory)
                counts["orphans_removed"] += 1
        for directory in known:
            if not directory.is_dir():
                counts["missing_dirs"] += 1
                log.error(
                    "checkpoint directory %s is missing (its database row is kept)", directory
                )
    if any(counts.values()):
        log.info("data dir recovery: %s", counts)
    return counts
