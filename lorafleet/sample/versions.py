"""Published adapter versions, as the sampler sees them.

Publishing copies a trainer slot's row into a slot of the sampler's bank set (an in-process
tensor sync). From then on `(adapter_id, version)` is immutable: training continues in the
trainer slot and never touches the copy, so a sample started on version v finishes on v.

Sampler slots are a bounded LRU (the policy and counters every paged bank shares,
`lorafleet.model.paging`): publishing or loading when all slots are taken evicts the least
recently used version that no in-flight sequence has pinned. A version published or
registered with a path (a training-state checkpoint dir or a PEFT dir) is reloaded from its
files on demand after eviction, so a saved version is never "not found". A version without
files is gone once evicted, and asking for it says exactly that.

Retiring (a deleted or overwritten checkpoint, an ephemeral version past retention) never
pulls a version from under running sequences: `retire` refuses new pins at once and drops the
version when its last pin is released, so sequences already running finish on the weights they
started with while nothing new starts on them.

Thread-safe: a trainer thread may publish while a sampler thread acquires and releases.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from lorafleet.adapters.checkpoint import STATE_NAME, CheckpointError, restore_weights
from lorafleet.adapters.peft_io import CONFIG_NAME, PeftFormatError, import_peft
from lorafleet.fsio import PathLike
from lorafleet.model.banks import BankError, BankSet
from lorafleet.model.paging import PagingCounters, Recency
from lorafleet.sample.types import VersionKey

if TYPE_CHECKING:
    from lorafleet.canary import CanaryReport
    from lorafleet.interfaces import AdapterBank

SourceKind = Literal["training_state", "peft"]
RETIRED_REMEMBERED = 4096  # retired keys whose late requests get "was deleted", not "unknown"


class VersionError(LookupError):
    """Base class of version-store errors."""


class UnknownVersionError(VersionError):
    """No such (adapter_id, version) was ever published or registered."""


class VersionUnavailableError(VersionError):
    """The version existed but cannot be served (evicted without files, or its files are bad)."""


class VersionRetiredError(VersionUnavailableError):
    """The version is being retired: running sequences finish on it, new ones cannot start."""


class NoFreeSlotError(VersionError):
    """Every sampler slot holds a version that in-flight sequences are using; retry later."""


@dataclass
class VersionInfo:
    adapter_id: str
    version: int
    path: Path | None
    kind: SourceKind | None
    slot: int | None  # sampler slot while resident
    pins: int = 0
    retiring: bool = False  # no new pins; dropped when the last one is released

    @property
    def key(self) -> VersionKey:
        return (self.adapter_id, self.version)


def detect_kind(path: Path) -> SourceKind:
    """Which saved format `path` holds; raises VersionError when it is neither."""
    if (path / STATE_NAME).is_file():
        return "training_state"
    if (path / CONFIG_NAME).is_file():
        return "peft"
    raise VersionError(
        f"{path} is neither a training-state checkpoint ({STATE_NAME}) nor a PEFT dir ({CONFIG_NAME})"
    )


def _check_key(adapter_id: object, version: object) -> VersionKey:
    if not isinstance(adapter_id, str) or not adapter_id:
        raise ValueError(f"adapter_id must be a non-empty string, got {adapter_id!r}")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be an integer >= 0, got {version!r}")
    return (adapter_id, version)


def new_version_key(
    published: Iterable[VersionKey], adapter_id: str, version: int | None
) -> VersionKey:
    """The key a new version gets: `version` as given (checked), or one past this adapter's
    latest in `published`; re-publishing a key raises, since versions are immutable. Shared by
    every version store (this one, the Ray pool's)."""
    keys = set(published)
    if version is None:
        existing = [v for (a, v) in keys if a == adapter_id]
        version = max(existing) + 1 if existing else 0
    key = _check_key(adapter_id, version)
    if key in keys:
        raise VersionError(f"version {key!r} is already published; versions are immutable")
    return key


class VersionStore:
    """(adapter_id, version) -> sampler slot, with pinning and LRU eviction."""

    def __init__(self, bank: BankSet, *, base_model_id: str, capacity: int | None = None):
        if bank.trainable:
            raise ValueError(
                f"bank {bank.name!r} is trainable; samplers use an inference-only bank"
            )
        max_capacity = bank.num_slots - 1
        capacity = max_capacity if capacity is None else capacity
        if not 1 <= capacity <= max_capacity:
            raise ValueError(
                f"capacity must be in [1, {max_capacity}] for bank {bank.name!r}, got {capacity}"
            )
        if bank.used_slots():
            raise ValueError(
                f"bank {bank.name!r} already holds adapters; a VersionStore needs it to itself"
            )
        self.bank = bank
        self.base_model_id = base_model_id
        self.capacity = capacity
        self._versions: dict[VersionKey, VersionInfo] = {}
        # The last retired keys, so that a request queued before the retirement and admitted
        # after the drop is told why, not "never published".
        self._retired: OrderedDict[VersionKey, None] = OrderedDict()
        self._recency: Recency[VersionKey] = Recency()
        self.counters = PagingCounters()
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ queries
    def info(self, key: VersionKey) -> VersionInfo:
        with self._lock:
            return self._get(key)

    def latest(self, adapter_id: str) -> VersionKey:
        with self._lock:
            versions = [
                v
                for (a, v), info in self._versions.items()
                if a == adapter_id and not info.retiring
            ]
            if not versions:
                raise UnknownVersionError(
                    f"adapter {adapter_id!r} has no published version that is not being retired"
                )
            return (adapter_id, max(versions))

    def resident(self) -> list[VersionKey]:
        with self._lock:
            return [k for k, info in self._versions.items() if info.slot is not None]

    def retiring(self) -> list[VersionKey]:
        """Versions retired while in use, waiting for their running sequences to finish."""
        with self._lock:
            return [k for k, info in self._versions.items() if info.retiring]

    def _get(self, key: VersionKey) -> VersionInfo:
        info = self._versions.get(key)
        if info is None:
            raise UnknownVersionError(
                f"adapter version {key!r} was never published or registered on this sampler"
            )
        return info

    def _row_bytes(self) -> int:
        return self.bank.row_size * self.bank.params.element_size()

    def paging(self) -> dict[str, object]:
        """The shared paging counters (`PagingCounters.as_dict`), as the stats report them."""
        with self._lock:
            return self.counters.as_dict()

    def verified(self, key: VersionKey) -> CanaryReport[VersionKey] | None:
        """None: this store copies slots and checks nothing itself; the publisher runs the
        canary (`verification.publish_verified`)."""
        return None

    # ------------------------------------------------------------------ adding
    def _new_key(self, adapter_id: str, version: int | None) -> VersionKey:
        return new_version_key(self._versions, adapter_id, version)

    def publish(
        self,
        adapter_id: str,
        source: AdapterBank,
        source_slot: int,
        *,
        version: int | None = None,
        path: PathLike | None = None,
    ) -> VersionKey:
        """Copies trainer slot `source_slot` into a sampler slot as a new immutable version.

        `version` None = one past this adapter's latest. `path` (the same weights saved on
        disk) lets the version come back after eviction.
        """
        with self._lock:
            key = self._new_key(adapter_id, version)
            saved = Path(path) if path is not None else None
            kind = detect_kind(saved) if saved is not None else None
            source.check_slot(source_slot)
            slot = self._claim_slot()
            try:
                self.bank.copy_slot_from(source, source_slot, slot)
            except BaseException:
                if self.bank.slots[slot] is not None:
                    self.bank.free(slot)
                raise
            self._versions[key] = VersionInfo(*key, path=saved, kind=kind, slot=slot)
            self._recency.touch(key)
            self.counters.added("hot", self._row_bytes())
            self._retired.pop(key, None)
            return key

    def register(self, adapter_id: str, version: int, path: PathLike) -> VersionKey:
        """Makes a saved version servable without loading it now (e.g. after a restart)."""
        with self._lock:
            key = self._new_key(adapter_id, version)
            saved = Path(path)
            kind = detect_kind(saved)
            self._versions[key] = VersionInfo(*key, path=saved, kind=kind, slot=None)
            self.counters.added("cold", self._row_bytes())
            self._retired.pop(key, None)
            return key

    def set_path(self, key: VersionKey, path: PathLike) -> None:
        """Records that a published version was saved afterwards (e.g. save_weights_for_sampler)."""
        with self._lock:
            info = self._get(key)
            saved = Path(path)
            info.kind = detect_kind(saved)
            if info.path is None and info.slot is None:
                self.counters.added("cold", self._row_bytes())
            info.path = saved

    # ------------------------------------------------------------------ pinning
    def acquire(self, key: VersionKey) -> int:
        """Pins `key` and returns its sampler slot, loading it from its files if evicted.

        Raises UnknownVersionError, VersionUnavailableError (VersionRetiredError once it is
        retired), or NoFreeSlotError (transient: every slot is pinned by running
        sequences).
        """
        with self._lock:
            if key in self._retired and key not in self._versions:
                raise VersionRetiredError(
                    f"version {key!r} was deleted (its checkpoint was deleted or overwritten, or "
                    "it passed retention) before this request could start; a new request gets "
                    "the current weights, if there still are any"
                )
            info = self._get(key)
            if info.retiring:
                raise VersionRetiredError(
                    f"version {key!r} is being deleted (its checkpoint was deleted or overwritten, "
                    "or it passed retention): samples already running finish on it, this one "
                    "cannot start; a new request gets the current weights, if there still are any"
                )
            if info.slot is None:
                self.counters.miss()
                self._load(info)
            else:
                self.counters.hit()
            assert info.slot is not None
            info.pins += 1
            self._recency.touch(key)
            return info.slot

    def release(self, key: VersionKey) -> None:
        with self._lock:
            info = self._get(key)
            if info.pins <= 0:
                raise VersionError(f"version {key!r} released more often than acquired")
            info.pins -= 1
            if info.retiring and info.pins == 0:
                self.drop(key)

    # ------------------------------------------------------------------ removal
    def evict(self, key: VersionKey) -> None:
        """Frees the version's slot; it stays known (and reloadable if it has files)."""
        with self._lock:
            info = self._get(key)
            if info.pins:
                raise VersionError(
                    f"version {key!r} is in use by {info.pins} sequence(s); cannot evict it"
                )
            if info.slot is not None:
                self._page_out(info)

    def drop(self, key: VersionKey) -> None:
        """Forgets the version entirely (e.g. its sync failed verification)."""
        with self._lock:
            info = self._get(key)
            if info.pins:
                raise VersionError(
                    f"version {key!r} is in use by {info.pins} sequence(s); cannot drop it"
                )
            if info.slot is not None:
                self.bank.free(info.slot)
                info.slot = None
                self.counters.removed("hot", self._row_bytes())
            elif info.path is not None:
                self.counters.removed("cold", self._row_bytes())
            del self._versions[key]
            self._recency.forget(key)

    def retire(self, key: VersionKey) -> bool:
        """Forgets the version once no sequence uses it: at once when unpinned (True), else it
        refuses new pins now and is dropped by its last release (False). Never raises for a
        version in use, so deleting or replacing what it serves cannot half-fail."""
        with self._lock:
            info = self._get(key)
            self._retired[key] = None
            while len(self._retired) > RETIRED_REMEMBERED:
                self._retired.popitem(last=False)
            if info.pins == 0:
                self.drop(key)
                return True
            info.retiring = True
            return False

    # ------------------------------------------------------------------ internals
    def _claim_slot(self) -> int:
        """A free sampler slot, evicting the least recently used unpinned version if needed."""
        in_use = sum(1 for info in self._versions.values() if info.slot is not None)
        free = self.bank.free_slots()
        if in_use < self.capacity and free:
            return free[0]
        candidates = [k for k, i in self._versions.items() if i.slot is not None and i.pins == 0]
        key = self._recency.oldest(candidates)
        if key is None:
            raise NoFreeSlotError(
                f"all {self.capacity} sampler slots hold versions that running sequences use"
            )
        victim = self._versions[key]
        assert victim.slot is not None
        slot = victim.slot
        self._page_out(victim)
        return slot

    def _page_out(self, info: VersionInfo) -> None:
        """Frees the version's slot: it goes cold (reloadable from its files) or, without
        files, is dropped from the bank for good (asking for it then says so)."""
        assert info.slot is not None
        self.bank.free(info.slot)
        info.slot = None
        if info.path is not None:
            self.counters.moved("hot", "cold", released=self._row_bytes(), held=self._row_bytes())
        else:
            self.counters.removed("hot", self._row_bytes())
            self.counters.dropped += 1

    def _load(self, info: VersionInfo) -> None:
        if info.path is None:
            raise VersionUnavailableError(
                f"version {info.key!r} was evicted from the sampler and was never saved to disk; "
                "publish it with a path (or save it) to make it reloadable"
            )
        if not info.path.is_dir():
            raise VersionUnavailableError(
                f"version {info.key!r}: its files at {info.path} are gone"
            )
        slot = self._claim_slot()
        try:
            if info.kind == "training_state":
                restore_weights(
                    info.path, bank=self.bank, base_model_id=self.base_model_id, slot=slot
                )
            else:
                import_peft(self.bank, info.path, slot=slot)
        except (CheckpointError, PeftFormatError, BankError, OSError) as exc:
            raise VersionUnavailableError(
                f"version {info.key!r}: cannot load {info.path}: {exc}"
            ) from exc
        info.slot = slot
        self.counters.moved("cold", "hot", released=self._row_bytes(), held=self._row_bytes())
