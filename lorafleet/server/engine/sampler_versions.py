"""Publishing a trainer slot as an immutable sampler version, always through the canary
(`publish_verified` withdraws a version that fails it), and retiring versions.

Two kinds of version: a named sampler checkpoint (its tinker path, backed by the checkpoint's
files) and the ephemeral versions of `save_weights_and_get_sampling_client` (numbered per model
under `<model_id>#live`, kept as `EphemeralRetention` decides).

Every change here either happens whole or not at all, and never fails because samples are
running: the version is published (a sampler slot claimed, the canary passed) before any file
or row exists, so a slot shortage refuses the save with nothing created; a version that is
deleted, overwritten or past retention is retired (`VersionStore.retire`): new samples no longer
get it, running ones finish on it, and the store drops it after the last one. A checkpoint path
gets a new version number each time its weights change (numbers are never reused in a process),
so new samples of an overwritten checkpoint get the new weights while the old ones finish."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

from lorafleet.adapters.peft_io import export_peft
from lorafleet.canary import SyncVerificationError
from lorafleet.interfaces import Sampler, Trainer
from lorafleet.sample import NoFreeSlotError, UnknownVersionError
from lorafleet.sample.versions import detect_kind
from lorafleet.server.engine import faults
from lorafleet.server.engine.live_models import LiveModel
from lorafleet.server.errors import ApiError, ServerFault, UserError, strip_paths
from lorafleet.server.state.deletion import remove_tree
from lorafleet.server.state.retention import EphemeralRetention, VersionKey
from lorafleet.sync.pool import NoReplicaError
from lorafleet.train.items import TrainInputError
from lorafleet.verification import publish_verified

LIVE_SUFFIX = "#live"  # adapter id of a model's ephemeral sampler versions
# ... of its kind="inflight" ones, which its inflight sessions follow to the newest; retention
# keeps them under their own key (a file name once ':' becomes '.')
INFLIGHT_SUFFIX = "#inflight"
INFLIGHT_RETENTION = ":inflight"


class SamplerSlotsBusy(ApiError):
    """Every sampler slot holds a version that running samples use. Nothing was created; the
    same call succeeds once some of them finish."""

    status = 503
    category = "server"


class VersionPublisher:
    def __init__(
        self, trainer: Trainer, sampler: Sampler, retention: EphemeralRetention, base_path: Path
    ):
        self.trainer = trainer
        self.sampler = sampler
        self.retention = retention
        self.base_path = base_path  # what exported PEFT configs name as their base
        self._next_version: dict[str, int] = {}  # checkpoint path -> its next version number
        self.sync_times = SyncTimes()

    @property
    def ephemeral_limit(self) -> int:
        """How many ephemeral versions per model stay published."""
        return self.retention.limit

    # ------------------------------------------------------------------ named checkpoints
    def publish_checkpoint(self, slot: int, tinker_path: str) -> VersionKey:
        """Trainer slot `slot` as the new version of sampler checkpoint `tinker_path`, before its
        files exist (`saved` records them); raises SamplerSlotsBusy with nothing published."""
        return self._publish(slot, tinker_path, self._take_number(tinker_path))

    def saved(self, key: VersionKey, files: Path) -> None:
        """The published version's files are complete: it can come back after eviction."""
        self.sampler.versions.set_path(key, files)

    def checkpoint_version(self, tinker_path: str, files: Path) -> VersionKey:
        """The version new samples of a checkpoint get: its live one, else its files registered
        as a new one (after a restart, an overwrite, or when its version was let go).
        Raises VersionError when the files are not a checkpoint."""
        versions = self.sampler.versions
        with contextlib.suppress(UnknownVersionError):
            return versions.latest(tinker_path)
        detect_kind(files)
        return versions.register(tinker_path, self._take_number(tinker_path), files)

    def retire_checkpoint(self, tinker_path: str) -> None:
        """The checkpoint's weights were deleted or replaced: none of its versions is handed to a
        new sample again; those running finish, then the versions are dropped."""
        versions = self.sampler.versions
        while True:
            try:
                key = versions.latest(tinker_path)
            except UnknownVersionError:
                return
            versions.retire(key)

    # ------------------------------------------------------------------ ephemeral versions
    def publish_ephemeral(self, live: LiveModel, *, inflight: bool = False) -> VersionKey:
        """The model's next ephemeral version; retires (and deletes the files of) the ones past
        the limit. Raises SamplerSlotsBusy with nothing published or written.

        `inflight` versions are numbered and kept apart from snapshots: every inflight
        session of the model samples from the newest of them (`inflight_target`), so a later
        inflight save moves the sessions already handed out (the SDK's inflight contract),
        while a snapshot save does not."""
        retained = live.model_id + INFLIGHT_RETENTION if inflight else live.model_id
        version = self.retention.next_version(retained)
        suffix = INFLIGHT_SUFFIX if inflight else LIVE_SUFFIX
        key = self._publish(live.slot, live.model_id + suffix, version)
        dest = self.retention.directory(retained, version)
        if dest is not None:
            try:
                faults.point("export.begin")
                export_peft(
                    self.trainer.bank,
                    live.slot,
                    dest,
                    base_model_name_or_path=str(self.base_path),
                    overwrite=True,
                )
                faults.point("export.end")
                self.saved(key, dest)
            except BaseException:
                self.sampler.versions.drop(key)  # just published: nothing has pinned it
                remove_tree(dest)
                raise
        for old_key, old_dest in self.retention.retain(retained, key, dest):
            # A retired version still running stays resident in its slot until its sequences
            # end; nothing reads its files again.
            self.sampler.versions.retire(old_key)
            if old_dest is not None:
                remove_tree(old_dest)
        return key

    def inflight_target(self, adapter_id: str) -> VersionKey:
        """The newest inflight version of the model behind `adapter_id` (`<model>#inflight`):
        never older than the one a session was created on, since versions only grow."""
        try:
            return self.sampler.versions.latest(adapter_id)
        except UnknownVersionError:
            raise UserError(
                f"the inflight weights of model {adapter_id.removesuffix(INFLIGHT_SUFFIX)!r} are gone "
                "(its session finished or the server restarted); create a new sampling client"
            ) from None

    # ------------------------------------------------------------------ internals
    def _take_number(self, tinker_path: str) -> int:
        number = self._next_version.get(tinker_path, 0)
        self._next_version[tinker_path] = number + 1
        return number

    def _publish(self, slot: int, adapter_id: str, version: int) -> VersionKey:
        started = time.perf_counter()
        try:
            key, _ = publish_verified(self.sampler, self.trainer, slot, adapter_id, version=version)
        except NoFreeSlotError as exc:
            self.sync_times.add(time.perf_counter() - started, passed=False)
            raise SamplerSlotsBusy(
                f"cannot publish {adapter_id}: {exc}. Nothing was saved; retry once some of the "
                "running samples have finished"
            ) from None
        except TrainInputError:
            # The canary's own tokens are fixed, so a non-finite loss there means the run's
            # weights are not finite: the tenant's training diverged (a 4xx, not our fault).
            self.sync_times.add(time.perf_counter() - started, passed=False)
            raise UserError(
                f"cannot publish {adapter_id.removesuffix(LIVE_SUFFIX)}: the run's weights hold "
                "NaN or infinite values (the canary's log-probs are not finite), most likely "
                "after an optim_step with too large a learning_rate. Nothing was saved; resume "
                "from an earlier checkpoint"
            ) from None
        except (SyncVerificationError, NoReplicaError) as exc:
            # a rollout engine's replicas could not verify it (or none is up): said, not hidden
            self.sync_times.add(time.perf_counter() - started, passed=False)
            raise ServerFault(
                f"cannot publish {adapter_id}: {strip_paths(str(exc))}. Nothing was saved",
                status=503 if isinstance(exc, NoReplicaError) else 500,
            ) from None
        except BaseException:
            self.sync_times.add(time.perf_counter() - started, passed=False)
            raise
        self.sync_times.add(time.perf_counter() - started, passed=True)
        return key


class SyncTimes:
    """Seconds spent putting trainer slots into the sampler (the sync and its canary, on every
    replica), for the stats: an RL loop's `sync_share` is this over its step time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # written on the worker thread, read by the stats route
        self.versions = 0  # published and verified
        self.failed = 0
        self.seconds = 0.0  # both kinds
        self.last_s: float | None = None

    def add(self, seconds: float, *, passed: bool) -> None:
        with self._lock:
            if passed:
                self.versions += 1
            else:
                self.failed += 1
            self.seconds += seconds
            self.last_s = seconds

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "versions": self.versions,
                "failed": self.failed,
                "seconds": self.seconds,
                "last_s": self.last_s,
            }
