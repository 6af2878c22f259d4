"""The engine side of the server: every method here runs on the scheduler's worker thread.

One frozen base carries two bank sets (colocate): "train" slots hold the live adapters of
training clients, "sample" slots hold immutable published versions that samplers read. Requests
arrive already parsed (requests.py); here each request is validated against the engine
(`TrainEngine.prepare`, `AdamHParams.validate`, the sampler's per-request checks) before it is
batched, so a bad request fails alone, and a batch that still fails is re-run request by
request to find the culprit rather than failing its neighbours.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from lorafleet.adapters.checkpoint import CheckpointError, TrainingState, read_training_state
from lorafleet.adapters.peft_io import export_peft
from lorafleet.engines import EngineConfig, build_engines
from lorafleet.interfaces import EngineSet
from lorafleet.model.banks import AdapterSpec, BankError
from lorafleet.model.loader import load_base
from lorafleet.model.targets import TargetError, resolve_tinker_targets
from lorafleet.sample import (
    SampleRequest,
    SampleResult,
    UnknownVersionError,
    VersionError,
)
from lorafleet.sample.versions import detect_kind
from lorafleet.server import faults, ids, proto
from lorafleet.server.errors import ApiError, NotFound, UserError
from lorafleet.server.futures import Result
from lorafleet.server.paths import TinkerPath, checkpoint_dir, dir_size
from lorafleet.server.payloads import (
    CreateArgs,
    FromStateArgs,
    LoadArgs,
    SampleArgs,
    SaveArgs,
    SaveSamplerArgs,
)
from lorafleet.server.retention import EphemeralRetention
from lorafleet.server.scheduler import Op, PendingSample
from lorafleet.server.store import CheckpointRow, ModelRow, SamplingSessionRow, Store
from lorafleet.train.engine import PreparedItem, TrainItem
from lorafleet.train.losses import merge_metrics
from lorafleet.train.optim import AdamHParams
from lorafleet.verification import publish_verified

log = logging.getLogger(__name__)

LIVE_SUFFIX = "#live"  # adapter id of a model's ephemeral sampler versions
EPHEMERAL_DIR = "ephemeral"  # under the data dir; wiped at start-up


@dataclass
class LiveModel:
    model_id: str
    tenant: str
    session_id: str
    slot: int
    base_model: str


def _user(exc: Exception, prefix: str = "") -> Result:
    return Result.error(UserError(f"{prefix}{exc}"))


def _remove_tree(path: Path) -> None:
    """Hides the directory with one rename, then deletes it: a crash mid-way never leaves a
    half-deleted checkpoint in view (recovery.sweep removes the hidden remains)."""
    if not path.exists():
        return
    hidden = path.with_name(f".{path.name}.deleted-{secrets.token_hex(6)}")
    os.rename(path, hidden)
    shutil.rmtree(hidden)


def _metadata(value: dict[str, Any] | None) -> dict[str, str] | None:
    return None if value is None else {str(k): str(v) for k, v in value.items()}


class Executor:
    def __init__(self, config: EngineConfig, store: Store, data_dir: Path):
        self.config = config
        self.store = store
        self.data_dir = data_dir
        base = load_base(config.base_model, dtype=config.dtype)
        self.base_id = base.model_id  # preset name or absolute dir: what checkpoints record
        self.base_path = base.path
        self.model = base.model
        model_config = base.model.config
        self.arch = (getattr(model_config, "architectures", None) or [type(base.model).__name__])[0]
        self.context_length = int(getattr(model_config, "max_position_embeddings", 0) or 0) or None
        # Resolved before wrapping: afterwards the linears sit inside LoRA wrappers.
        self._targets: dict[tuple[bool, bool, bool], tuple[str, ...] | TargetError] = {}
        for attn, mlp, unembed in itertools.product((False, True), repeat=3):
            try:
                self._targets[(attn, mlp, unembed)] = resolve_tinker_targets(
                    base.model, train_attn=attn, train_mlp=mlp, train_unembed=unembed
                )
            except TargetError as exc:
                self._targets[(attn, mlp, unembed)] = exc
        everything = self._targets[(True, True, True)]
        if isinstance(everything, TargetError):
            raise everything
        # Same seams whether the engines run here, in trainer ranks or in sampler replicas.
        self.engines: EngineSet = build_engines(config, base, everything)
        self.trainer = self.engines.trainer
        self.sampler = self.engines.sampler
        self.versions = self.engines.versions
        self.live: dict[str, LiveModel] = {}  # written on the worker thread only
        self.torch_threads: int | None = None  # as seen by the worker thread
        self.ephemeral = EphemeralRetention(data_dir / EPHEMERAL_DIR, config.ephemeral_keep)

    # ================================================================== control ops
    def run_control(self, op: Op) -> Result:
        handler = {
            "fail": self._fail,
            "create_model": self._create_model,
            "create_from_state": self._create_from_state,
            "load_weights": self._load_weights,
            "save_weights": self._save_weights,
            "save_sampler": self._save_sampler,
        }.get(op.kind)
        if handler is None:
            raise RuntimeError(f"no handler for control op {op.kind!r}")
        try:
            return handler(op)
        except ApiError as exc:
            return Result.error(exc)

    def _fail(self, op: Op) -> Result:
        return Result.error(op.payload)

    def _live(self, op: Op) -> LiveModel:
        live = self.live.get(op.model_id or "")
        if live is None:
            raise UserError(
                f"model {op.model_id!r} is not loaded any more (its session finished or the server restarted)"
            )
        return live

    def _add_model(
        self,
        op: Op,
        session_id: str,
        base_model: str,
        slot: int,
        lora: dict[str, Any],
        user_metadata: dict | None,
    ) -> None:
        assert op.model_id is not None
        now = time.time()
        self.store.add_model(
            ModelRow(
                model_id=op.model_id,
                tenant=op.tenant,
                session_id=session_id,
                base_model=base_model,
                lora_rank=int(lora["rank"]),
                lora=lora,
                user_metadata=user_metadata,
                created_at=now,
                last_request_time=now,
                status="active",
            )
        )
        self.live[op.model_id] = LiveModel(op.model_id, op.tenant, session_id, slot, base_model)

    def _require_free_slot(self) -> None:
        if not self.trainer.bank.free_slots():
            raise UserError(
                f"all {self.config.max_adapters} training adapter slots of this server are in use; close another "
                "ServiceClient (its models are unloaded) or ask the operator to raise --max-adapters"
            )

    def _create_model(self, op: Op) -> Result:
        args: CreateArgs = op.payload
        lora = dict(args.lora)
        if lora.get("seed") is None:
            lora["seed"] = secrets.randbits(31)
        self._require_free_slot()
        try:
            targets = self._targets[
                (bool(lora["train_attn"]), bool(lora["train_mlp"]), bool(lora["train_unembed"]))
            ]
            if isinstance(targets, TargetError):
                raise targets
            spec = AdapterSpec(
                rank=lora["rank"],
                alpha=float(lora["alpha"]),
                seed=int(lora["seed"]),
                targets=targets,
            )
            slot = self.trainer.create_adapter(spec)
        except (BankError, TargetError) as exc:
            raise UserError(f"create_model: {exc}") from None
        self._add_model(op, args.session_id, args.base_model, slot, lora, args.user_metadata)
        return Result.json({"model_id": op.model_id, "type": "create_model"})

    def _checkpoint_state(self, checkpoint: CheckpointRow, what: str) -> TrainingState:
        if checkpoint.kind != "training":
            raise UserError(
                f"{what} needs a training checkpoint (tinker://<model_id>/weights/<name>, from save_state); "
                f"{checkpoint.tinker_path} holds sampler weights"
            )
        try:
            return read_training_state(Path(checkpoint.dir))
        except (CheckpointError, OSError) as exc:
            raise UserError(f"checkpoint {checkpoint.tinker_path} cannot be read: {exc}") from None

    def _create_from_state(self, op: Op) -> Result:
        args: FromStateArgs = op.payload
        state = self._checkpoint_state(args.checkpoint, "create_training_client_from_state")
        self._require_free_slot()
        try:
            slot = self.trainer.load_state(
                state, with_optimizer=args.optimizer, source=args.checkpoint.dir
            )
        except (CheckpointError, BankError) as exc:
            raise UserError(f"load {args.checkpoint.tinker_path}: {exc}") from None
        lora = dict(args.checkpoint.info["lora"])
        base_model = args.base_model or args.checkpoint.info["base_model"]
        self._add_model(op, args.session_id, base_model, slot, lora, args.user_metadata)
        return Result.json(
            {"model_id": op.model_id, "path": args.checkpoint.tinker_path, "type": "load_weights"}
        )

    def _load_weights(self, op: Op) -> Result:
        """The deprecated in-place load_state: replaces the model's adapter and optimizer state."""
        args: LoadArgs = op.payload
        live = self._live(op)
        state = self._checkpoint_state(args.checkpoint, "load_state")
        spec = self.trainer.bank.check_slot(live.slot).spec
        self.trainer.free_adapter(live.slot)
        try:
            self.trainer.load_state(
                state, slot=live.slot, with_optimizer=args.optimizer, source=args.checkpoint.dir
            )
        except (CheckpointError, BankError) as exc:
            self.trainer.create_adapter(
                spec, live.slot
            )  # keep the model usable (freshly initialised)
            raise UserError(
                f"load {args.checkpoint.tinker_path}: {exc}; the model was reset to a fresh adapter"
            ) from None
        return Result.json({"path": args.checkpoint.tinker_path, "type": "load_weights"})

    def _checkpoint_row(
        self, op: Op, path: TinkerPath, dest: Path, kind: str, args: SaveArgs | SaveSamplerArgs
    ) -> CheckpointRow:
        model = self.store.get_model(path.model_id)
        assert model is not None
        return CheckpointRow(
            tinker_path=str(path),
            tenant=op.tenant,
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

    def _save_weights(self, op: Op) -> Result:
        args: SaveArgs = op.payload
        live = self._live(op)
        path = TinkerPath(live.model_id, "weights", args.name)
        if self.store.get_checkpoint(str(path)) is not None and not args.overwrite:
            raise UserError(f"checkpoint {path} already exists; pass overwrite=True to replace it")
        dest = checkpoint_dir(self.data_dir, op.tenant, path)
        faults.point("save_state.begin")
        try:
            self.trainer.save_state(
                live.slot,
                dest,
                metadata={"tinker_path": str(path), "user_metadata": _metadata(args.user_metadata)},
                overwrite=args.overwrite,
            )
        except (CheckpointError, FileExistsError) as exc:
            raise UserError(f"save_state {path}: {exc}") from None
        faults.point("save_state.end")
        self._forget_version(
            (str(path), 0)
        )  # an overwritten checkpoint must not serve stale weights
        self.store.put_checkpoint(self._checkpoint_row(op, path, dest, "training", args))
        return Result.json({"path": str(path), "type": "save_weights"})

    def _save_sampler(self, op: Op) -> Result:
        args: SaveSamplerArgs = op.payload
        live = self._live(op)
        if args.name is None:
            assert args.sampling_session_seq_id is not None
            sampler_id = ids.sampling_session_id(live.session_id, args.sampling_session_seq_id)
            if self.store.get_sampling_session(sampler_id) is not None:
                raise UserError(
                    f"sampling_session_seq_id {args.sampling_session_seq_id} is already used in session {live.session_id}"
                )
            key = self._publish_ephemeral(live)
            self.store.add_sampling_session(
                SamplingSessionRow(
                    sampler_id,
                    op.tenant,
                    live.session_id,
                    live.base_model,
                    None,
                    key[0],
                    key[1],
                    time.time(),
                )
            )
            return Result.json(
                {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}
            )
        path = TinkerPath(live.model_id, "sampler_weights", args.name)
        if self.store.get_checkpoint(str(path)) is not None:
            raise UserError(f"sampler checkpoint {path} already exists; choose another name")
        dest = checkpoint_dir(self.data_dir, op.tenant, path)
        faults.point("save_sampler.begin")
        try:
            export_peft(
                self.trainer.bank, live.slot, dest, base_model_name_or_path=str(self.base_path)
            )
        except (ValueError, FileExistsError) as exc:
            raise UserError(f"save_weights_for_sampler {path}: {exc}") from None
        faults.point("save_sampler.end")
        self.store.put_checkpoint(self._checkpoint_row(op, path, dest, "sampler", args))
        self._forget_version((str(path), 0))
        publish_verified(self.sampler, self.trainer, live.slot, str(path), version=0, path=dest)
        return Result.json({"path": str(path), "type": "save_weights_for_sampler"})

    def _publish_ephemeral(self, live: LiveModel) -> tuple[str, int]:
        version = self.ephemeral.next_version(live.model_id)
        dest = self.ephemeral.directory(live.model_id, version)
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
        for old_key, old_dest in self.ephemeral.retain(live.model_id, key, dest):
            self._forget_version(old_key)
            if old_dest is not None:
                _remove_tree(old_dest)
        return key

    def _forget_version(self, key: tuple[str, int]) -> None:
        with contextlib.suppress(UnknownVersionError):
            self.versions.drop(key)

    # ================================================================== maintenance (via Scheduler.call)
    def unload_models(self, model_ids: list[str]) -> None:
        """Frees the models' adapter slots; the caller fails what they still have queued."""
        for model_id in model_ids:
            live = self.live.pop(model_id, None)
            if live is not None:
                self.trainer.free_adapter(live.slot)
            self.store.set_model_status(model_id, "unloaded")

    def delete_checkpoint(self, checkpoint: CheckpointRow) -> None:
        self._forget_version((checkpoint.tinker_path, 0))
        self.store.delete_checkpoint(checkpoint.tinker_path)
        _remove_tree(Path(checkpoint.dir))

    # ================================================================== forward / backward
    def run_train(self, ops: list[Op]) -> list[Result]:
        results: list[Result | None] = [None] * len(ops)
        groups: dict[bool, list[tuple[int, list[PreparedItem]]]] = {False: [], True: []}
        for i, op in enumerate(ops):
            call: proto.ForwardBackwardCall = op.payload
            try:
                live = self._live(op)
                items = [
                    TrainItem(live.slot, d.tokens, call.loss_fn, d.loss_inputs, call.loss_config)
                    for d in call.data
                ]
                groups[not call.forward_only].append((i, self.trainer.prepare(items)))
            except UserError as exc:
                results[i] = Result.error(exc)
            except ValueError as exc:
                results[i] = _user(
                    exc, f"{'forward' if call.forward_only else 'forward_backward'}: "
                )
        for backward in (False, True):
            if groups[backward]:
                self._run_items(groups[backward], backward, results)
        return [
            r if r is not None else Result.error(UserError("request was not run")) for r in results
        ]

    def _run_items(
        self,
        group: list[tuple[int, list[PreparedItem]]],
        backward: bool,
        results: list[Result | None],
    ) -> None:
        flat = [item for _, items in group for item in items]
        faults.point("forward_backward.begin")
        try:
            out = self.trainer.forward_backward(flat) if backward else self.trainer.forward(flat)
        except ValueError as exc:
            if len(group) == 1:
                results[group[0][0]] = _user(exc, "forward_backward: " if backward else "forward: ")
                return
            for single in group:  # find the request that fails; the others still run
                self._run_items([single], backward, results)
            return
        faults.point("forward_backward.end")
        start = 0
        for index, items in group:
            mine = out.items[start : start + len(items)]
            start += len(items)
            metrics = merge_metrics(o.metrics for o in mine)
            results[index] = Result.proto(
                proto.forward_backward_output([o.logprobs for o in mine], metrics)
            )

    # ================================================================== optimizer
    def run_optim(self, ops: list[Op]) -> list[Result]:
        results: list[Result | None] = [None] * len(ops)
        by_slot: dict[int, tuple[int, AdamHParams]] = {}
        for i, op in enumerate(ops):
            try:
                live = self._live(op)
            except UserError as exc:
                results[i] = Result.error(exc)
                continue
            by_slot[live.slot] = (i, op.payload)
        if by_slot:
            faults.point("optim_step.begin")
            metrics = self.trainer.optim_step({slot: hp for slot, (_, hp) in by_slot.items()})
            faults.point("optim_step.end")
            for slot, (i, _) in by_slot.items():
                m = metrics[slot]
                results[i] = Result.json(
                    {
                        "metrics": {
                            f"{key}:{'max' if key in ('step', 'skipped') else 'mean'}": float(value)
                            for key, value in m.items()
                        },
                        "type": "optim_step",
                    }
                )
        return [
            r if r is not None else Result.error(UserError("request was not run")) for r in results
        ]

    # ================================================================== sampling
    def _ensure_version(self, args: SampleArgs) -> tuple[str, int] | None:
        key = args.adapter
        if key is None:
            return None
        if args.checkpoint_path is None:
            try:
                self.versions.info(key)
            except UnknownVersionError:
                raise UserError(
                    "these sampler weights came from save_weights_and_get_sampling_client, whose weights are kept only "
                    f"for the newest {self.ephemeral.limit} saves of a model and never across a server "
                    "restart; use save_weights_for_sampler(name) for durable weights"
                ) from None
            return key
        checkpoint = self.store.get_checkpoint(args.checkpoint_path)
        if checkpoint is None:
            raise NotFound(f"checkpoint {args.checkpoint_path} was deleted")
        try:
            self.versions.info(key)
        except UnknownVersionError:
            try:
                detect_kind(Path(checkpoint.dir))
                self.versions.register(key[0], key[1], checkpoint.dir)
            except VersionError as exc:
                raise UserError(
                    f"checkpoint {args.checkpoint_path} cannot be sampled: {exc}"
                ) from None
        return key

    def run_sample(self, ops: list[Op]) -> list[Result]:
        """Runs the ops' samples to completion in one call (samplers without a running batch)."""
        results, batch = self._sample_requests(ops)
        if batch:
            outputs = self.sampler.generate([request for _, _, request in batch])
            for (i, args, _), output in zip(batch, outputs, strict=True):
                results[i] = self._sample_result(output, args)
        return [
            r if r is not None else Result.error(UserError("request was not run")) for r in results
        ]

    def start_sample(self, ops: list[Op]) -> list[Result | PendingSample]:
        """Queues the ops' samples into the sampler's running batch (continuous batching across
        requests that arrive at different times); the scheduler then calls `step_sampler`. A
        sampler whose batches run elsewhere (Ray replicas) completes them inside `submit`."""
        results, batch = self._sample_requests(ops)
        items: list[Result | PendingSample] = [
            r if r is not None else Result.error(UserError("request was not run")) for r in results
        ]
        if batch:
            futures = self.sampler.submit([request for _, _, request in batch])
            for (i, args, _), future in zip(batch, futures, strict=True):
                items[i] = PendingSample(future, partial(self._sample_result, args=args))
        return items

    def step_sampler(self) -> bool:
        """One step of the running sample batch; False when it had nothing to do."""
        return bool(self.sampler.step())

    def _sample_requests(
        self, ops: list[Op]
    ) -> tuple[list[Result | None], list[tuple[int, SampleArgs, SampleRequest]]]:
        results: list[Result | None] = [None] * len(ops)
        batch: list[tuple[int, SampleArgs, SampleRequest]] = []
        for i, op in enumerate(ops):
            args: SampleArgs = op.payload
            try:
                key = self._ensure_version(args)
            except ApiError as exc:
                results[i] = Result.error(exc)
                continue
            request = SampleRequest(
                prompt=args.prompt,
                params=args.params,
                adapter=key,
                num_samples=args.num_samples,
                prompt_logprobs=args.prompt_logprobs,
                topk_prompt_logprobs=args.topk_prompt,
                topk_sample_logprobs=args.topk_sample,
            )
            batch.append((i, args, request))
        return results, batch

    @staticmethod
    def _sample_result(output: SampleResult, args: SampleArgs) -> Result:
        if output.error is not None:
            return Result.error(UserError(f"sample: {output.error.message}"))
        return Result.proto(
            proto.sample_response(
                output,
                prompt_logprobs=args.prompt_logprobs,
                topk_prompt=args.topk_prompt,
                topk_sample=args.topk_sample,
                last_n=args.last_n,
            )
        )

    # ================================================================== introspection
    def close(self) -> None:
        """Stops what the engines started (trainer ranks, sampler replicas); no-op in one process."""
        self.engines.close()

    def stats(self) -> dict[str, Any]:
        return {
            "models_loaded": len(self.live),
            "adapter_slots": self.config.max_adapters,
            "sampler_slots": self.config.sampler_slots,
            "sampler_versions_resident": len(self.versions.resident()),
            "torch_threads": self.torch_threads,
        }
