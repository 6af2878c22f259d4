"""Publishing a trainer slot as an immutable sampler version, always through the canary
(`publish_verified` withdraws a version that fails it), and unpublishing.

Two kinds of version: a named sampler checkpoint (version 0 of its tinker path, backed by the
checkpoint's files) and the ephemeral versions of `save_weights_and_get_sampling_client`
(numbered per model under `<model_id>#live`, kept as `EphemeralRetention` decides)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from lorafleet.adapters.peft_io import export_peft
from lorafleet.interfaces import Sampler, Trainer
from lorafleet.sample import UnknownVersionError
from lorafleet.server import faults
from lorafleet.server.deletion import remove_tree
from lorafleet.server.live_models import LiveModel
from lorafleet.server.retention import EphemeralRetention, VersionKey
from lorafleet.verification import publish_verified

LIVE_SUFFIX = "#live"  # adapter id of a model's ephemeral sampler versions


class VersionPublisher:
    def __init__(
        self, trainer: Trainer, sampler: Sampler, retention: EphemeralRetention, base_path: Path
    ):
        self.trainer = trainer
        self.sampler = sampler
        self.retention = retention
        self.base_path = base_path  # what exported PEFT configs name as their base

    @property
    def ephemeral_limit(self) -> int:
        """How many ephemeral versions per model stay published."""
        return self.retention.limit

    def publish_checkpoint(self, slot: int, tinker_path: str, files: Path) -> None:
        """A named sampler checkpoint, already exported to `files`, as version 0 of its path."""
        publish_verified(self.sampler, self.trainer, slot, tinker_path, version=0, path=files)

    def publish_ephemeral(self, live: LiveModel) -> VersionKey:
        """The model's next ephemeral version; unpublishes (and deletes) the ones past the limit."""
        version = self.retention.next_version(live.model_id)
        dest = self.retention.directory(live.model_id, version)
        faults.point("export.begin")
        if dest is not None:
            export_peft(
                self.trainer.bank,
                live.slot,
                dest,
                base_model_name_or_path=str(self.base_path),
                overwrite=True,
            )
        faults.point("export.end")
        key, _ = publish_verified(
            self.sampler,
            self.trainer,
            live.slot,
            live.model_id + LIVE_SUFFIX,
            version=version,
            path=dest,
        )
        for old_key, old_dest in self.retention.retain(live.model_id, key, dest):
            self.forget(old_key)
            if old_dest is not None:
                remove_tree(old_dest)
        return key

    def forget(self, key: VersionKey) -> None:
        """Unpublishes `key` if it is published: an overwritten or deleted checkpoint must not
        serve stale weights."""
        with contextlib.suppress(UnknownVersionError):
            self.sampler.versions.drop(key)
