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

A crash leaves at most one unnamed checkpoint directory per save in flight, and never a row
without its directory. More than a few unnamed directories, or any while most rows' directories
are missing, mean the files and the database do not belong together (a data dir moved or
restored in part, a database from elsewhere): then the whole repair is refused, nothing is
deleted, and start-up fails until the operator allows it (`allow_deletes`,
`--allow-recovery-deletes`). A directory is kept when a row names it or when it sits where a
row's tinker path belongs.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from lorafleet.server.state.paths import SEGMENTS, TENANTS_DIR, checkpoint_dir, parse_tinker_path
from lorafleet.server.state.store import Store

__all__ = ["MAX_UNASKED_DELETES", "TENANTS_DIR", "RecoveryRefused", "sweep"]

log = logging.getLogger(__name__)

MAX_UNASKED_DELETES = 3
"""Unnamed checkpoint directories removed without the operator's say-so: a few saves in flight
at a crash."""

_TEMP = re.compile(r"^\..+\.tmp$")
_ASIDE = re.compile(r"^\.(?P<name>.+)\.old-[0-9a-f]+$")
_DELETED = re.compile(r"^\..+\.deleted-[0-9a-f]+$")


class RecoveryRefused(RuntimeError):
    """Start-up recovery would delete more than a crash can explain; nothing was deleted."""


@dataclass
class _Plan:
    litter: list[Path] = field(default_factory=list)  # temp and half-deleted entries
    restores: list[tuple[Path, Path]] = field(default_factory=list)  # (aside, original)
    stale_asides: list[Path] = field(default_factory=list)  # their new copy is in place
    orphans: list[Path] = field(default_factory=list)  # checkpoint dirs no row names
    missing: list[Path] = field(default_factory=list)  # rows' dirs that are not there
    rows: int = 0


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _is_checkpoint_place(root: Path, path: Path) -> bool:
    """`<root>/<tenant>/runs/<run>/<segment>/<name>`."""
    parts = path.relative_to(root).parts
    return len(parts) == 5 and parts[1] == "runs" and parts[3] in SEGMENTS


def _plan(data_dir: Path, store: Store) -> _Plan:
    """What the repair would do, without touching anything."""
    rows = store.checkpoints.all_rows()
    plan = _Plan(rows=len(rows))
    root = data_dir / TENANTS_DIR
    if not root.is_dir():
        plan.missing = [Path(row.dir) for row in rows]
        return plan
    for dirpath, dirnames, filenames in os.walk(root, topdown=True):
        here = Path(dirpath)
        for name in sorted(dirnames + filenames):
            entry = here / name
            if _TEMP.match(name) or _DELETED.match(name):
                plan.litter.append(entry)
            elif (aside := _ASIDE.match(name)) is not None:
                original = here / aside["name"]
                if os.path.lexists(original):
                    plan.stale_asides.append(entry)
                else:
                    plan.restores.append((entry, original))
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and (here / d).is_dir()]
    known = {Path(row.dir) for row in rows} | {
        checkpoint_dir(data_dir, row.tenant, parse_tinker_path(row.tinker_path)) for row in rows
    }
    restored = {original for _, original in plan.restores}
    candidates = {d for segment in SEGMENTS for d in root.glob(f"*/runs/*/{segment}/*")}
    candidates |= {d for d in restored if _is_checkpoint_place(root, d)}
    plan.orphans = sorted(d for d in candidates if not d.name.startswith(".") and d not in known)
    plan.missing = [
        Path(row.dir)
        for row in rows
        if Path(row.dir) not in restored and not Path(row.dir).is_dir()
    ]
    return plan


def _refusal(plan: _Plan, data_dir: Path) -> str | None:
    """Why the plan deletes more than a crash explains; None if it does not."""
    orphans, missing = len(plan.orphans), len(plan.missing)
    if orphans <= MAX_UNASKED_DELETES and not (orphans and 2 * missing > plan.rows):
        return None
    return (
        f"start-up recovery of {data_dir} refused: it would delete {orphans} checkpoint "
        f"directories that no database row names, while {missing} of {plan.rows} rows name "
        f"directories that are missing. A crash leaves at most {MAX_UNASKED_DELETES} such "
        "directories and no missing ones, so the files and the database may not belong together "
        "(a data dir moved or restored in part). Nothing was deleted. Check the data dir; to "
        "delete them, start again with `lorafleet serve --allow-recovery-deletes` "
        f"(ServerConfig.allow_recovery_deletes). The first: {', '.join(map(str, plan.orphans[:3]))}"
    )


def sweep(data_dir: Path, store: Store, *, allow_deletes: bool = False) -> dict[str, int]:
    """Repairs `<data_dir>/tenants` (see the module docstring); returns what it did. Raises
    `RecoveryRefused`, having changed nothing, when the repair would delete more than a crash
    explains and `allow_deletes` is not set."""
    plan = _plan(data_dir, store)
    refusal = _refusal(plan, data_dir)
    if refusal is not None:
        if not allow_deletes:
            raise RecoveryRefused(refusal)
        log.warning("%s -- going ahead: deletes were allowed", refusal)
    for entry in plan.litter:
        _remove(entry)
    for entry in plan.stale_asides:
        _remove(entry)
    for aside, original in plan.restores:
        os.rename(aside, original)
        log.warning("restored %s, set aside by an overwrite that a crash cut short", original)
    for directory in plan.orphans:
        _remove(directory)
    for directory in plan.missing:
        log.error("checkpoint directory %s is missing (its database row is kept)", directory)
    counts = {
        "temp_removed": len(plan.litter),
        "asides_restored": len(plan.restores),
        "asides_removed": len(plan.stale_asides),
        "orphans_removed": len(plan.orphans),
        "missing_dirs": len(plan.missing),
    }
    if any(counts.values()):
        log.info("data dir recovery: %s", counts)
    return counts
