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
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafleet.engines import EngineConfig
from lorafleet.fsio import ensure_private_dir
from lorafleet.server import recovery, schemas
from lorafleet.server.auth import KeyRing, Tenant
from lorafleet.server.engine_calls import EngineCalls
from lorafleet.server.executor import Executor
from lorafleet.server.futures import JSON, FutureTable, Result
from lorafleet.server.intake import Intake
from lorafleet.server.ownership import Ownership
from lorafleet.server.rest import Rest
from lorafleet.server.sampling import Sampling
from lorafleet.server.scheduler import Scheduler
from lorafleet.server.served import ServedBase
from lorafleet.server.sessions import Sessions
from lorafleet.server.store import Store
from lorafleet.server.training import Training

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
    long_poll_s: float = 25.0  # under the SDK's 45 s retrieve timeout
    batch_window_s: float = 0.005  # lets requests that arrive together share a batch
    gap_timeout_s: float = 600.0
    future_ttl_s: float = 24 * 3600.0
    # no heartbeat for this long: the session's models are unloaded
    session_timeout_s: float = 900.0
    maintenance_interval_s: float = 60.0
    max_body_bytes: int = 64 << 20  # protobuf forward_backward bodies; the SDK sends <= 5 MB chunks
    max_json_bytes: int = 8 << 20  # every JSON body (prompts, saves, polls)
    body_timeout_s: float = 120.0  # a body that trickles in slower than this is refused (408)
    max_num_samples: int = 1024  # per asample request
    torch_threads: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def build_executor(config: ServerConfig, store: Store, data_dir: Path) -> Executor:
    """Runs on the engine worker thread: every torch op of the server, model loading
    included, happens on that one thread (see scheduler.py on why)."""
    import torch

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)  # per thread for OpenMP: must run on the worker
    engine = config.engine or EngineConfig(base_model=config.base_model)
    return Executor(engine, store, data_dir, torch_threads=torch.get_num_threads())


def served_base(executor: Executor) -> ServedBase:
    return ServedBase(
        base_id=executor.base_id,
        base_path=executor.base_path,
        arch=executor.arch,
        context_length=executor.context_length,
        max_lora_rank=executor.config.max_lora_rank,
        lora_alpha=executor.config.lora_alpha,
    )


class Service:
    """Builds the server's parts in dependency order (store, recovery, futures, the engine
    worker and its executor, then the request handlers that the routes call) and closes them
    in reverse; between the two it only runs maintenance."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.data_dir = ensure_private_dir(Path(config.data_dir).expanduser().resolve())
        db_path = self.data_dir / "lorafleet.db"
        # SQLite's -wal/-shm inherit this file's mode
        os.close(os.open(db_path, os.O_CREAT | os.O_RDWR, 0o600))
        self.store = Store(db_path)
        self.recovered = self._recover()
        self.keys = KeyRing(config.api_keys)
        self.futures = FutureTable(self.store)
        self.scheduler = Scheduler(
            self.futures,
            batch_window_s=config.batch_window_s,
            gap_timeout_s=config.gap_timeout_s,
        )
        self.executor = self.scheduler.start(
            lambda: build_executor(config, self.store, self.data_dir)
        ).result()
        self.served = served_base(self.executor)
        self.started_at = time.time()
        self._last_maintenance = time.monotonic()

        engine = EngineCalls(self.scheduler, self.executor)
        ownership = Ownership(self.store)
        intake = Intake(self.store, self.futures, self.scheduler, ownership, self._maybe_maintain)
        self.sessions = Sessions(self.store, ownership, engine)
        self.training = Training(
            ownership, intake, self.served, max_body_bytes=config.max_body_bytes
        )
        self.sampling = Sampling(
            self.store, ownership, intake, self.served, max_num_samples=config.max_num_samples
        )
        self.rest = Rest(self.store, ownership, engine, self.served)

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
        self.sessions.expire_stale(
            now - self.config.session_timeout_s, self.config.session_timeout_s
        )

    def _maybe_maintain(self) -> None:
        if time.monotonic() - self._last_maintenance >= self.config.maintenance_interval_s:
            self._last_maintenance = time.monotonic()
            self.maintain()

    def close(self) -> None:
        self.futures.close()
        self.scheduler.stop()
        self.executor.close()
        self.store.close()

    def authenticate(self, key: str | None) -> Tenant:
        return self.keys.authenticate(key)

    async def retrieve(self, tenant: Tenant, body: Any) -> Result | None:
        req = schemas.parse(schemas.RetrieveFuture, body)
        return await self.futures.wait(req.request_id, tenant.id, self.config.long_poll_s)

    def stats(self) -> dict[str, Any]:
        return {
            **self.scheduler.stats.as_dict(),
            **self.executor.stats(),
            "pending_ops": self.scheduler.pending(),
            "uptime_s": time.time() - self.started_at,
            "recovered": self.recovered,
        }
