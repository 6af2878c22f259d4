"""The server's lifecycle: open the data directory and the database, repair what a previous
process left (recovery), start the engine worker, run periodic maintenance, close.

Everything here but the lifecycle is one module per idea, and `Service` only builds and holds
them: ownership.py (tenant-scoped lookups), requests.py (request parsing into payloads.py's
types), intake.py (seq_id dedup and enqueueing), sessions.py, training.py and sampling.py (the
Tinker operations), rest.py and views.py (the REST resources and their JSON). None of them
touches torch; engine work reaches the worker thread through the scheduler, as `Op`s whose
payloads are already parsed, or as `EngineCalls`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from lorafleet.engines import EngineConfig
from lorafleet.fsio import ensure_private_dir
from lorafleet.model.hub_cache import publish_tokenizer, tokenizer_name
from lorafleet.server import health, recovery, schemas, views
from lorafleet.server.admission import Admission
from lorafleet.server.aliases import Aliases
from lorafleet.server.auth import Tenant
from lorafleet.server.console import Sources, build_console
from lorafleet.server.disk import DiskGuard
from lorafleet.server.engine_calls import EngineCalls
from lorafleet.server.executor import Executor
from lorafleet.server.futures import JSON, FutureTable, Result
from lorafleet.server.intake import Intake
from lorafleet.server.metering import Metering
from lorafleet.server.openai.models import Models
from lorafleet.server.openai.service import Completions
from lorafleet.server.openai.text import Text
from lorafleet.server.ownership import Ownership
from lorafleet.server.quotas import Quotas
from lorafleet.server.rest import Rest
from lorafleet.server.run_metrics import RunMetrics
from lorafleet.server.sampling import Sampling
from lorafleet.server.scheduler import DEFAULT_ROUND_TOKENS, Op, Scheduler
from lorafleet.server.served import RequestLimits, ServedBase
from lorafleet.server.sessions import Sessions
from lorafleet.server.signed_urls import UrlSigner, load_or_create_secret
from lorafleet.server.store import CheckpointRow, Store
from lorafleet.server.tenants import Reloader, Tenancy, TenantsConfig, load_tenants_file
from lorafleet.server.train_batches import datum_costs, datum_tokens
from lorafleet.server.training import Training
from lorafleet.server.usage import Usage

log = logging.getLogger(__name__)

EXPIRED_PER_ROUND = 256  # checkpoint deletions one maintenance round queues on the engine

RESTART_MESSAGE = (
    "the server restarted before this request finished; submit it again "
    "(a model that was only in memory must be resumed from a checkpoint with create_training_client_from_state)"
)


@dataclass
class ServerConfig:
    base_model: str
    data_dir: Path
    api_keys: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    engine: EngineConfig | None = None  # None: defaults for `base_model`
    # retrieve_future holds this long before try_again: the SDK's read timeout for it is 45 s
    # (tinker/lib/api_future_impl.py), and each early try_again costs the client a log line
    long_poll_s: float = 40.0
    batch_window_s: float = 0.005  # lets requests that arrive together share a batch
    # a seq_id missing this long is skipped (scheduler._expire_gaps); the SDK numbers a call
    # before sending it, so a lost request would otherwise hold up its model for good
    gap_timeout_s: float = 30.0
    # where the base's tokenizer is placed for clients on this machine (None: the hub cache
    # transformers uses here, $HF_HUB_CACHE)
    tokenizer_cache: Path | None = None
    future_ttl_s: float = 24 * 3600.0
    # no heartbeat for this long: the session's models are unloaded
    session_timeout_s: float = 900.0
    # how often maintenance runs (a thread, and on requests): stale sessions, old futures, and
    # checkpoints past their TTL are deleted within about this long
    maintenance_interval_s: float = 60.0
    # start-up recovery may delete more than a crash explains (see recovery.py); off, it refuses
    allow_recovery_deletes: bool = False
    max_body_bytes: int = 64 << 20  # protobuf forward_backward bodies; the SDK sends <= 5 MB chunks
    max_json_bytes: int = 8 << 20  # every JSON body (prompts, saves, polls)
    body_timeout_s: float = 120.0  # a body that trickles in slower than this is refused (408)
    max_num_samples: int = 1024  # per asample request
    # a sample response's estimated wire size (requests.response_bytes); the server holds it
    # as Python objects until it is encoded, several times this (docs/reliability.md)
    max_response_bytes: int = 6 << 20
    max_topk_logprobs: int = 20  # topk_sample/topk_prompt_logprobs (see served.RequestLimits)
    torch_threads: int | None = None
    # finished results: in memory up to this many bytes in all (newest kept)...
    results_memory_bytes: int = 64 << 20
    # ... each at most this big (bigger ones are read back from SQLite when polled)
    results_memory_entry_bytes: int = 1 << 20
    # in SQLite up to this many bytes in all (oldest deleted first), besides `future_ttl_s`
    results_stored_bytes: int = 1 << 30
    # kept free on the data disk so that deletions still work when it fills (disk.py); at most
    # 1/16 of the filesystem
    disk_reserve_bytes: int = 8 << 20
    # a round running, or ready work waiting, this long makes /healthz report the engine stalled
    engine_stall_s: float = 600.0
    # fair share (fair_share.py): the tokens of forward(_backward) work one engine round runs;
    # tenants take turns by weighted deficit round-robin and a bigger call runs in chunks over
    # several rounds. Bounds how long another tenant's step waits behind a big call.
    round_token_budget: int = DEFAULT_ROUND_TOKENS
    # the tenants file (tenants.py): keys as hashes, weights, operators, quotas; reloaded on
    # SIGHUP. Without one, `api_keys` are the tenants (weight 1, no quotas, no operator).
    tenants_file: Path | None = None
    # requests queued (admitted, not finished) in all; past it a request gets 429 + Retry-After
    # (admission.py), which the SDK retries
    max_queued_ops: int = 4096
    queue_retry_after_s: float = 1.0
    usage_flush_s: float = 5.0  # metering counts reach SQLite this often (metering.py)
    # the web console (console/): sign-in sessions (lifetime, how many at once), its live
    # event streams (in all, per session) and how often a stream looks for changes
    console_session_ttl_s: float = 8 * 3600.0
    console_max_sessions: int = 1024
    console_sessions_per_tenant: int = 64  # past it the tenant's own oldest session goes
    console_streams: int = 64
    console_streams_per_session: int = 4
    console_streams_per_tenant: int = 16  # one tenant's sessions together
    console_refresh_s: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)


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


def request_limits(config: ServerConfig) -> RequestLimits:
    return RequestLimits(
        max_num_samples=config.max_num_samples,
        max_response_bytes=config.max_response_bytes,
        max_topk_logprobs=config.max_topk_logprobs,
        max_metadata_keys=schemas.MAX_METADATA_KEYS,
        max_metadata_bytes=schemas.MAX_METADATA_BYTES,
        max_page=views.MAX_PAGE,
        max_json_bytes=config.max_json_bytes,
        max_body_bytes=config.max_body_bytes,
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


class Service:
    """Builds the server's parts in dependency order (store, recovery, futures, the engine
    worker and its executor, then the request handlers that the routes call) and closes them
    in reverse; between the two it only runs maintenance."""

    def __init__(self, config: ServerConfig):
        if not 0 < config.maintenance_interval_s < float("inf"):
            raise ValueError(
                f"maintenance_interval_s must be a positive number of seconds, got {config.maintenance_interval_s!r}"
            )
        self.config = config
        # first: a bad tenants file is refused before the data dir is made or recovered
        self.tenancy = _tenancy(config)
        self.data_dir = ensure_private_dir(Path(config.data_dir).expanduser().resolve())
        db_path = self.data_dir / "lorafleet.db"
        # SQLite's -wal/-shm inherit this file's mode
        os.close(os.open(db_path, os.O_CREAT | os.O_RDWR, 0o600))
        self.disk = DiskGuard(self.data_dir, config.disk_reserve_bytes)
        self.store = Store(db_path, on_disk_full=self.disk.release)
        try:
            self.recovered = self._recover()
        except BaseException:
            self.store.close()
            raise
        self.metering = Metering(self.store, flush_s=config.usage_flush_s)
        self.run_metrics = RunMetrics(self.store)  # per-step loss and client metrics (console)
        self.futures = FutureTable(
            self.store,
            memory_bytes=config.results_memory_bytes,
            memory_entry_bytes=config.results_memory_entry_bytes,
            stored_bytes=config.results_stored_bytes,
            ttl_s=config.future_ttl_s,
            disk_full=lambda: self.disk.full,
        )
        self.scheduler = Scheduler(
            self.futures,
            batch_window_s=config.batch_window_s,
            gap_timeout_s=config.gap_timeout_s,
            disk_guard=self.disk,
            stall_s=config.engine_stall_s,
            round_token_budget=config.round_token_budget,
            op_sizes=datum_tokens,
            op_costs=datum_costs,
            max_round_models=(
                config.engine or EngineConfig(base_model=config.base_model)
            ).max_adapters,
            weight_of=self.tenancy.weight_of,
            on_work=self._on_work,
        )
        self.executor = self.scheduler.start(
            lambda: build_executor(
                config,
                self.store,
                self.data_dir,
                self.scheduler.has_work,
                self.tenancy.weight_of,
                self.tenancy.max_resident,  # resident_runs: kept by paging (live_models.py)
            )
        ).result()
        self.served = served_base(self.executor, request_limits(config), config.tokenizer_cache)
        self.started_at = time.time()
        self._last_maintenance = time.monotonic()
        self._maintenance_lock = threading.Lock()
        self._expiring: set[str] = set()  # tinker paths whose deletion is queued on the engine
        self._expiring_lock = threading.Lock()
        self.maintenance_failures = 0
        self._stop_maintenance = threading.Event()

        engine = EngineCalls(self.scheduler, self.executor)
        ownership = Ownership(self.store)
        self.admission = Admission(self.futures, config.max_queued_ops, config.queue_retry_after_s)
        self.quotas = Quotas(
            self.tenancy, self.store, self.metering, self.admission, self.served.context_length
        )
        # resident adapter-seconds: each run's time in a trainer slot (not while paged out)
        self.metering.resident = self.executor.live.resident_seconds
        self.metering.start()
        self.reloader = Reloader(self.tenancy) if self.tenancy.path is not None else None
        intake = Intake(
            self.store,
            self.futures,
            self.scheduler,
            ownership,
            self._maybe_maintain,
            admission=self.admission,
            quotas=self.quotas,
        )
        self.intake = intake  # the catch-all route records unknown calls' seq_ids through it
        signer = UrlSigner(load_or_create_secret(self.data_dir))  # download links (signed_urls.py)
        self.sessions = Sessions(self.store, ownership, engine, signer)
        self.training = Training(
            ownership, intake, self.served, max_body_bytes=config.max_body_bytes
        )
        self.sampling = Sampling(self.store, ownership, intake, self.served)
        # the OpenAI-compatible routes: the same intake and sampler, model names via aliases
        self.aliases = Aliases(self.store, ownership, self.served)
        self.completions = Completions(
            intake,
            self.futures,
            Models(self.store, ownership, self.served, self.aliases),
            self.served,
            Text(self.served.base_path),
            config.long_poll_s,
            self.executor.sampler.features,
        )
        self.rest = Rest(
            self.store, ownership, engine, self.served, signer, self.data_dir, self.quotas
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
            refresh_s=config.console_refresh_s,
        )
        self._engine = engine
        self._maintenance = threading.Thread(
            target=self._maintenance_loop, name="lorafleet-maintenance", daemon=True
        )
        self._maintenance.start()

    def _recover(self) -> dict[str, int]:
        """A previous process's pending futures can never finish, its in-memory models are gone,
        and a crash may have left half-written or half-deleted files (recovery.sweep)."""
        body = json.dumps({"error": RESTART_MESSAGE, "category": "server"}).encode()
        failed = self.store.fail_unfinished_futures(JSON, body)
        lost = self.store.mark_active_models("lost")
        pruned = self.store.prune_futures(time.time() - self.config.future_ttl_s)
        files = recovery.sweep(
            self.data_dir, self.store, allow_deletes=self.config.allow_recovery_deletes
        )
        return {"failed_futures": failed, "lost_models": lost, "pruned_futures": pruned, **files}

    def maintain(self) -> None:
        """Drops old future results, unloads the models of clients that stopped heartbeating
        (a crashed client never calls finish, and its adapter slots would stay taken) and
        deletes checkpoints past their TTL."""
        now = time.time()
        self.store.prune_futures(now - self.config.future_ttl_s)
        self.futures.prune_stored()
        self.disk.refresh()
        self.sessions.expire_stale(
            now - self.config.session_timeout_s, self.config.session_timeout_s
        )
        self._delete_expired(now)

    def _delete_expired(self, now: float) -> None:
        """Through the engine, as DELETE does, so that a published sampler version goes with its
        files. Not waited for (this may run on a request's thread); a failed deletion is logged
        and tried again at the next maintenance."""
        for row in self.store.expired_checkpoints(now, EXPIRED_PER_ROUND):
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
        self._stop_maintenance.set()
        self._maintenance.join()
        if self.reloader is not None:
            self.reloader.close()
        self.futures.close()
        self.scheduler.stop()
        self.executor.close()
        self.metering.close()  # after the worker: its last batches are counted
        self.run_metrics.close()
        self.store.close()

    def _on_work(
        self,
        kind: str,
        work: list[tuple[Op, int]],
        seconds: float,
        finished: list[tuple[Op, Result]],
    ) -> None:
        """The scheduler's work hook: metering, then the console's loss points (both run even
        when the first fails; the scheduler logs what either raises)."""
        try:
            self.metering.on_work(kind, work, seconds, finished)
        finally:
            self.run_metrics.on_work(kind, work, seconds, finished)

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

    async def retrieve(self, tenant: Tenant, body: Any) -> Result | None:
        req = schemas.parse(schemas.RetrieveFuture, body)
        return await self.futures.wait(req.request_id, tenant.id, self.config.long_poll_s)

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
