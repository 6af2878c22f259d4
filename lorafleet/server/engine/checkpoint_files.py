"""A model's checkpoints on disk and their rows: training state (`save_state`, with the
optimizer), named sampler weights (PEFT files, published at once), reading a training state
back, deletion. The row is written only after the files are complete, so a row always names
a whole checkpoint (recovery.sweep removes files whose row never came)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lorafleet.adapters.checkpoint import CheckpointError, TrainingState, read_training_state
from lorafleet.adapters.peft_io import export_peft
from lorafleet.interfaces import Trainer
from lorafleet.server.engine import faults
from lorafleet.server.engine.live_models import LiveModel
from lorafleet.server.engine.sampler_versions import VersionPublisher
from lorafleet.server.errors import DiskFull, UserError, exception_text
from lorafleet.server.ops.types import SaveExternal, SaveSampler, SaveWeights
from lorafleet.server.state.deletion import prune_empty_parents, remove_tree
from lorafleet.server.state.external_weights import write_export
from lorafleet.server.state.paths import TENANTS_DIR, TinkerPath, checkpoint_dir, dir_size
from lorafleet.server.state.store import CheckpointRow, Store


def _metadata(value: dict[str, Any] | None) -> dict[str, str] | None:
    return None if value is None else {str(k): str(v) for k, v in value.items()}


class CheckpointFiles:
    def __init__(
        self,
        store: Store,
        trainer: Trainer,
        publisher: VersionPublisher,
        data_dir: Path,
        base_id: str,
        base_path: Path,
    ):
        self.store = store
        self.trainer = trainer
        self.publisher = publisher
        self.data_dir = data_dir
        self.base_id = base_id  # what a checkpoint records as its base
        self.base_path = base_path  # what exported PEFT configs name as their base

    def read_state(self, checkpoint: CheckpointRow, what: str) -> TrainingState:
        """The training state `what` (the client call, for the error) loads from `checkpoint`."""
        if checkpoint.kind != "training":
            raise UserError(
                f"{what} needs a training checkpoint (tinker://<model_id>/weights/<name>, from save_state); "
                f"{checkpoint.tinker_path} holds {checkpoint.kind} weights"
            )
        try:
            return read_training_state(Path(checkpoint.dir))
        except (CheckpointError, OSError) as exc:
            raise UserError(
                f"checkpoint {checkpoint.tinker_path} cannot be read: {exception_text(exc)}"
            ) from None

    def save_state(self, tenant: str, live: LiveModel, args: SaveWeights) -> str:
        """Writes the model's training state; returns its tinker path."""
        path = TinkerPath(live.model_id, "weights", args.name)
        if self.store.checkpoints.get(str(path)) is not None and not args.overwrite:
            raise UserError(f"checkpoint {path} already exists; pass overwrite=True to replace it")
        dest = checkpoint_dir(self.data_dir, tenant, path)
        faults.point("save_state.begin")
        try:
            self.trainer.save_state(
                live.slot,
                dest,
                metadata={"tinker_path": str(path), "user_metadata": _metadata(args.user_metadata)},
                overwrite=args.overwrite,
            )
        except (CheckpointError, FileExistsError) as exc:
            raise UserError(f"save_state {path}: {exception_text(exc)}") from None
        faults.point("save_state.end")
        # Overwritten: samples from here on load the new files; running ones finish on the old.
        self.publisher.retire_checkpoint(str(path))
        self.store.checkpoints.put(self._row(tenant, path, dest, "training", args))
        return str(path)

    def save_sampler(self, tenant: str, live: LiveModel, name: str, args: SaveSampler) -> str:
        """Publishes the model's adapter as sampler checkpoint `name`, then exports its files and
        writes its row; returns its tinker path. Publishing first claims a sampler slot before
        anything exists, so a slot shortage (SamplerSlotsBusy) leaves nothing behind."""
        path = TinkerPath(live.model_id, "sampler_weights", name)
        if self.store.checkpoints.get(str(path)) is not None:
            raise UserError(f"sampler checkpoint {path} already exists; choose another name")
        dest = checkpoint_dir(self.data_dir, tenant, path)
        key = self.publisher.publish_checkpoint(live.slot, str(path))
        exported = False
        try:
            faults.point("save_sampler.begin")
            try:
                export_peft(
                    self.trainer.bank, live.slot, dest, base_model_name_or_path=str(self.base_path)
                )
            except (ValueError, FileExistsError) as exc:
                raise UserError(f"save_weights_for_sampler {path}: {exception_text(exc)}") from None
            exported = True
            faults.point("save_sampler.end")
            self.publisher.saved(key, dest)
            self.store.checkpoints.put(self._row(tenant, path, dest, "sampler", args))
        except BaseException:
            # No row names the path, so no sample can have pinned the version.
            self.publisher.sampler.versions.drop(key)
            if exported:
                remove_tree(dest)
            raise
        return str(path)

    def save_external(self, tenant: str, live: LiveModel, args: SaveExternal) -> str:
        """Exports the model's adapter for download (`save_weights_external`, see
        external_weights.py); returns its tinker path."""
        path = TinkerPath(live.model_id, "external_weights", args.name)
        if self.store.checkpoints.get(str(path)) is not None:
            raise UserError(
                f"external weights {path} already exist; choose another name or delete them first"
            )
        dest = checkpoint_dir(self.data_dir, tenant, path)
        try:
            write_export(
                self.trainer.bank,
                live.slot,
                dest,
                base_model_name_or_path=str(self.base_path),
                recipients=args.recipients,
            )
        except (ValueError, FileExistsError) as exc:
            raise UserError(f"save_weights_external {path}: {exception_text(exc)}") from None
        self.store.checkpoints.put(self._row(tenant, path, dest, "external", args))
        return str(path)

    def delete(self, checkpoint: CheckpointRow) -> None:
        """Never fails for a checkpoint being sampled: its running samples finish on their
        resident version (nothing reads the files again) while new ones get "deleted".

        On a completely full disk even the row's DELETE fails (SQLite's WAL must grow), and
        deleting checkpoints is the very remedy the 507 tells the tenant to use. The files are
        what the caller asked to lose, so they then go first to make room, and the row after;
        a crash in between leaves a row without its directory, which recovery reports and a
        repeated delete removes."""
        self.publisher.retire_checkpoint(checkpoint.tinker_path)
        try:
            self.store.checkpoints.delete(checkpoint.tinker_path)
        except DiskFull:
            remove_tree(Path(checkpoint.dir))
            self.store.checkpoints.delete(checkpoint.tinker_path)
        remove_tree(Path(checkpoint.dir))
        prune_empty_parents(Path(checkpoint.dir), self.data_dir / TENANTS_DIR)

    def _row(
        self,
        tenant: str,
        path: TinkerPath,
        dest: Path,
        kind: str,
        args: SaveWeights | SaveSampler | SaveExternal,
    ) -> CheckpointRow:
        model = self.store.models.get(path.model_id)
        assert model is not None
        return CheckpointRow(
            tinker_path=str(path),
            tenant=tenant,
            model_id=path.model_id,
            kind=kind,
            name=path.name,
            dir=str(dest),
            created_at=time.time(),
            size_bytes=dir_size(dest),
            user_metadata=_metadata(args.user_metadata),
            expires_at=args.expires_at,
            info={"base_model": model.base_model, "lora": model.lora, "base_id": self.base_id},
        )
