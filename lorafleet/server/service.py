"""The server's lifecycle: open the data directory and the database, repair what a previous
process left (recovery), start the engine worker, build the request handlers, run periodic
maintenance, close, each step's resources held by one ExitStack.

The parts live in the server's stages (docs/architecture.md): `http/` turns requests into
typed ops (ops/types.py), `ops/` admits, meters and schedules them, `engine/` runs them on the
worker thread, `state/` keeps what outlives a request. `Service` only builds and holds them.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

from lorafleet.engines import EngineConfig
from lorafleet.fsio import ensure_private_dir
from lorafleet.model.hub_cache import publish_tokenizer, tokenizer_name
from lorafleet.server.config import ServerConfig, request_limits
from lorafleet.server.console import Sources, build_console
from lorafleet.server.engine.executor import Executor
from lorafleet.server.http.aliases import Aliases
from lorafleet.server.http.off_loop import Lanes
from lorafleet.server.http.public_url import public_base_url
from lorafleet.server.http.resources import Rest
from lorafleet.server.http.sampling import Sampling
from lorafleet.server.http.served import RequestLimits, ServedBase
from lorafleet.server.http.sessions import Sessions
from lorafleet.server.http.signed_urls import UrlSigner, load_or_create_secret
from lorafleet.server.http.training import Training
from lorafleet.server.http.usage import Usage
from lorafleet.server.openai.models import Models
from lorafleet.server.openai.service import Completions
from lorafleet.server.openai.text import Text
from lorafleet.server.ops import health
from lorafleet.server.ops.abandoned import AbandonedSamples
from lorafleet.server.ops.admission import Admission
from lorafleet.server.ops.engine_calls import EngineCalls
from lorafleet.server.ops.futures import JSON, FutureTable, Result
from lorafleet.server.ops.intake import Intake
from lorafleet.server.ops.metering import Metering
from lorafleet.server.ops.quotas import Quotas
from lorafleet.server.ops.run_metrics import RunMetrics
from lorafleet.server.ops.scheduler import Scheduler
from lorafleet.server.ops.stability import StabilityPolicy
from lorafleet.server.ops.types import Job, Stage
from lorafleet.server.state import recovery
from lorafleet.server.state.disk import DiskGuard
from lorafleet.server.state.keys import Tenant
from lorafleet.server.state.ownership import Ownership
from lorafleet.server.state.store import CheckpointRow, Store
from lorafleet.server.state.tenants import Reloader, Tenancy, TenantsConfig, load_tenants_file

log = logging.getLogger(__name__)

EXPIRED_PER_ROUND = 256  # checkpoint deletions one maintenance round queues on the engine

RESTART_MESSAGE = (
    "the server restarted before this request finished; submit it again "
    "(a model that was only in memory must be resumed from a checkpoint with create_training_client_from_state)"
)


def build_executor(
    config: ServerConfig,
    store: Store,
    data_dir: Path,
    has_work: Callable[[str], bool] | None = None,
    share_weight: Callable[[str], float] = lambda tenant: 1.0,
    max_resident: Callable[[str], int | None] | None = None,
) -> Executor:
    """Runs on the engine worker thread: every torch op of the server, model loading
    included, happens on that one thread (see scheduler.py on why). `has_work`: the
    scheduler's, for the paging policy (live_models.py)."""
    import torch

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)  # per thread for OpenMP: must run on the worker
    engine = config.engine or EngineConfig(base_model=config.base_model)
    return Executor(
        engine,
        store,
        data_dir,
        torch_threads=torch.get_num_threads(),
        has_work=has_work,
        share_weight=share_weight,
        max_resident=max_resident,
    )


def public_prefix_tokens(text: Text, prefixes: list[str]) -> tuple[tuple[int, ...], ...]:
    """The operator's public prefixes as the token ids prompts start with (no special tokens
    added: a chat template's own markers are part of the declared text when they should be)."""
    if not prefixes:
        return ()
    tokenizer = text.tokenizer()
    return tuple(
        tuple(int(t) for t in tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prefixes
    )


def served_base(
    executor: Executor, limits: RequestLimits, tokenizer_cache: Path | None = None
) -> ServedBase:
    return ServedBase(
        base_id=executor.base_id,
        base_path=executor.base_path,
        arch=executor.arch,
        context_length=executor.context_length,
        max_lora_rank=executor.config.max_lora_rank,
        lora_alpha=executor.config.lora_alpha,
        limits=limits,
        tokenizer_id=served_tokenizer(executor.base_path, tokenizer_cache),
    )


def served_tokenizer(model_dir: Path, cache: Path | None) -> str:
    """The tokenizer's hub-style name, placed in this machine's hub cache so that clients here
    load it by that name offline (clients elsewhere run `lorafleet tokenizer <preset>`). A
    cache that cannot take it costs only that convenience, so the server still starts."""
    name = tokenizer_name(model_dir)
    try:
        publish_tokenizer(model_dir, cache)
    except OSError as exc:
        log.warning(
            "tokenizer %r not placed in the hub cache (%s); clients load it offline only after "
            "`lorafleet tokenizer` on their machine",
            name,
            exc,
        )
    return name


STEPS = ("tenancy", "store", "recovery", "futures", "engine", "handlers", "upkeep")
"""The start-up steps, in order; `Service(on_step=...)` is told each one's name when it is done
(tests inject a failure after each and check that nothing stays open)."""


class Service:
    """Builds the server's parts in dependency order and closes them in reverse: one
    `ExitStack` holds the closer of everything each step opened, so a failure at any step of
    start-up closes what the earlier steps opened (threads, the engine's processes, the
    database) before the error propagates, and `close` is that same stack unwound."""

    def __init__(self, config: ServerConfig, *, on_step: Callable[[str], None] | None = None):
        if not 0 < config.maintenance_interval_s < float("inf"):
            raise ValueError(
                f"maintenance_interval_s must be a positive number of seconds, got {config.maintenance_interval_s!r}"
            )
        self.config = config
        self._on_step = on_step or (lambda step: None)
        self._closing = ExitStack()
        try:
            self._open_state()
            self._start_engine()
            self._build_handlers()
            self._start_upkeep()
        except BaseException:
            self._closing.close()
            raise

    def _done(self, step: str) -> None:
        self._on_step(step)

    # ------------------------------------------------------------------ start-up steps
    def _open_state(self) -> None:
        """The tenants, the data dir and its database, repaired (recovery) before anything
        reads it. A bad tenants file is refused first, before the data dir is made."""
        config = self.config
        self.tenancy = _tenancy(config)
        self._done("tenancy")
        self.data_dir = ensure_private_dir(Path(config.data_dir).expanduser().resolve())
        db_path = self.data_dir / "lorafleet.db"
        # SQLite's -wal/-shm inherit this file's mode
        os.close(os.open(db_path, os.O_CREAT | os.O_RDWR, 0o600))
        self.disk = DiskGuard(self.data_dir, config.disk_reserve_bytes)
        self.store = Store(db_path, on_disk_full=self.disk.release)
        self._closing.callback(self.store.close)  # last: everything above writes to it
        self._done("store")
        self.recovered = self._recover()
        self._done("recovery")

    def _start_engine(self) -> None:
        """Metering and run metrics (closed after the worker, so its last batches count), the
        future table, and the engine worker with its executor (model loading happens there)."""
        config = self.config
        self.metering = Metering(self.store, flush_s=config.usage_flush_s)
        self._closing.callback(self.metering.close)
        self.run_metrics = RunMetrics(self.store)  # per-step loss and client metrics (console)
        self._closing.callback(self.run_metrics.close)
        self.futures = FutureTable(
            self.store,
            memory_bytes=config.results_memory_bytes,
            memory_entry_bytes=config.results_memory_entry_bytes,
            stored_bytes=config.results_stored_bytes,
            ttl_s=config.future_ttl_s,
            disk_full=lambda: self.disk.full,
        )
        self._done("futures")
        engine_config = config.engine or EngineConfig(base_model=config.base_model)
        self.scheduler = Scheduler(
            self.futures,
            batch_window_s=config.batch_window_s,
            gap_timeout_s=config.gap_timeout_s,
            disk_guard=self.disk,
            stall_s=config.engine_stall_s,
            round_token_budget=config.round_token_budget,
            solo_round_token_budget=config.solo_round_token_budget,
            stepping_s=config.stepping_s,
            max_round_models=engine_config.max_adapters,
            weight_of=self.tenancy.weight_of,
            on_work=self._on_work,
        )
        started = self.scheduler.start(
            lambda: build_executor(
                config,
                self.store,
                self.data_dir,
                self.scheduler.has_work,
                self.tenancy.weight_of,
                self.tenancy.max_resident,  # resident_runs: kept by paging (live_models.py)
            )
        )
        built: list[Executor] = []
        # unwound in reverse: the table's waiters are released, the worker stops, then the
        # engines' processes and actors (vLLM servers, Ray replicas) are stopped
        self._closing.callback(_close_all, built)
        self._closing.callback(self.scheduler.stop)
        self._closing.callback(self.futures.close)
        self.executor = started.result()
        built.append(self.executor)
        self._done("engine")

    def _build_handlers(self) -> None:
        """The parts the routes call; only the request lanes hold threads (started on the
        first request, ended at close)."""
        config = self.config
        # every route's blocking work, off the event loop (http/off_loop.py)
        self.lanes = Lanes(
            config.request_workers,
            large_bytes=config.large_body_bytes,
            large_workers=config.large_body_workers,
        )
        self._closing.callback(self.lanes.close)
        self.served = served_base(
            self.executor,
            request_limits(config, self.executor.context_length),
            config.tokenizer_cache,
        )
        self.started_at = time.time()
        engine = EngineCalls(self.scheduler, self.executor)
        ownership = Ownership(self.store)
        self.admission = Admission(self.futures, config.max_queued_ops, config.queue_retry_after_s)
        self.quotas = Quotas(
            self.tenancy, self.store, self.metering, self.admission, self.served.context_length
        )
        self.intake = Intake(
            self.store,
            self.futures,
            self.scheduler,
            self._maybe_maintain,
            admission=self.admission,
            quotas=self.quotas,
        )
        signer = UrlSigner(load_or_create_secret(self.data_dir))  # download links (signed_urls.py)
        # what links and redirects name: the configured address, never a request's Host
        public_url = public_base_url(config.public_url, config.host, config.port)
        self.sessions = Sessions(self.store, ownership, engine, signer, public_url)
        stability_policy = StabilityPolicy(config.stability_ttl_s, config.stability_quota_bytes)
        self.training = Training(
            ownership,
            self.intake,
            self.served,
            max_body_bytes=config.max_body_bytes,
            stability_policy=stability_policy,
        )
        self.abandoned = AbandonedSamples(self.futures, config.abandon_grace_s)
        self._closing.callback(self.abandoned.close)
        self.sampling = Sampling(
            self.store, ownership, self.intake, self.served, stability_policy, self.abandoned
        )
        # the OpenAI-compatible routes: the same intake and sampler, model names via aliases
        self.aliases = Aliases(self.store, ownership, self.served)
        text = Text(self.served.base_path)
        self.executor.sample_batches.public_prefixes = public_prefix_tokens(
            text, config.public_prefixes
        )
        self.completions = Completions(
            self.intake,
            self.futures,
            Models(self.store, ownership, self.served, self.aliases),
            self.served,
            text,
            config.long_poll_s,
            self.executor.sampler.features,
            self.lanes,
        )
        self.rest = Rest(
            self.store,
            ownership,
            engine,
            self.served,
            signer,
            self.data_dir,
            self.quotas,
            public_url=public_url,
        )
        self.usage = Usage(
            self.store,
            self.metering,
            self.tenancy,
            self.admission,
            self.quotas,
            lambda: {
                **self.scheduler.stats.as_dict(),
                "prefix_cache": self.executor.prefix_cache_stats(),
            },
        )
        self.console = build_console(
            Sources(
                store=self.store,
                rest=self.rest,
                usage=self.usage,
                run_metrics=self.run_metrics,
                tenancy=self.tenancy,
                run_ops=self.scheduler.model_ops,
                run_tiers=self.executor.live.run_tiers,
                stats=self.stats,
            ),
            self.tenancy,
            session_ttl_s=config.console_session_ttl_s,
            max_sessions=config.console_max_sessions,
            sessions_per_tenant=config.console_sessions_per_tenant,
            streams=config.console_streams,
            streams_per_session=config.console_streams_per_session,
            streams_per_tenant=config.console_streams_per_tenant,
            operator_streams=config.console_operator_streams,
            newcomer_streams=config.console_newcomer_streams,
            cpu_share=config.console_cpu_share,
            refresh_s=config.console_refresh_s,
        )
        self._engine = engine
        self._done("handlers")

    def _start_upkeep(self) -> None:
        """The threads that keep the service tidy: metering's flushes, the tenants file's
        reloader (SIGHUP), maintenance (stale sessions, old results, expired checkpoints)."""
        # resident adapter-seconds: each run's time in a trainer slot (not while paged out)
        self.metering.resident = self.executor.live.resident_seconds
        self.metering.start()
        self.reloader = Reloader(self.tenancy) if self.tenancy.path is not None else None
        if self.reloader is not None:
            self._closing.callback(self.reloader.close)
        self._last_maintenance = time.monotonic()
        self._maintenance_lock = threading.Lock()
        self._expiring: set[str] = set()  # tinker paths whose deletion is queued on the engine
        self._expiring_lock = threading.Lock()
        self.maintenance_failures = 0
        self._stop_maintenance = threading.Event()
        self._maintenance = threading.Thread(
            target=self._maintenance_loop, name="lorafleet-maintenance", daemon=True
        )
        self._maintenance.start()
        self._closing.callback(self._stop_maintenance_thread)
        self._done("upkeep")

    def _stop_maintenance_thread(self) -> None:
        self._stop_maintenance.set()
        self._maintenance.join()

    def _recover(self) -> dict[str, int]:
        """A previous process's pending futures can never finish, its in-memory models are gone,
        and a crash may have left half-written or half-deleted files (recovery.sweep)."""
        body = json.dumps({"error": RESTART_MESSAGE, "category": "server"}).encode()
        failed = self.store.futures.fail_pending(JSON, body)
        lost = self.store.models.mark_active_as("lost")
        pruned = self.store.futures.prune(time.time() - self.config.future_ttl_s)
        files = recovery.sweep(
            self.data_dir, self.store, allow_deletes=self.config.allow_recovery_deletes
        )
        return {"failed_futures": failed, "lost_models": lost, "pruned_futures": pruned, **files}

    def maintain(self) -> None:
        """Drops old future results, unloads the models of clients that stopped heartbeating
        (a crashed client never calls finish, and its adapter slots would stay taken), deletes
        stability records unused for their TTL and checkpoints past theirs."""
        now = time.time()
        self.store.futures.prune(now - self.config.future_ttl_s)
        self.futures.prune_stored()
        self.disk.refresh()
        self.sessions.expire_stale(
            now - self.config.session_timeout_s, self.config.session_timeout_s
        )
        self.store.stability_records.delete_unused_since(now - self.config.stability_ttl_s)
        self._delete_expired(now)

    def _delete_expired(self, now: float) -> None:
        """Through the engine, as DELETE does, so that a published sampler version goes with its
        files. Not waited for (this may run on a request's thread); a failed deletion is logged
        and tried again at the next maintenance."""
        for row in self.store.checkpoints.expired(now, EXPIRED_PER_ROUND):
            with self._expiring_lock:
                if row.tinker_path in self._expiring:
                    continue
                self._expiring.add(row.tinker_path)
            deleted = self._engine.delete_checkpoint(row)
            deleted.add_done_callback(partial(self._expired_deleted, row))

    def _expired_deleted(self, row: CheckpointRow, deleted: Future[None]) -> None:
        with self._expiring_lock:
            self._expiring.discard(row.tinker_path)
        error = None if deleted.cancelled() else deleted.exception()
        if error is not None:
            log.error(
                "deleting expired checkpoint %s failed; maintenance will try again",
                row.tinker_path,
                exc_info=error,
            )
        else:
            log.info("deleted checkpoint %s, expired at %s", row.tinker_path, row.expires_at)

    def _maybe_maintain(self) -> None:
        """On each request: maintenance, if it is due and not already running."""
        if time.monotonic() - self._last_maintenance >= self.config.maintenance_interval_s:
            self._run_maintenance()

    def _run_maintenance(self) -> None:
        if not self._maintenance_lock.acquire(blocking=False):
            return  # running on another thread
        try:
            self._last_maintenance = time.monotonic()
            self.maintain()
        finally:
            self._maintenance_lock.release()

    def _maintenance_loop(self) -> None:
        """Maintenance on an idle server too (nothing else would delete an expired checkpoint
        while no requests come). A failed round is logged and counted in stats; the loop goes
        on, so one bad round does not end maintenance for good."""
        while not self._stop_maintenance.wait(self.config.maintenance_interval_s):
            try:
                self._run_maintenance()
            except Exception:
                self.maintenance_failures += 1
                log.exception(
                    "maintenance failed; trying again in %.0f s", self.config.maintenance_interval_s
                )

    def close(self) -> None:
        """Closes what start-up opened, in reverse (see `__init__`)."""
        self._closing.close()

    def _on_work(
        self,
        stage: Stage,
        work: list[tuple[Job, int]],
        seconds: float,
        finished: list[tuple[Job, Result]],
    ) -> None:
        """The scheduler's work hook: metering, then the console's loss points (both run even
        when the first fails; the scheduler logs what either raises)."""
        try:
            self.metering.on_work(stage, work, seconds, finished)
        finally:
            self.run_metrics.on_work(stage, work, seconds, finished)

    def authenticate(self, key: str | None) -> Tenant:
        return self.tenancy.current.keys.authenticate(key)

    def reload_tenants(self) -> TenantsConfig:
        """Reads the tenants file again (SIGHUP does this through `request_reload`); a file
        that does not parse or validate raises TenantsFileError and the old config stays."""
        return self.tenancy.reload()

    def request_reload(self) -> None:
        """Safe from a signal handler: the reload runs on its own thread (tenants.Reloader)."""
        if self.reloader is None:
            log.warning("SIGHUP: this server has no tenants file to reload (it uses API keys)")
            return
        self.reloader.request()

    def health(self) -> tuple[int, dict[str, str]]:
        """What /healthz answers (unauthenticated, so nothing but states): see health.py."""
        return health.report(
            self.scheduler.liveness(), self.disk.state(), self.executor.rollout_health()
        )

    def stats(self) -> dict[str, Any]:
        return {
            **self.scheduler.stats.as_dict(),
            **self.executor.stats(),
            **self.futures.memory(),
            "rollout": self.executor.rollout_stats(),  # which engine samples, per replica
            "disk": self.disk.state(),
            "disk_full_episodes": self.disk.times_full,
            "pending_ops": self.scheduler.pending(),
            "fair_share": self.scheduler.state(),
            "uptime_s": time.time() - self.started_at,
            "recovered": self.recovered,
            "maintenance_failures": self.maintenance_failures,
            "request_lanes": self.lanes.stats().as_dict(),
            "queued_ops": self.admission.queued(),
            "max_queued_ops": self.admission.max_queued_ops,
            "queue_refused": self.admission.refused,
            "quota_refused": self.quotas.refused,
            "usage_flush_failures": self.metering.flush_failures,
            # trainer slot -> sampler versions, canary included (an RL step's sync_share)
            "sampler_sync": self.executor.publisher.sync_times.as_dict(),
            "tenants": {
                "count": len(self.tenancy.current.tenants),
                "reloads": self.tenancy.reloads,
                "reload_failures": self.tenancy.reload_failures,
            },
        }


def _close_all(executors: list[Executor]) -> None:
    for executor in executors:
        executor.close()


def _tenancy(config: ServerConfig) -> Tenancy:
    """The tenants file, or one tenant per API key; not both (which key would mean what)."""
    if config.tenants_file is None:
        return Tenancy(TenantsConfig.from_keys(config.api_keys))
    if config.api_keys:
        raise ValueError(
            "api_keys and tenants_file were both given: with a tenants file, keys are listed there "
            "(as sha256 hashes); unset $LORAFLEET_API_KEYS and drop --api-key-file"
        )
    path = Path(config.tenants_file).expanduser().resolve()
    return Tenancy(load_tenants_file(path), path)
