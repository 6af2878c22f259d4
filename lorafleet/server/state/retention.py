"""Which ephemeral sampler versions a model keeps: the ones `save_weights_and_get_sampling_client`
publishes without a name.

Each is backed by files so that LRU eviction from the sampler bank (many tenants publishing)
never loses one a client is about to sample from. Only the newest few per model are kept, and
none survive a restart: the directory is wiped when the retention is built. This module decides
numbering, placement and eviction; publishing.py exports, publishes and drops what it is told.
"""

from __future__ import annotations

import shutil
from collections import deque
from pathlib import Path

from lorafleet.server.state.paths import run_dir_name

VersionKey = tuple[str, int]
"""(adapter id, version), as the sampler's version store names a published version."""


class EphemeralRetention:
    def __init__(self, root: Path, keep: int):
        """`keep`: versions kept on disk per model; 0 keeps them in sampler memory only (and
        then the newest one is still kept published)."""
        self.root = root
        self.keep = keep
        if root.exists():
            shutil.rmtree(root)
        self._kept: dict[str, deque[tuple[VersionKey, Path | None]]] = {}
        self._next: dict[str, int] = {}

    @property
    def limit(self) -> int:
        """How many versions per model stay published."""
        return max(1, self.keep)

    def next_version(self, model_id: str) -> int:
        version = self._next.get(model_id, 0)
        self._next[model_id] = version + 1
        return version

    def directory(self, model_id: str, version: int) -> Path | None:
        """Where the version's files go; None when versions are kept in memory only."""
        if self.keep <= 0:
            return None
        return self.root / run_dir_name(model_id) / str(version)

    def is_kept(self, model_id: str, key: VersionKey) -> bool:
        """Whether `key` is one of the model's versions still kept (not past the limit)."""
        return any(kept == key for kept, _ in self._kept.get(model_id, ()))

    def retain(
        self, model_id: str, key: VersionKey, directory: Path | None
    ) -> list[tuple[VersionKey, Path | None]]:
        """Records a published version; returns the older ones past the limit, oldest first,
        which the caller unpublishes and whose directories it removes."""
        kept = self._kept.setdefault(model_id, deque())
        kept.append((key, directory))
        evicted: list[tuple[VersionKey, Path | None]] = []
        while len(kept) > self.limit:
            evicted.append(kept.popleft())
        return evicted
