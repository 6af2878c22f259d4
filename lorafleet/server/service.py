"""The Tinker operations, HTTP side: authenticate, validate, deduplicate, enqueue, answer.

Nothing here touches torch; it runs on the HTTP event loop and hands engine work to the
scheduler as `Op`s whose payloads are already parsed. Two rules shape every submit:

- an id the caller does not own (model, session, checkpoint, sampler) is a 404, whether it
  exists or not, so tenants cannot probe each other;
- once a request names a model the caller owns and a seq_id, it takes that seq_id's place in
  the model's order even if its content is bad: it becomes a future that fails with a user
  error. Refusing it at the door would leave a gap that the model's later requests wait on.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lorafleet.fsio import ensure_private_dir
from lorafleet.sample import SamplingParams
from lorafleet.server import proto, recovery, schemas
from lorafleet.server.auth import KeyRing, Tenant
from lorafleet.server.errors import ApiError, Conflict, NotFound, UserError
from lorafleet.server.executor import (
    CreateArgs,
    EngineConfig,
    Executor,
    FromStateArgs,
    LoadArgs,
    SampleArgs,
    SaveArgs,
    SaveSamplerArgs,
)
from lorafleet.server.futures import JSON, FutureTable, Result
from lorafleet.server.paths import TinkerPath, checkpoint_name, parse_tinker_path
from lorafleet.server.scheduler import Op, Scheduler
from lorafleet.server.store import CheckpointRow, ModelRow, SamplingSessionRow, SessionRow, Store
from lorafleet.train.optim import AdamHParams

RESTART_MESSAGE = (
    "the server restarted before this request finished; submit it again "
    "(a model that was only in memory must be resumed from a checkpoint with create_training_client_from_state)"
)
_ADAM_FIELDS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


@dataclass
class ServerConfig:
    base_model: str
    data_dir: Path
    api_keys: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    engine: EngineConfig | None = None  # None: defaults for `base_model`
    long_poll_s: float = 25.0  # under the SDK's 45 s retrieve timeout
    batch_window_s: float = 0.005  # lets requests that arrive together share a batch
    gap_timeout_s: float = 600.0
    future_ttl_s: float = 24 * 3600.0
    session_timeout_s: float = (
        900.0  # no heartbeat for this long: the session's models are unloaded
    )
    maintenance_interval_s: float = 60.0
    max_body_bytes: int = 64 << 20  # protobuf forward_backward bodies; the SDK sends <= 5 MB chunks
    max_json_bytes: int = 8 << 20  # every JSON body (prompts, saves, polls)
    body_timeout_s: float = 120.0  # a body that trickles in slower than this is refused (408)
    max_num_samples: int = 1024  # per asample request
    torch_threads: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _fingerprint(data: bytes | Any) -> str:
    raw = (
        data if isinstance(data, bytes) else json.dumps(data, sort_keys=True, default=str).encode()
    )
    return hashlib.sha256(raw).hexdigest()


def _unzstd(raw: bytes, limit: int) -> bytes:
    """Decompresses at most `limit` bytes: a frame's declared size is not trusted (zstandard's
    one-shot `decompress` allocates whatever the header claims, a few KB can ask for GBs)."""
    import zstandard

    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(
            io.BytesIO(raw), read_across_frames=True
        ) as reader:
            while chunk := reader.read(min(1 << 20, limit + 1 - len(out))):
                out += chunk
                if len(out) > limit:
                    raise UserError(
                        f"the zstd request body decompresses to more than this server's limit of {limit} bytes",
                        status=413,
                    )
    except zstandard.ZstdError as exc:
        raise UserError(f"request body is not valid zstd: {exc}") from None
    if not out and raw:
        raise UserError("request body is not valid zstd: no complete frame")
    return bytes(out)


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat()


def _str_dict(value: dict[str, Any] | None) -> dict[str, str] | None:
    return None if value is None else {str(k): str(v) for k, v in value.items()}


def _expires(ttl_seconds: int | None) -> float | None:
    if ttl_seconds is None:
        return None
    if ttl_seconds < 1:
        raise UserError(f"ttl_seconds must be >= 1 (or null for no expiry), got {ttl_seconds}")
    return time.time() + ttl_seconds


def adam_hparams(params: dict[str, Any]) -> AdamHParams:
    params = dict(params)
    kind = params.pop("type", None)
    if kind not in (None, "adam", "adamw"):
        raise UserError(
            f"optimizer {kind!r} is not supported by this server; send adam_params (AdamW)"
        )
    unknown = sorted(set(params) - set(_ADAM_FIELDS))
    if unknown:
        raise UserError(
            f"adam_params has unknown field(s) {unknown}; known: {', '.join(_ADAM_FIELDS)}"
        )
    values: dict[str, float] = {}
    for key, value in params.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UserError(f"adam_params.{key} must be a number, got {value!r}")
        values[key] = float(value)
    values.setdefault("learning_rate", 1e-4)
    hp = AdamHParams(**values)
    try:
        hp.validate()
    except ValueError as exc:
        raise UserError(f"adam_params: {exc}") from None
    return hp


class Service:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.data_dir = ensure_private_dir(Path(config.data_dir).expanduser().resolve())
        db_path = self.data_dir / "lorafleet.db"
        os.close(
            os.open(db_path, os.O_CREAT | os.O_RDWR, 0o600)
        )  # SQLite's -wal/-shm inherit this mode
        self.store = Store(db_path)
        self.recovered = self._recover()
        self.keys = KeyRing(config.api_keys)
        self.futures = FutureTable(self.store)
        engine = config.engine or EngineConfig(base_model=config.base_model)
        self.scheduler = Scheduler(
            None,  # type: ignore[arg-type] - built on the worker thread, below
            self.futures,
            batch_window_s=config.batch_window_s,
            gap_timeout_s=config.gap_timeout_s,
        )
        self.scheduler.start(lambda: self._build_executor(engine)).result()
        self.executor: Executor = self.scheduler.executor
        self.model_names = list(
            dict.fromkeys([self.executor.base_id, str(self.executor.base_path)])
        )
        self.started_at = time.time()
        self._last_maintenance = time.monotonic()

    def _recover(self) -> dict[str, int]:
        """A previous process's pending futures can never finish, its in-memory models are gone,
        and a crash may have left half-written or half-deleted files (recovery.sweep)."""
        body = json.dumps({"error": RESTART_MESSAGE, "category": "server"}).encode()
        failed = self.store.fail_unfinished_futures(JSON, body)
        lost = self.store.mark_active_models("lost")
        pruned = self.store.prune_futures(time.time() - self.config.future_ttl_s)
        files = recovery.sweep(self.data_dir, self.store)
        return {"failed_futures": failed, "lost_models": lost, "pruned_futures": pruned, **files}

    def maintain(self) -> None:
        """Drops old future results and unloads the models of clients that stopped heartbeating
        (a crashed client never calls finish, and its adapter slots would stay taken)."""
        now = time.time()
        self.store.prune_futures(now - self.config.future_ttl_s)
        for session in self.store.stale_sessions(now - self.config.session_timeout_s):
            self.store.finish_session(session.session_id, "expired")
            self._unload_session_models(
                session.session_id, f"sent no heartbeat for {self.config.session_timeout_s:.0f} s"
            )

    def _unload_session_models(self, session_id: str, why: str) -> None:
        """Frees the adapter slots of a session's live models (on the worker, between rounds)."""
        models = [m.model_id for m in self.store.session_models(session_id) if m.status == "active"]
        if models:
            message = f"session {session_id} {why}; its models were unloaded (resume one from a checkpoint)"
            self.scheduler.call(lambda: self.executor.unload_models(models, message))

    def _maybe_maintain(self) -> None:
        if time.monotonic() - self._last_maintenance >= self.config.maintenance_interval_s:
            self._last_maintenance = time.monotonic()
            self.maintain()

    def _build_executor(self, engine: EngineConfig) -> None:
        """Runs on the engine worker thread: every torch op of the server, model loading
        included, happens on that one thread (see scheduler.py on why)."""
        import torch

        threads = self.config.torch_threads
        if threads:
            torch.set_num_threads(threads)  # per thread for OpenMP: must run on the worker
        executor = Executor(engine, self.store, self.data_dir)
        executor.torch_threads = torch.get_num_threads()
        executor.scheduler = self.scheduler
        self.scheduler.executor = executor

    def close(self) -> None:
        self.futures.close()
        self.scheduler.stop()
        self.executor.close()
        self.store.close()

    # ================================================================== basics
    def authenticate(self, key: str | None) -> Tenant:
        return self.keys.authenticate(key)

    def client_config(self) -> dict[str, Any]:
        return {
            "pjwt_auth_enabled": False,
            "parallel_fwdbwd_chunks": True,
            "proto_compress_fwdbwd": False,
            "sample_use_retrieve_futures": False,
            "sample_join_sampling_session": False,
            "custom_loss_server_side": False,
        }

    def dynamic_config(self) -> dict[str, Any]:
        return {
            "refresh_interval_sec": 300,
            "sample_cancel_enabled": False,
            "sample_cancel_max_batch_size": 64,
        }

    def capabilities(self) -> dict[str, Any]:
        return {
            "supported_models": [
                {
                    "model_name": name,
                    "max_context_length": self.executor.context_length,
                    "trainable": True,
                    "sampleable": True,
                }
                for name in self.model_names
            ]
        }

    def check_base_model(self, name: str | None, field: str = "base_model") -> str:
        """The base is addressable by preset name and by its directory (cookbook code loads the
        tokenizer from the name, so offline it has to be a path)."""
        if isinstance(name, str) and name in self.model_names:
            return name
        if isinstance(name, str) and name and ("/" in name or name.startswith("~")):
            try:
                if Path(name).expanduser().resolve() == self.executor.base_path.resolve():
                    return name
            except (OSError, RuntimeError, ValueError):  # ValueError: a NUL byte in the name
                pass
        raise UserError(
            f"{field} {name!r} is not served here; this server serves {' or '.join(map(repr, self.model_names))}"
        )

    # ================================================================== ownership lookups
    def _session(self, tenant: Tenant, session_id: str, *, active: bool = True) -> SessionRow:
        row = self.store.get_session(session_id)
        if row is None or row.tenant != tenant.id:
            raise NotFound(f"unknown session_id {session_id!r}")
        if active and row.finished_at is not None:
            raise UserError(f"session {session_id!r} has finished; create a new ServiceClient")
        return row

    def _model(self, tenant: Tenant, model_id: str) -> ModelRow:
        row = self.store.get_model(model_id)
        if row is None or row.tenant != tenant.id:
            raise NotFound(f"unknown model_id {model_id!r}")
        return row

    def _checkpoint(self, tenant: Tenant, path: TinkerPath) -> CheckpointRow:
        row = self.store.get_checkpoint(str(path))
        if row is None or row.tenant != tenant.id:
            raise NotFound(f"unknown checkpoint {path}")
        return row

    # ================================================================== sessions
    def create_session(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.CreateSession, body)
        session_id = str(uuid.uuid4())
        self.store.add_session(session_id, tenant.id, req.model_dump())
        return {"session_id": session_id, "type": "create_session"}

    def heartbeat(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.SessionRef, body)
        row = self._session(tenant, req.session_id, active=False)
        if row.finished_at is not None:
            raise ApiError(f"session {req.session_id!r} has finished", status=410)
        self.store.heartbeat(req.session_id)
        return {"type": "session_heartbeat"}

    def finish_session(self, tenant: Tenant, session_id: str, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.FinishSession, body)
        self._session(tenant, session_id, active=False)
        reason = (req.reason or {}).get("type")
        self.store.finish_session(session_id, str(reason) if reason is not None else None)
        self._unload_session_models(session_id, "finished")
        return {"status": "finished"}

    # ================================================================== submission plumbing
    @staticmethod
    def _promise(request_id: str, model_id: str | None = None) -> dict[str, Any]:
        """The SDK's UntypedAPIFuture."""
        return (
            {"request_id": request_id}
            if model_id is None
            else {"request_id": request_id, "model_id": model_id}
        )

    def _prior(self, tenant: Tenant, scope: str, seq_id: int, fingerprint: str) -> str | None:
        """Dedup on (scope, seq_id): a retry gets the original future, a different payload an error."""
        prior = self.store.find_future(scope, seq_id)
        if prior is None:
            return None
        if prior.tenant == tenant.id and prior.fingerprint == fingerprint:
            return prior.request_id
        raise Conflict(f"seq_id {seq_id} of {scope!r} was already used by a different request")

    def _submit(
        self,
        tenant: Tenant,
        kind: str,
        payload: Any,
        *,
        fingerprint: str,
        model_id: str | None = None,
        scope: str | None = None,
        seq_id: int | None = None,
        ordered: bool = True,
    ) -> dict[str, Any]:
        self._maybe_maintain()
        if scope is not None and seq_id is not None:
            prior = self._prior(tenant, scope, seq_id, fingerprint)
            if prior is not None:
                return self._promise(prior, model_id)
        request_id = str(uuid.uuid4())
        self.futures.create(
            request_id, tenant.id, kind=kind, scope=scope, seq_id=seq_id, fingerprint=fingerprint
        )
        if isinstance(payload, ApiError) and not ordered:
            self.futures.complete(request_id, Result.error(payload))
        else:
            op_kind = "fail" if isinstance(payload, ApiError) else kind
            self.scheduler.submit(
                Op(
                    request_id,
                    op_kind,
                    tenant.id,
                    payload,
                    model_id=model_id,
                    seq_id=seq_id if ordered else None,
                    scope=scope or model_id,
                )
            )
        return self._promise(request_id, model_id)

    def _submit_for_model(
        self,
        tenant: Tenant,
        model_id: str,
        seq_id: int,
        kind: str,
        build: Callable[[], Any],
        fingerprint: str,
    ) -> dict[str, Any]:
        """An ordered operation on a model; `build()` parses the payload (errors fail the future)."""
        row = self._model(tenant, model_id)
        try:
            payload = build()
        except ApiError as exc:
            payload = exc
        if row.status != "active":
            reason = {"lost": "the server restarted", "unloaded": "its session finished"}.get(
                row.status, row.status
            )
            payload = UserError(
                f"model {model_id!r} is not loaded any more ({reason}); resume it from a checkpoint with "
                "create_training_client_from_state"
            )
            return self._submit(
                tenant,
                kind,
                payload,
                fingerprint=fingerprint,
                model_id=model_id,
                scope=model_id,
                seq_id=seq_id,
                ordered=False,
            )
        self.store.touch_model(model_id)
        return self._submit(
            tenant,
            kind,
            payload,
            fingerprint=fingerprint,
            model_id=model_id,
            scope=model_id,
            seq_id=seq_id,
        )

    # ================================================================== models
    def submit_create_model(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.CreateModel, body)
        self._session(tenant, req.session_id)
        self.check_base_model(req.base_model)
        kind = (req.optimizer_config or {}).get("type", "adamw")
        if kind not in ("adam", "adamw"):
            raise UserError(
                f"optimizer_config.type {kind!r} is not supported by this server; use AdamW"
            )
        lora = req.lora_config
        r_max = self.executor.config.max_lora_rank
        if not 1 <= lora.rank <= r_max:
            raise UserError(
                f"lora_config.rank must be between 1 and {r_max} on this server, got {lora.rank}"
            )
        if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
            raise UserError(
                "lora_config: train_attn, train_mlp and train_unembed are all false; nothing would train"
            )
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        lora_dict = {**lora.model_dump(), "alpha": self.executor.config.lora_alpha}
        args = CreateArgs(req.session_id, req.base_model, lora_dict, req.user_metadata)
        fingerprint = _fingerprint(body)
        if (
            self.store.find_future(model_id, 0) is None
            and self.store.get_model(model_id) is not None
        ):
            raise Conflict(f"model {model_id!r} already exists")
        return self._submit(
            tenant,
            "create_model",
            args,
            fingerprint=fingerprint,
            model_id=model_id,
            scope=model_id,
            seq_id=0,
            ordered=False,
        )

    def get_info(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.ModelRef, body)
        row = self._model(tenant, req.model_id)
        return {
            "model_id": row.model_id,
            "model_data": {
                "arch": self.executor.arch,
                "model_name": row.base_model,
                "tokenizer_id": str(self.executor.base_path),
            },
            "is_lora": True,
            "lora_rank": row.lora_rank,
            "model_name": row.base_model,
            "optimizer_config": {"type": "adamw"},
            "type": "get_info",
        }

    # ================================================================== training
    def submit_forward_backward(
        self, tenant: Tenant, raw: bytes, content_encoding: str | None
    ) -> dict[str, Any]:
        if content_encoding and content_encoding.lower() not in ("identity",):
            if content_encoding.lower() != "zstd":
                raise UserError(
                    f"Content-Encoding {content_encoding!r} is not supported (only zstd)"
                )
            raw = _unzstd(raw, self.config.max_body_bytes)
        msg = proto.parse_forward_backward(raw)
        kind = "forward" if msg.forward_only else "forward_backward"
        return self._submit_for_model(
            tenant,
            msg.model_id,
            msg.seq_id,
            kind,
            lambda: proto.decode_call(msg),
            _fingerprint(raw),
        )

    def submit_optim_step(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.OptimStep, body)
        return self._submit_for_model(
            tenant,
            req.model_id,
            req.seq_id,
            "optim_step",
            lambda: adam_hparams(req.optim_params),
            _fingerprint(body),
        )

    def submit_save_weights(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.SaveWeights, body)

        def build() -> SaveArgs:
            return SaveArgs(
                checkpoint_name(req.path),
                req.overwrite,
                _expires(req.ttl_seconds),
                req.user_metadata,
            )

        return self._submit_for_model(
            tenant, req.model_id, req.seq_id, "save_weights", build, _fingerprint(body)
        )

    def submit_save_for_sampler(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.SaveWeightsForSampler, body)

        def build() -> SaveSamplerArgs:
            if req.path is None and req.sampling_session_seq_id is None:
                raise UserError(
                    "save_weights_for_sampler needs a path (name) or a sampling_session_seq_id"
                )
            name = None if req.path is None else checkpoint_name(req.path)
            return SaveSamplerArgs(
                name, req.sampling_session_seq_id, _expires(req.ttl_seconds), req.user_metadata
            )

        # The SDK draws a new sampling_session_seq_id on every attempt of the same request
        # (save_weights_and_get_sampling_client), so it is left out of the retry fingerprint: a
        # retry whose first attempt reached us gets that attempt's future (whose result names
        # the sampling session actually created), not a "different request" conflict.
        same_request = {k: v for k, v in body.items() if k != "sampling_session_seq_id"}
        return self._submit_for_model(
            tenant, req.model_id, req.seq_id, "save_sampler", build, _fingerprint(same_request)
        )

    def submit_load_weights(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.LoadWeights, body)
        fingerprint = _fingerprint(body)
        if req.session_id is not None and req.model_seq_id is not None:
            self._session(tenant, req.session_id)
            checkpoint = self._checkpoint(tenant, parse_tinker_path(req.path))
            if req.base_model is not None:
                self.check_base_model(req.base_model)
            kind = (req.optimizer_config or {}).get("type", "adamw")
            if kind not in ("adam", "adamw"):
                raise UserError(
                    f"optimizer_config.type {kind!r} is not supported by this server; use AdamW"
                )
            model_id = f"{req.session_id}:train:{req.model_seq_id}"
            if (
                self.store.find_future(model_id, 0) is None
                and self.store.get_model(model_id) is not None
            ):
                raise Conflict(f"model {model_id!r} already exists")
            args = FromStateArgs(
                req.session_id, req.base_model, checkpoint, req.optimizer, req.user_metadata
            )
            return self._submit(
                tenant,
                "create_from_state",
                args,
                fingerprint=fingerprint,
                model_id=model_id,
                scope=model_id,
                seq_id=0,
                ordered=False,
            )
        if req.model_id is not None and req.seq_id is not None:

            def build() -> LoadArgs:
                return LoadArgs(
                    self._checkpoint(tenant, parse_tinker_path(req.path)), req.optimizer
                )

            return self._submit_for_model(
                tenant, req.model_id, req.seq_id, "load_weights", build, fingerprint
            )
        raise UserError(
            "load_weights needs session_id + model_seq_id (create from state) or model_id + seq_id (load_state)"
        )

    # ================================================================== sampling
    def create_sampling_session(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.CreateSamplingSession, body)
        self._session(tenant, req.session_id)
        sampler_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        adapter_id: str | None = None
        if req.model_path is not None:
            checkpoint = self._checkpoint(tenant, parse_tinker_path(req.model_path, "model_path"))
            base_model = (
                self.check_base_model(req.base_model)
                if req.base_model
                else checkpoint.info["base_model"]
            )
            adapter_id = checkpoint.tinker_path
        elif req.base_model is not None:
            base_model = self.check_base_model(req.base_model)
        else:
            raise UserError("create_sampling_session needs base_model or model_path")
        existing = self.store.get_sampling_session(sampler_id)
        if existing is not None:
            if (
                existing.tenant == tenant.id
                and existing.model_path == req.model_path
                and existing.adapter_id == adapter_id
            ):
                return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}
            raise Conflict(
                f"sampling_session_seq_id {req.sampling_session_seq_id} is already used in session {req.session_id}"
            )
        self.store.add_sampling_session(
            SamplingSessionRow(
                sampler_id,
                tenant.id,
                req.session_id,
                base_model,
                req.model_path,
                adapter_id,
                0 if adapter_id is not None else None,
                time.time(),
            )
        )
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    def _sampler(self, tenant: Tenant, sampler_id: str) -> SamplingSessionRow:
        row = self.store.get_sampling_session(sampler_id)
        if row is None or row.tenant != tenant.id:
            raise NotFound(f"unknown sampling_session_id {sampler_id!r}")
        return row

    def get_sampler(self, tenant: Tenant, sampler_id: str) -> dict[str, Any]:
        row = self._sampler(tenant, sampler_id)
        return {
            "sampler_id": row.sampling_session_id,
            "base_model": row.base_model,
            "model_path": row.model_path,
        }

    def submit_sample(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.Sample, body)
        if not 1 <= req.num_samples <= self.config.max_num_samples:
            raise UserError(
                f"num_samples must be between 1 and {self.config.max_num_samples}, got {req.num_samples}"
            )
        scope: str | None = None
        adapter: tuple[str, int] | None = None
        checkpoint_path: str | None = None
        if req.sampling_session_id is not None:
            row = self._sampler(tenant, req.sampling_session_id)
            scope = row.sampling_session_id
            if row.adapter_id is not None:
                adapter = (row.adapter_id, row.adapter_version or 0)
                checkpoint_path = row.model_path
        elif req.model_path is not None:
            checkpoint = self._checkpoint(tenant, parse_tinker_path(req.model_path, "model_path"))
            adapter, checkpoint_path = (checkpoint.tinker_path, 0), checkpoint.tinker_path
        elif req.base_model is not None:
            self.check_base_model(req.base_model)
        else:
            raise UserError("asample needs sampling_session_id, model_path or base_model")
        try:
            payload: SampleArgs | ApiError = self._sample_args(req, adapter, checkpoint_path)
        except ApiError as exc:
            payload = exc
        seq_id = req.seq_id if scope is not None else None
        result = self._submit(
            tenant,
            "sample",
            payload,
            fingerprint=_fingerprint(body),
            scope=scope,
            seq_id=seq_id,
            ordered=False,
        )
        result["sample_sequence_ids"] = [
            f"{result['request_id']}:{i}" for i in range(req.num_samples)
        ]
        return result

    @staticmethod
    def _sample_args(
        req: schemas.Sample, adapter: tuple[str, int] | None, checkpoint_path: str | None
    ) -> SampleArgs:
        prompt: list[int] = []
        for i, chunk in enumerate(req.prompt.chunks):
            if chunk.type != "encoded_text" or chunk.tokens is None:
                raise UserError(
                    f"prompt.chunks[{i}] is a {chunk.type!r} chunk; this server takes encoded_text only"
                )
            prompt += chunk.tokens
        if req.target_prompt_logprobs is not None:
            raise UserError("target_prompt_logprobs is not supported by this server")
        if req.prompt_alt_tokens_k:
            raise UserError(
                f"prompt_alt_tokens_k={req.prompt_alt_tokens_k} is not supported by this server (use 0)"
            )
        wants_prompt = bool(req.prompt_logprobs)
        last_n = req.prompt_logprobs_last_n
        if last_n is not None:
            if not (wants_prompt or req.topk_prompt_logprobs):
                raise UserError("prompt_logprobs_last_n needs prompt_logprobs=true")
            if not 1 <= last_n <= len(prompt) - 1:
                raise UserError(
                    f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {len(prompt) - 1}, got {last_n}"
                )
        p = req.sampling_params
        for name, value in (("temperature", p.temperature), ("top_p", p.top_p)):
            if not math.isfinite(value):
                raise UserError(f"sampling_params.{name} must be finite, got {value!r}")
        params = SamplingParams(
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            stop=p.stop,
            seed=p.seed,
        )
        return SampleArgs(
            prompt=prompt,
            params=params,
            num_samples=req.num_samples,
            prompt_logprobs=wants_prompt,
            topk_prompt=req.topk_prompt_logprobs,
            topk_sample=req.topk_sample_logprobs,
            last_n=last_n,
            adapter=adapter,
            checkpoint_path=checkpoint_path,
        )

    # ================================================================== futures
    async def retrieve(self, tenant: Tenant, body: Any) -> Result | None:
        req = schemas.parse(schemas.RetrieveFuture, body)
        return await self.futures.wait(req.request_id, tenant.id, self.config.long_poll_s)

    # ================================================================== REST
    def _checkpoint_json(self, row: CheckpointRow) -> dict[str, Any]:
        path = parse_tinker_path(row.tinker_path)
        return {
            "checkpoint_id": path.checkpoint_id,
            "checkpoint_type": row.kind,
            "time": _iso(row.created_at),
            "tinker_path": row.tinker_path,
            "size_bytes": row.size_bytes,
            "public": False,
            "user_metadata": row.user_metadata,
            "expires_at": _iso(row.expires_at),
        }

    def _run_json(self, row: ModelRow) -> dict[str, Any]:
        last = self.store.last_checkpoint(row.model_id, "training")
        last_sampler = self.store.last_checkpoint(row.model_id, "sampler")
        return {
            "training_run_id": row.model_id,
            "base_model": row.base_model,
            "model_owner": row.tenant,
            "is_lora": True,
            "corrupted": False,
            "lora_rank": row.lora_rank,
            "last_request_time": _iso(row.last_request_time),
            "last_checkpoint": None if last is None else self._checkpoint_json(last),
            "last_sampler_checkpoint": None
            if last_sampler is None
            else self._checkpoint_json(last_sampler),
            "user_metadata": _str_dict(row.user_metadata),
        }

    @staticmethod
    def _page(limit: int, offset: int) -> tuple[int, int]:
        if not 1 <= limit <= 1000 or not 0 <= offset <= schemas.INT64_MAX:
            raise UserError(
                f"limit must be in [1, 1000] and offset >= 0, got limit={limit}, offset={offset}"
            )
        return limit, offset

    def list_training_runs(self, tenant: Tenant, limit: int, offset: int) -> dict[str, Any]:
        limit, offset = self._page(limit, offset)
        rows, total = self.store.list_models(tenant.id, limit, offset)
        return {
            "training_runs": [self._run_json(r) for r in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total},
        }

    def get_training_run(self, tenant: Tenant, run_id: str) -> dict[str, Any]:
        return self._run_json(self._model(tenant, run_id))

    def list_checkpoints(
        self, tenant: Tenant, run_id: str | None, limit: int = 1000, offset: int = 0
    ) -> dict[str, Any]:
        limit, offset = self._page(limit, offset)
        if run_id is not None:
            self._model(tenant, run_id)
        rows, total = self.store.list_checkpoints(tenant.id, run_id, limit, offset)
        return {
            "checkpoints": [self._checkpoint_json(r) for r in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total},
        }

    def delete_checkpoint(self, tenant: Tenant, run_id: str, checkpoint_id: str) -> Future[Any]:
        path = parse_tinker_path(f"tinker://{run_id}/{checkpoint_id}", "checkpoint_id")
        row = self._checkpoint(tenant, path)
        return self.scheduler.call(lambda: self.executor.delete_checkpoint(row))

    def set_checkpoint_ttl(
        self, tenant: Tenant, run_id: str, checkpoint_id: str, body: Any
    ) -> dict[str, Any]:
        req = schemas.parse(schemas.SetTtl, body)
        row = self._checkpoint(
            tenant, parse_tinker_path(f"tinker://{run_id}/{checkpoint_id}", "checkpoint_id")
        )
        row.expires_at = _expires(req.ttl_seconds)
        self.store.put_checkpoint(row)
        return {}

    def weights_info(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.WeightsInfo, body)
        row = self._checkpoint(tenant, parse_tinker_path(req.tinker_path, "tinker_path"))
        lora = row.info["lora"]
        return {
            "base_model": row.info["base_model"],
            "is_lora": True,
            "lora_rank": lora["rank"],
            "train_unembed": lora["train_unembed"],
            "train_mlp": lora["train_mlp"],
            "train_attn": lora["train_attn"],
            "optimizer_config": {"type": "adamw"},
        }

    def stats(self) -> dict[str, Any]:
        return {
            **self.scheduler.stats.as_dict(),
            **self.executor.stats(),
            "pending_ops": self.scheduler.pending(),
            "uptime_s": time.time() - self.started_at,
            "recovered": self.recovered,
        }
