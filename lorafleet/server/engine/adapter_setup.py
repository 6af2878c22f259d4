"""Putting a model's adapter into a training slot: fresh (`create_model`), from a training
checkpoint (`create_training_client_from_state`), or in place of the one it has (the deprecated
`load_state`). Each checks what it can before touching a slot, so a refused request leaves the
bank as it was."""

from __future__ import annotations

import secrets

from lorafleet.adapters.checkpoint import CheckpointError
from lorafleet.interfaces import Trainer
from lorafleet.model.banks import AdapterSpec, BankError
from lorafleet.model.targets import TargetError
from lorafleet.server.engine.checkpoint_files import CheckpointFiles
from lorafleet.server.engine.live_models import LiveModels
from lorafleet.server.engine.target_sets import TargetSets
from lorafleet.server.errors import UserError, exception_text
from lorafleet.server.ops.futures import Result
from lorafleet.server.ops.types import CreateFromState, CreateModel, Job, LoadWeights


class AdapterSetup:
    def __init__(
        self,
        trainer: Trainer,
        targets: TargetSets,
        live: LiveModels,
        checkpoints: CheckpointFiles,
    ):
        self.trainer = trainer
        self.targets = targets
        self.live = live
        self.checkpoints = checkpoints

    def create_model(self, job: Job, args: CreateModel) -> Result:
        assert job.model_id is not None
        lora = dict(args.lora)
        if lora.get("seed") is None:
            lora["seed"] = secrets.randbits(31)
        lora["optimizer"] = args.optimizer  # recorded for get_info / weights_info (views.py)
        self.live.require_free_slot(job.tenant)
        try:
            targets = self.targets.for_lora(lora)
            spec = AdapterSpec(
                rank=lora["rank"],
                alpha=float(lora["alpha"]),
                seed=int(lora["seed"]),
                targets=targets,
            )
            slot = self.trainer.create_adapter(spec, optimizer=args.optimizer)
        except (BankError, TargetError, ValueError) as exc:
            raise UserError(f"create_model: {exception_text(exc)}") from None
        self.live.add(
            job.model_id,
            job.tenant,
            args.session_id,
            args.base_model,
            slot,
            lora,
            args.user_metadata,
            optimizer=args.optimizer,
        )
        return Result.json({"model_id": job.model_id, "type": "create_model"})

    def create_from_state(self, job: Job, args: CreateFromState) -> Result:
        assert job.model_id is not None
        state = self.checkpoints.read_state(args.checkpoint, "create_training_client_from_state")
        self.live.require_free_slot(job.tenant)
        restores_state = args.optimizer and state.moments is not None
        family = args.optimizer_family
        if restores_state and family is not None and family != state.optimizer:
            raise UserError(
                f"load {args.checkpoint.tinker_path}: optimizer_config {family!r} cannot override "
                f"the checkpoint's restored {state.optimizer} optimizer state"
            )
        if family is None:
            family = state.optimizer if restores_state else "adamw"
        try:
            slot = self.trainer.load_state(
                state, with_optimizer=args.optimizer, source=args.checkpoint.dir, optimizer=family
            )
        except (CheckpointError, BankError, ValueError) as exc:
            raise UserError(f"load {args.checkpoint.tinker_path}: {exception_text(exc)}") from None
        lora = {**args.checkpoint.info["lora"], "optimizer": family}
        base_model = args.base_model or args.checkpoint.info["base_model"]
        self.live.add(
            job.model_id,
            job.tenant,
            args.session_id,
            base_model,
            slot,
            lora,
            args.user_metadata,
            optimizer=family,
        )
        return Result.json(
            {"model_id": job.model_id, "path": args.checkpoint.tinker_path, "type": "load_weights"}
        )

    def load_weights(self, job: Job, args: LoadWeights) -> Result:
        """The deprecated in-place load_state: replaces the model's adapter and optimizer state."""
        live = self.live.get(job.model_id)
        state = self.checkpoints.read_state(args.checkpoint, "load_state")
        if args.optimizer and state.moments is not None and state.optimizer != live.optimizer:
            raise UserError(
                f"load {args.checkpoint.tinker_path}: the checkpoint holds {state.optimizer} "
                f"optimizer state but this model uses {live.optimizer}, fixed at its creation; "
                "nothing was changed"
            )
        spec = self.trainer.bank.check_slot(live.slot).spec
        self.trainer.free_adapter(live.slot)
        try:
            self.trainer.load_state(
                state,
                slot=live.slot,
                with_optimizer=args.optimizer,
                source=args.checkpoint.dir,
                optimizer=live.optimizer,
            )
        except (CheckpointError, BankError) as exc:
            # keep the model usable (freshly initialised)
            self.trainer.create_adapter(spec, live.slot, optimizer=live.optimizer)
            raise UserError(
                f"load {args.checkpoint.tinker_path}: {exception_text(exc)}; the model was reset to a fresh adapter"
            ) from None
        return Result.json({"path": args.checkpoint.tinker_path, "type": "load_weights"})
