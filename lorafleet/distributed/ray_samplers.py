"""Sampler replicas as Ray actors, and the server's sampler and version store over them.

- `SamplerReplica`: one actor with its own full base, `SampleEngine` and in-memory versions.
- `RaySamplerPool`: the server's `Sampler` over M replicas. It runs each batch on one replica
  (round robin); a replica that dies is replaced, re-synced with every known version, and only
  then serves again; the batch it was running is re-run on another replica, so no request is
  lost. A liveness check asks every replica, every `health_interval_s`, for its report (on a
  concurrency group of its own, so a replica busy generating still answers): the versions it
  holds, its prefix cache and slot counters. The pool's `rollout_stats` and `health` (what the
  server's stats and /healthz read) are the replicas' states as the checks and the pool's own
  calls last found them, without waiting on any replica.
- `RayVersionStore` (`pool.versions`): the server's `VersionStore`. Publishing asks trainer rank
  0 for the adapter's per-layer tensors as an object-store object and hands that same object to
  every replica (no shared filesystem; the tensors never pass through the server), then checks
  each replica's canary log-probs against the trainer's. The canary is kept cheap without
  weakening it: every replica is asked at once while trainer rank 0 computes its side, that
  side is computed once per version (`ReferenceCache`) and each replica computes its base
  model's log-probs once, not on every check.

Replicas hold versions in memory only. The store keeps each version's source (its object in
the store while unsaved, the server's files once saved), so a version a replica's LRU evicted,
or a replica that restarted, gets the tensors again: no replica needs a disk, and nothing is
written on the sync path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from lorafleet.adapters.checkpoint import read_training_state
from lorafleet.adapters.peft_io import read_peft
from lorafleet.canary import (
    CanaryReport,
    Reference,
    ReferenceCache,
    ReplicaLogprobs,
    ReplicaProbe,
    SyncVerificationError,
    canary_tokens,
    check_replicas,
    layers_are_zero,
    tolerance_for,
)
from lorafleet.distributed.ray_cluster import placement_options, ray_module
from lorafleet.distributed.ray_trainer import RayRanks
from lorafleet.distributed.remote import DistTrainEngine
from lorafleet.distributed.wire import Payload, WirePayload, from_wire, to_wire
from lorafleet.fsio import PathLike
from lorafleet.interfaces import AdapterBank, Trainer
from lorafleet.model.banks import AdapterSpec
from lorafleet.sample.canary_probe import generated_prompt_logprobs, version_name
from lorafleet.sample.prefix_cache import PrefixCacheStats
from lorafleet.sample.reports import (
    CanaryRecord,
    ReplicaState,
    ReplicaStats,
    RolloutStats,
    SamplerFeatures,
    SamplerHealth,
)
from lorafleet.sample.types import SampleError, SampleRequest, SampleResult, VersionKey
from lorafleet.sample.validate import ModelLimits
from lorafleet.sample.versions import (
    UnknownVersionError,
    VersionError,
    VersionUnavailableError,
    detect_kind,
    new_version_key,
)

log = logging.getLogger(__name__)

HEALTH_GROUP = "health"  # the replicas' concurrency group for liveness checks (one thread)
LIVENESS_TIMEOUT_S = 10.0  # a replica that does not answer a check within this is unhealthy


@dataclass(frozen=True)
class SamplerSettings:
    base_model: str
    targets: tuple[str, ...]
    slots: int  # versions resident at once per replica
    r_max: int
    dtype: str = "float32"
    max_rows: int = 32
    device: str = "cpu"
    torch_threads: int | None = None
    prefix_cache_bytes: int | None = None  # per replica; None = the engine's default, 0 = off
    numerics: str = "fast"  # model/numerics.py: batch-invariant or fast (DEFAULT_NUMERICS)


@dataclass(frozen=True)
class ReplicaCheck:
    """A replica's answer to a liveness check: where it runs and what it holds now."""

    node_ip: str
    pid: int
    versions: tuple[VersionKey, ...]  # in its sampler slots
    prefix_cache: PrefixCacheStats
    paging: dict[str, object]  # its version store's slot counters (`PagingCounters.as_dict`)

    @property
    def where(self) -> str:
        return f"ray actor on {self.node_ip}, pid {self.pid}"


class SamplerReplica:
    """One sampler replica in a Ray actor: full base + sampler bank + version store.

    Versions live in memory only: when its LRU evicts one, or it restarts, the pool sends the
    tensors again (from the object store, or from the server's saved files), so a replica needs
    no disk of its own and nothing is written on the sync path.
    """

    def __init__(self, settings: SamplerSettings, index: int):
        from lorafleet.model.adapted import AdaptedModel
        from lorafleet.model.kernel_check import prove_fused_kernel
        from lorafleet.model.loader import load_base
        from lorafleet.sample.cuda_graphs import prove_decode_graphs
        from lorafleet.sample.engine import SampleEngine
        from lorafleet.sample.versions import VersionStore

        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        device = "cuda" if settings.device == "cuda" else "cpu"
        base = load_base(settings.base_model, dtype=settings.dtype, device=device)
        self.index = index
        self.base_model_id = base.model_id
        from lorafleet.model.numerics import apply_numerics, parse_numerics

        apply_numerics(base.model, parse_numerics(settings.numerics))
        adapted = AdaptedModel(base.model, settings.targets)
        sample = adapted.add_bank(
            "sample", num_slots=settings.slots + 1, r_max=settings.r_max, trainable=False
        )
        # A staging slot: VersionStore publishes from a bank slot, so received tensors land here first.
        self.inbox = adapted.add_bank("inbox", num_slots=2, r_max=settings.r_max, trainable=False)
        self.versions = VersionStore(sample, base_model_id=base.model_id)
        self.engine = SampleEngine(
            adapted,
            self.versions,
            tokenizer=base.tokenizer,
            max_rows=settings.max_rows,
            prefix_cache_bytes=settings.prefix_cache_bytes,
        )
        # on CUDA: the fused kernel and graph decode only once they passed their checks here
        adapted.kernel_verdict = prove_fused_kernel(adapted, settings.r_max)
        if settings.numerics == "fast":  # invariant attention syncs: no graph capture
            prove_decode_graphs(self.engine)
        # versions received and not dropped (resident or evicted)
        self._keys: set[VersionKey] = set()
        self._load_lock = threading.Lock()
        # the canary's base-model side, per prompt: the base never changes in this actor
        self._base_logprobs: dict[tuple[int, ...], torch.Tensor] = {}

    def ready(self) -> dict[str, Any]:
        from lorafleet.distributed.ray_cluster import current_node

        return {
            "limits": self.engine.limits,
            "dtype": self.engine.dtype,
            "base_model_id": self.base_model_id,
            "pid": os.getpid(),
            "check": self.check(),
            **current_node(),
        }

    def check(self) -> ReplicaCheck:
        """The liveness check's answer (called on `HEALTH_GROUP`'s thread, beside a running
        batch: everything it reads is behind its owner's lock)."""
        return ReplicaCheck(
            node_ip=ray_module().util.get_node_ip_address(),
            pid=os.getpid(),
            versions=tuple(self.versions.resident()),
            prefix_cache=self.engine.prefix_cache_stats(),
            paging=self.versions.paging(),
        )

    def load(self, key: VersionKey, payload: WirePayload) -> bool:
        """Installs a version from its tensors; False when it is already resident here."""
        with self._load_lock:
            try:
                if self.versions.info(key).slot is not None:
                    return False
                self.versions.drop(key)  # evicted: install it again
            except UnknownVersionError:
                pass
            spec, weights = from_wire(payload)
            self.inbox.allocate(spec, 1, initialize=False)
            try:
                self.inbox.load_slot_weights(1, weights)
                self.versions.publish(key[0], self.inbox, 1, version=key[1])
            finally:
                self.inbox.free(1)
            self._keys.add(key)
            return True

    def drop(self, key: VersionKey) -> None:
        with self._load_lock, contextlib.suppress(UnknownVersionError):
            self.versions.drop(key)
        self._keys.discard(key)

    def evict(self, key: VersionKey) -> None:
        with contextlib.suppress(UnknownVersionError):
            self.versions.evict(key)

    def known(self) -> list[VersionKey]:
        return sorted(self._keys)

    def generate(self, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        return self.engine.generate(requests)

    def canary_logprobs(
        self, key: VersionKey, tokens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This replica's prompt log-probs of the canary under `key` and under its base model,
        through the real sampling path (the canary's "differs from base" rule needs both). The
        base side is computed on this actor's first canary and kept: its base weights are
        frozen, and a restarted replica is a new actor that computes it again."""
        from lorafleet.sample.canary_probe import sampler_canary_logprobs

        served = sampler_canary_logprobs(self.engine, key, tokens)
        base = self._base_logprobs.get(tuple(tokens))
        if base is None:
            base = sampler_canary_logprobs(self.engine, None, tokens)
            self._base_logprobs[tuple(tokens)] = base
        return served, base

    def release_cache(self) -> None:
        self.engine.release_cache()


@dataclass
class _Entry:
    """A version the pool serves: where its tensors come from when a replica needs them."""

    key: VersionKey
    ref: Any  # object-store ref of its Payload, or None when `path` is the source
    path: Path | None

    @property
    def adapter_id(self) -> str:
        return self.key[0]

    @property
    def version(self) -> int:
        return self.key[1]


@dataclass
class _Replica:
    """One replica as the pool knows it (the pool's lock guards every field)."""

    index: int
    handle: Any
    state: str = "ready"  # "ready" | "restarting" | "dead"
    incarnation: int = 0
    restarts: int = 0
    error: str | None = None  # why it is not healthy now
    unanswered: bool = False  # its last liveness check got no answer in time
    check: ReplicaCheck | None = None  # its last answer (this incarnation's)
    # the versions it holds: its last answer's, kept up to date by the pool's own loads and
    # drops in between (`changes` counts those, so an answer older than one is not applied)
    versions: set[VersionKey] = field(default_factory=set)
    changes: int = 0
    last_canary: CanaryRecord | None = None
    node: dict[str, Any] | None = None  # where it runs: node_id, node_ip, pid (from `ready`)

    @property
    def name(self) -> str:
        return replica_name(self.index)

    @property
    def report_state(self) -> ReplicaState:
        if self.state == "restarting":
            return "restarting"
        if self.state == "dead" or self.unanswered:
            return "unhealthy"
        return "healthy"

    def answered(self, check: ReplicaCheck, changes: int) -> None:
        self.check = check
        self.unanswered = False
        if changes == self.changes:
            self.versions = set(check.versions)


def _why(exc: BaseException) -> str:
    """An error as one short line for the stats (Ray's actor errors run over many lines)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def replica_name(index: int) -> str:
    """How the pool, its canary messages and the stats name replica `index`."""
    return f"sampler replica {index}"


def read_payload(path: Path) -> Payload:
    """A saved version (training checkpoint or PEFT dir) as a Payload."""
    if detect_kind(path) == "training_state":
        state = read_training_state(path)
        return state.spec, state.weights
    config, weights = read_peft(path)
    spec = AdapterSpec(
        rank=config["r"],
        alpha=float(config["lora_alpha"]),
        use_rslora=bool(config.get("use_rslora", False)),
        targets=tuple(weights),
    )
    return spec, weights


class RayVersionStore:
    """The versions a `RaySamplerPool` serves, and where each one's tensors come from.

    Every change reaches every ready replica through the pool; a replica that comes back after
    a restart is re-synced from this catalogue. Shares the pool's lock: a re-sync reads the
    catalogue and puts the replica back in rotation in one step, so no publish is missed.
    """

    def __init__(self, pool: RaySamplerPool, *, trainer: Trainer | None, verify: bool):
        self._pool = pool
        self._lock = pool.lock
        self.trainer = trainer  # source of payloads and of canary log-probs
        self.verify = verify and trainer is not None
        self._entries: dict[VersionKey, _Entry] = {}
        # the trainer's side of each published version's canary, computed once
        self.references: ReferenceCache[VersionKey] = ReferenceCache()
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="canary-reference")
        self._reports: dict[VersionKey, CanaryReport[VersionKey]] = {}  # the publish check's

    # ================================================================ queries
    def info(self, key: VersionKey) -> _Entry:
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            raise UnknownVersionError(
                f"adapter version {key!r} was never published or registered on this sampler"
            )
        return entry

    def latest(self, adapter_id: str) -> VersionKey:
        with self._lock:
            versions = [v for (a, v) in self._entries if a == adapter_id]
        if not versions:
            raise UnknownVersionError(f"adapter {adapter_id!r} has no published version")
        return (adapter_id, max(versions))

    def resident(self) -> list[VersionKey]:
        with self._lock:
            return list(self._entries)

    def serves(self, key: VersionKey | None) -> bool:
        with self._lock:
            return key in self._entries

    def entries(self) -> list[_Entry]:
        """A snapshot of the catalogue (the caller holds `pool.lock` to act on it atomically)."""
        with self._lock:
            return list(self._entries.values())

    # ================================================================ adding
    def _new_key(self, adapter_id: str, version: int | None) -> VersionKey:
        return new_version_key(self._entries, adapter_id, version)

    def publish(
        self,
        adapter_id: str,
        source: AdapterBank,
        source_slot: int,
        *,
        version: int | None = None,
        path: PathLike | None = None,
    ) -> VersionKey:
        """Sends trainer slot `source_slot` to every replica as a new immutable version."""
        saved = Path(path) if path is not None else None
        if saved is not None:
            detect_kind(saved)
        source.check_slot(source_slot)
        ref = self._payload_ref(source, source_slot)
        with self._lock:
            key = self._new_key(adapter_id, version)
            entry = _Entry(key, ref, saved)
            self._entries[key] = entry
        verifying = self.verify and self._is_trainer(source)
        # The trainer computes its side of the canary while the replicas load the version (the
        # slot does not change during a publish: the server's engine calls wait for it).
        early = self._background.submit(self._reference, key, source_slot) if verifying else None
        try:
            self._pool.load_everywhere(entry, self.source_of(entry))
            if verifying:
                self.verify_everywhere(key, source_slot)
        except BaseException:
            if early is not None:
                wait_for([early])  # not left running for a version being withdrawn
            with contextlib.suppress(UnknownVersionError):
                self.drop(key)
            raise
        if saved is not None:
            entry.ref = None  # its files are the source from now on; free the object
        return key

    def register(self, adapter_id: str, version: int, path: PathLike) -> VersionKey:
        """A saved version (files on the server) sent to every replica: the server reads the
        files once, the replicas get the tensors through the object store."""
        saved = Path(path)
        detect_kind(saved)
        with self._lock:
            key = self._new_key(adapter_id, version)
            entry = _Entry(key, None, saved)
            self._entries[key] = entry
        try:
            self._pool.load_everywhere(entry, self.source_of(entry))
        except BaseException:
            with contextlib.suppress(UnknownVersionError):
                self.drop(key)
            raise
        return key

    def set_path(self, key: VersionKey, path: PathLike) -> None:
        saved = Path(path)
        detect_kind(saved)
        entry = self.info(key)
        entry.path = saved
        entry.ref = None

    # ================================================================ removal
    def drop(self, key: VersionKey) -> None:
        with self._lock:
            if key not in self._entries:
                raise UnknownVersionError(
                    f"adapter version {key!r} was never published or registered on this sampler"
                )
            del self._entries[key]
            self._reports.pop(key, None)
        self.references.forget(key)
        self._pool.drop_everywhere(key)

    def evict(self, key: VersionKey) -> None:
        self.info(key)
        self._pool.evict_everywhere(key)

    def retiring(self) -> list[VersionKey]:
        """Always empty: `retire` drops at once here."""
        return []

    def paging(self) -> dict[str, object]:
        """The versions the pool serves, how many times it sent one again to a replica whose
        LRU had evicted it (`resent`), and each replica's own sampler-slot counters
        (`PagingCounters.as_dict`) as of its last liveness check (None before its first)."""
        with self._lock:
            versions = len(self._entries)
        return {"versions": versions, "resent": self._pool.resent, **self._pool.replica_paging()}

    def retire(self, key: VersionKey) -> bool:
        """Dropping at once is retiring here: replicas run each batch to completion inside the
        server's call, so no sequence outlives it."""
        self.drop(key)
        return True

    # ================================================================ sources
    def _is_trainer(self, source: AdapterBank) -> bool:
        return self.trainer is not None and source is self.trainer.bank

    def _payload_ref(self, source: AdapterBank, slot: int) -> Any:
        """The trainer's own object when the source is the Ray trainer (rank 0 -> replicas
        directly); otherwise the tensors are put into the object store from here."""
        trainer = self.trainer
        if (
            isinstance(trainer, DistTrainEngine)
            and isinstance(trainer.client, RayRanks)
            and source is trainer.bank
        ):
            return trainer.client.payload_ref(slot)
        info = source.check_slot(slot)
        return ray_module().put(to_wire(info.spec, source.slot_weights(slot)))

    def source_of(self, entry: _Entry) -> Any:
        """The object-store object a replica loads `entry` from."""
        if entry.ref is not None:
            return entry.ref
        assert entry.path is not None
        try:
            payload = read_payload(entry.path)
        except (VersionError, ValueError, OSError) as exc:  # malformed or deleted files
            raise VersionUnavailableError(
                f"version {entry.key!r}: cannot read {entry.path}: {exc}"
            ) from exc
        return ray_module().put(to_wire(*payload))

    # ================================================================ canary
    def verify_everywhere(
        self, key: VersionKey, trainer_slot: int
    ) -> list[CanaryReport[VersionKey]]:
        """Every ready replica must pass the canary (lorafleet.canary's rules) for this version
        against the trainer's slot; raises SyncVerificationError naming every replica that does
        not. The replicas are asked at once while the trainer computes its side, which is
        computed once per version: a second call (or a re-synced replica) reuses it."""
        if self.trainer is None:
            raise ValueError("verify_everywhere needs the trainer the versions come from")
        tokens = self.canary_prompt()
        try:
            reports = check_replicas(
                key,
                self._pool.canary_probes(key, tokens),
                lambda: self._reference(key, trainer_slot),
                name=version_name(key),
                tolerance=self.canary_tolerance(),
            )
        except SyncVerificationError as exc:
            for label in exc.replicas:
                self._pool.record_canary(
                    label, CanaryRecord(version_name(key), False, None, time.time())
                )
            raise
        for label, report in reports.items():
            self._pool.record_canary(
                label, CanaryRecord(version_name(key), True, report.max_abs_diff, time.time())
            )
        checked = [reports[name] for name in sorted(reports)]
        if checked:
            with self._lock:
                if key in self._entries:
                    self._reports[key] = max(checked, key=lambda r: r.max_abs_diff)
        return checked

    def _reference(self, key: VersionKey, trainer_slot: int) -> Reference:
        """The version's trainer side, computed from `trainer_slot` the first time only."""
        trainer = self.trainer
        assert trainer is not None
        tokens = self.canary_prompt()

        def compute() -> Reference:
            return Reference(
                trainer.canary_logprobs(trainer_slot, tokens),
                layers_are_zero(trainer.bank.slot_weights(trainer_slot).values()),
            )

        return self.references.get(key, compute)

    def close(self) -> None:
        """Nothing waits on a trainer that may be gone: a reference still running is abandoned
        with the pool."""
        self._background.shutdown(wait=False, cancel_futures=True)

    def verify_on(
        self, label: str, handle: Any, key: VersionKey
    ) -> CanaryReport[VersionKey] | None:
        """The canary on one replica (`handle`, e.g. a restarted one before it serves again)
        against the version's recorded reference; None when the version has none (registered
        from files, or published unverified). Raises SyncVerificationError."""
        recorded = self.references.recorded(key)
        if recorded is None:
            return None
        tokens = self.canary_prompt()
        try:
            reports = check_replicas(
                key,
                {label: lambda: _replica_logprobs(handle, key, tokens)},
                lambda: recorded,
                name=version_name(key),
                tolerance=self.canary_tolerance(),
            )
        except SyncVerificationError:
            self._pool.record_canary(
                label, CanaryRecord(version_name(key), False, None, time.time())
            )
            raise
        report = reports.get(label)
        if report is not None:
            self._pool.record_canary(
                label, CanaryRecord(version_name(key), True, report.max_abs_diff, time.time())
            )
        return report

    def verified(self, version: VersionKey) -> CanaryReport[VersionKey] | None:
        """What the publish check measured (its largest difference over the replicas), None
        when this store did not check the version (`interfaces.VersionStore.verified`)."""
        with self._lock:
            return self._reports.get(version)

    def canary_prompt(self) -> list[int]:
        return canary_tokens(self._pool.limits.vocab_size)

    def canary_tolerance(self) -> float:
        return tolerance_for(self._pool.dtype, same_implementation=True)


def _node_of(info: Mapping[str, Any]) -> dict[str, Any]:
    return {k: info.get(k) for k in ("node_id", "node_ip", "pid")}


def _replica_logprobs(handle: Any, key: VersionKey, tokens: list[int]) -> ReplicaLogprobs:
    served, base = ray_module().get(handle.canary_logprobs.remote(key, tokens))
    return ReplicaLogprobs(served, base)


class RaySamplerPool:
    """The server's `Sampler` over M replica actors (see the module docstring); its version
    store is `versions`."""

    # Every replica runs lorafleet's own sampler, so every request feature is honoured; a batch
    # runs in the replica's process, so the server hears of its tokens with the result.
    features = SamplerFeatures(
        engine="ray", stop_strings=True, top_logprobs=True, token_streaming=False
    )

    def __init__(
        self,
        settings: SamplerSettings,
        replicas: int,
        *,
        trainer: Trainer | None = None,
        actor_options: dict[str, Any] | None = None,
        verify: bool = True,
        restart_timeout_s: float = 600.0,
        health_interval_s: float = 5.0,
        node_resource: str | None = None,
    ):
        """`node_resource`: prefer the nodes offering this Ray resource, at start and when a
        replica is replaced (ray_cluster.py)."""
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"sampler replicas must be a positive integer, got {replicas!r}")
        ray = ray_module()
        self.settings = settings
        self.node_resource = node_resource
        self.restart_timeout_s = restart_timeout_s
        self.lock = threading.RLock()  # replica states, and the version catalogue with them
        self._ready = threading.Condition(self.lock)
        self.versions = RayVersionStore(self, trainer=trainer, verify=verify)
        self._next = 0
        self.restarts = 0
        self.resent = 0  # versions sent again to a replica whose LRU had evicted them
        self._busy: dict[int, int] = {}  # replica index -> batches running on it
        self._closed = False
        self._stop = threading.Event()
        options = dict(actor_options or {})
        if settings.device == "cuda":
            options.setdefault("num_gpus", 1)
        # liveness checks run on a thread of their own in each actor: a replica busy with a
        # batch still answers one (its other methods keep running one at a time)
        self._actor_class = ray.remote(concurrency_groups={HEALTH_GROUP: 1})(SamplerReplica)
        self._actor_options = {"max_restarts": 0, **options}
        self._replicas = [_Replica(i, self._new_actor(i)) for i in range(replicas)]
        try:
            ready = ray.get([r.handle.ready.remote() for r in self._replicas])
        except BaseException:
            self.close()
            raise
        for replica, answer in zip(self._replicas, ready, strict=True):
            replica.answered(answer["check"], replica.changes)
            replica.node = _node_of(answer)
        self.limits: ModelLimits = ready[0]["limits"]
        self.dtype: torch.dtype = ready[0]["dtype"]
        self.base_model_id: str = ready[0]["base_model_id"]
        if health_interval_s > 0:
            threading.Thread(
                target=self._monitor,
                args=(health_interval_s,),
                name="lorafleet-replica-health",
                daemon=True,
            ).start()

    def _new_actor(self, index: int) -> Any:
        """A replica actor, placed on a live node offering `node_resource` when one does."""
        options = {**self._actor_options, **placement_options(self.node_resource, index)}
        return self._actor_class.options(**options).remote(self.settings, index)

    # ================================================================ versions on every replica
    def load_everywhere(self, entry: _Entry, source: Any) -> None:
        """Loads `entry` into every ready replica; one that dies meanwhile is replaced (and
        re-synced, this version included) in the background."""
        ray = ray_module()
        with self.lock:
            targets = [r for r in self._replicas if r.state == "ready"]
        pending = [(r, r.incarnation, r.handle.load.remote(entry.key, source)) for r in targets]
        for replica, incarnation, ref in pending:
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                self._failed(
                    replica, incarnation, f"died loading {version_name(entry.key)}: {_why(exc)}"
                )
            else:
                self._holds(replica, incarnation, entry.key, True)

    def drop_everywhere(self, key: VersionKey) -> None:
        ray = ray_module()
        for replica, incarnation, handle in self._ready_targets():
            with contextlib.suppress(ray.exceptions.RayActorError):
                ray.get(handle.drop.remote(key))
            self._holds(replica, incarnation, key, False)

    def evict_everywhere(self, key: VersionKey) -> None:
        ray = ray_module()
        for replica, incarnation, handle in self._ready_targets():
            with contextlib.suppress(ray.exceptions.RayActorError):
                ray.get(handle.evict.remote(key))
            self._holds(replica, incarnation, key, False)

    def _holds(self, replica: _Replica, incarnation: int, key: VersionKey, held: bool) -> None:
        """Records a load (`held`) or a drop the pool made on `replica`."""
        with self.lock:
            if replica.incarnation != incarnation:
                return  # replaced meanwhile: its re-sync records what the new actor holds
            replica.changes += 1
            if held:
                replica.versions.add(key)
            else:
                replica.versions.discard(key)

    def canary_probes(self, key: VersionKey, tokens: list[int]) -> dict[str, ReplicaProbe]:
        """One canary probe per ready replica, already running (every replica computes at
        once); a replica that dies meanwhile is replaced in the background and its probe answers
        None (it is checked again when it comes back)."""
        ray = ray_module()
        probes: dict[str, ReplicaProbe] = {}
        for replica, incarnation, handle in self._ready_targets():
            ref = handle.canary_logprobs.remote(key, tokens)

            def probe(
                replica: _Replica = replica, incarnation: int = incarnation, ref: Any = ref
            ) -> ReplicaLogprobs | None:
                try:
                    served, base = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                    self._failed(replica, incarnation, f"died in a canary: {_why(exc)}")
                    return None
                return ReplicaLogprobs(served, base)

            probes[replica.name] = probe
        return probes

    def record_canary(self, label: str, record: CanaryRecord) -> None:
        """The last canary of the replica named `label` (`replica_name`)."""
        with self.lock:
            for replica in self._replicas:
                if replica.name == label:
                    replica.last_canary = record

    # ================================================================ replica health
    def _ready_handles(self) -> list[Any]:
        return [handle for _, _, handle in self._ready_targets()]

    def _ready_targets(self) -> list[tuple[_Replica, int, Any]]:
        with self.lock:
            return [(r, r.incarnation, r.handle) for r in self._replicas if r.state == "ready"]

    def _failed(self, replica: _Replica, incarnation: int, reason: str) -> None:
        with self.lock:
            if self._closed or replica.state != "ready" or replica.incarnation != incarnation:
                return  # already being replaced
            replica.state = "restarting"
            node = (replica.node or {}).get("node_id", "?")
            replica.error = f"{reason} (on node {node})"
            log.warning(
                "sampler replica %d (node %s) failed (%s); replacing it",
                replica.index,
                node,
                reason,
            )
        threading.Thread(
            target=self._restart,
            args=(replica,),
            name=f"lorafleet-replica-{replica.index}",
            daemon=True,
        ).start()

    def _restart(self, replica: _Replica) -> None:
        ray = ray_module()
        with contextlib.suppress(Exception):  # the old actor is usually gone already
            ray.kill(replica.handle, no_restart=True)
        deadline = time.monotonic() + self.restart_timeout_s
        while time.monotonic() < deadline and not self._closed:
            handle = self._new_actor(replica.index)  # on a live node: the old one may be gone
            try:
                ready = ray.get(
                    handle.ready.remote(), timeout=max(1.0, deadline - time.monotonic())
                )
                self._resync(replica, handle, ready["check"], _node_of(ready))
            except (ray.exceptions.RayError, SyncVerificationError, OSError, ValueError) as exc:
                log.warning("sampler replica %d: restart failed (%s); retrying", replica.index, exc)
                with self.lock:
                    replica.error = f"restart failed, retrying: {_why(exc)}"
                with contextlib.suppress(Exception):  # best effort cleanup
                    ray.kill(handle, no_restart=True)
                time.sleep(1.0)
            else:
                self.check_liveness()  # what it holds now (its LRU may have let some go)
                return
        with self.lock:
            replica.state = "dead"
            replica.error = (
                f"could not be restarted within {self.restart_timeout_s:.0f} s ({replica.error})"
            )
            self._ready.notify_all()
        log.error("sampler replica %d could not be restarted", replica.index)

    def _resync(
        self, replica: _Replica, handle: Any, check: ReplicaCheck, node: dict[str, Any]
    ) -> None:
        """Loads every version the store serves, then puts the replica back in rotation;
        versions published meanwhile are caught by the loop (the last check and the switch are
        atomic). `check`: the new actor's first answer."""
        ray = ray_module()
        loaded: set[VersionKey] = set()
        held: set[VersionKey] = set()  # those actually sent (a version whose files are gone is not)
        stale: list[VersionKey] = []  # set when the loop ends (nothing left to load)
        while True:
            with self.lock:
                entries = self.versions.entries()
                missing = [e for e in entries if e.key not in loaded]
                if not missing:
                    current = {e.key for e in entries}
                    stale = [k for k in loaded if k not in current]
                    replica.handle = handle
                    replica.incarnation += 1
                    replica.state = "ready"
                    replica.error = None
                    replica.restarts += 1
                    replica.answered(check, replica.changes)
                    replica.versions = held & current
                    replica.node = node
                    self.restarts += 1
                    self._ready.notify_all()
                    break
            for entry in missing:
                try:
                    source = self.versions.source_of(entry)
                except VersionUnavailableError as exc:
                    log.warning(
                        "sampler replica %d: not re-syncing %s: %s", replica.index, entry.key, exc
                    )
                else:
                    ray.get(handle.load.remote(entry.key, source))
                    # before it serves again: the trainer's side was recorded at publish
                    self.versions.verify_on(replica.name, handle, entry.key)
                    held.add(entry.key)
                loaded.add(entry.key)
        for key in stale:
            ray.get(handle.drop.remote(key))
        log.info(
            "sampler replica %d is back with %d versions", replica.index, len(loaded) - len(stale)
        )

    def _monitor(self, interval_s: float) -> None:
        """The liveness check, every `interval_s`: finds replicas that died while idle (and
        replaces them), and records every live one's answer."""
        while not self._stop.wait(interval_s):
            self.check_liveness()

    def check_liveness(self, timeout_s: float = LIVENESS_TIMEOUT_S) -> None:
        """Asks every replica in rotation for its report at once (`HEALTH_GROUP`, so a busy one
        answers too). A dead actor is replaced; one that does not answer within `timeout_s`
        stays in rotation (Ray still holds it alive) but shows as unhealthy until it does."""
        ray = ray_module()
        with self.lock:
            targets = [
                (r, r.incarnation, r.changes, r.handle)
                for r in self._replicas
                if r.state == "ready"
            ]
        asked = [
            (
                replica,
                incarnation,
                changes,
                handle.check.options(concurrency_group=HEALTH_GROUP).remote(),
            )
            for replica, incarnation, changes, handle in targets
        ]
        if not asked:
            return
        ray.wait([ref for *_, ref in asked], num_returns=len(asked), timeout=timeout_s)
        for replica, incarnation, changes, ref in asked:
            done, _ = ray.wait([ref], timeout=0)
            if not done:
                with self.lock:
                    if replica.incarnation == incarnation and replica.state == "ready":
                        replica.unanswered = True
                        replica.error = f"no answer to the liveness check within {timeout_s:.0f} s"
                continue
            try:
                check = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                self._failed(replica, incarnation, f"failed the liveness check: {_why(exc)}")
                continue
            except ray.exceptions.RayError as exc:  # alive, but its report raised
                with self.lock:
                    if replica.incarnation == incarnation and replica.state == "ready":
                        replica.unanswered = True
                        replica.error = f"its liveness check failed: {_why(exc)}"
                continue
            with self.lock:
                if replica.incarnation == incarnation and replica.state == "ready":
                    replica.answered(check, changes)
                    replica.error = None

    def busy(self) -> dict[int, int]:
        """Batches running per replica index (tests pick a busy replica to kill)."""
        with self.lock:
            return {i: n for i, n in self._busy.items() if n}

    def _pick(self) -> _Replica:
        """The next ready replica (round robin), waiting while every replica is restarting."""
        deadline = time.monotonic() + self.restart_timeout_s
        with self.lock:
            while True:
                ready = [r for r in self._replicas if r.state == "ready"]
                if ready:
                    self._next = (self._next + 1) % len(ready)
                    return ready[self._next]
                if all(r.state == "dead" for r in self._replicas) or self._closed:
                    raise RuntimeError("no sampler replica is alive")
                if not self._ready.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise RuntimeError("no sampler replica became ready in time")

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Blocks until no replica is restarting (tests, orderly shutdown)."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while any(r.state == "restarting" for r in self._replicas):
                if not self._ready.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise RuntimeError("a sampler replica is still restarting")

    # ================================================================ sampler API
    def submit(self, requests: Sequence[SampleRequest]) -> list[Future[SampleResult]]:
        """Runs the batch to completion now (each replica runs its own running batch) and
        returns resolved futures, so the server drives this pool as it drives a local sampler."""
        futures: list[Future[SampleResult]] = []
        for result in self.generate(requests):
            future: Future[SampleResult] = Future()
            future.set_result(result)
            futures.append(future)
        return futures

    def step(self) -> bool:
        """Nothing runs here between calls: `submit` finished every batch it was given."""
        return False

    def generate(self, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        """Runs the batch on one replica. If that replica dies the batch runs again on another
        (sampling is seeded per request, so a retry is the same request); requests for a version
        the pool serves but the replica lacks (evicted from its LRU) get the version sent again
        and run again there. Other errors are the requests' own."""
        ray = ray_module()
        requests = list(requests)
        results: list[SampleResult | None] = [None] * len(requests)
        pending = list(range(len(requests)))
        # what crosses to a replica: the request without its process-local parts (a thread
        # event and a progress hook cannot be pickled; this pool declares token_streaming off)
        wire = [_for_replica(r) for r in requests]
        attempts = 2 * len(self._replicas) + 2
        for _ in range(attempts):
            # a request whose caller went away is not sent, nor sent again (a retry after its
            # replica died or lacked its version)
            still = []
            for index in pending:
                if _is_cancelled(requests[index]):
                    results[index] = _cancelled(requests[index])
                else:
                    still.append(index)
            pending = still
            if not pending:
                return [r for r in results if r is not None]
            replica = self._pick()
            with self.lock:
                incarnation, handle = replica.incarnation, replica.handle
                self._busy[replica.index] = self._busy.get(replica.index, 0) + 1
            try:
                batch = [wire[i] for i in pending]
                out: list[SampleResult] = ray.get(handle.generate.remote(batch))
                retry = []
                for index, result in zip(pending, out, strict=True):
                    results[index] = result
                    missing = result.error is not None and result.error.code in (
                        "unknown_version",
                        "version_unavailable",
                    )
                    if missing and self.versions.serves(requests[index].adapter):
                        retry.append(index)
                keys = {key for key in (requests[i].adapter for i in retry) if key is not None}
                if keys:
                    log.info(
                        "sampler replica %d: sending %d evicted or missing version(s) again",
                        replica.index,
                        len(keys),
                    )
                unavailable = set()
                for key in keys:
                    try:
                        source = self.versions.source_of(self.versions.info(key))
                    except VersionError:  # dropped meanwhile, or its files are gone
                        unavailable.add(key)
                        continue
                    ray.get(handle.load.remote(key, source))
                    self._holds(replica, incarnation, key, True)
                    with self.lock:
                        self.resent += 1
                retry = [i for i in retry if requests[i].adapter not in unavailable]
                if not retry:
                    return [r for r in results if r is not None]
                pending = retry
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                self._failed(replica, incarnation, f"died running a batch: {_why(exc)}")
            finally:
                with self.lock:
                    self._busy[replica.index] -= 1
        if all(r is not None for r in results):
            return [r for r in results if r is not None]  # the last attempt's errors stand
        raise RuntimeError(f"the batch failed on every sampler replica ({attempts} attempts)")

    def probe_logprobs(self, key: VersionKey | None, tokens: Sequence[int]) -> torch.Tensor:
        """Through `generate`: batches run to completion on a replica, nothing queues here."""
        return generated_prompt_logprobs(self, key, tokens)

    def generate_on(self, index: int, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        """Runs a batch on one given replica (tests: every replica must serve the same)."""
        return ray_module().get(self._replicas[index].handle.generate.remote(list(requests)))

    def known_on(self, index: int) -> list[VersionKey]:
        return ray_module().get(self._replicas[index].handle.known.remote())

    def replica_handle(self, index: int) -> Any:
        return self._replicas[index].handle

    # ================================================================ reports (interfaces.Sampler)
    def health(self) -> SamplerHealth:
        return self.rollout_stats().health()

    def rollout_stats(self) -> RolloutStats:
        """Each replica as the last liveness check and the pool's own calls found it: where it
        runs, its state, the versions it holds, its last canary, restarts and what is wrong."""
        with self.lock:
            replicas = tuple(
                ReplicaStats(
                    name=r.name,
                    url=r.check.where if r.check is not None else "ray actor",
                    state=r.report_state,
                    versions=tuple(version_name(k) for k in sorted(r.versions)),
                    last_canary=r.last_canary,
                    restarts=r.restarts,
                    error=r.error,
                    node=r.node,
                )
                for r in self._replicas
            )
        return RolloutStats(engine="ray", sync="tensor", replicas=replicas)

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The replicas' prefix caches, summed, as of their last liveness checks (a replaced
        replica's starts empty); None while no replica is in rotation."""
        with self.lock:
            parts = [
                r.check.prefix_cache
                for r in self._replicas
                if r.state == "ready" and r.check is not None
            ]
        return PrefixCacheStats.combined(parts)

    def replica_paging(self) -> dict[str, object]:
        """Each replica's sampler-slot counters as of its last liveness check."""
        with self.lock:
            return {
                "replicas": {
                    r.name: None if r.check is None else r.check.paging for r in self._replicas
                }
            }

    def release_cache(self) -> None:
        ray = ray_module()
        for handle in self._ready_handles():
            with contextlib.suppress(ray.exceptions.RayActorError):
                ray.get(handle.release_cache.remote())

    def close(self) -> None:
        ray = ray_module()
        with self.lock:
            self._closed = True
            self._ready.notify_all()
        self._stop.set()
        self.versions.close()
        for replica in self._replicas:
            with contextlib.suppress(Exception):  # best effort: the replica may be gone
                ray.kill(replica.handle, no_restart=True)


def _for_replica(request: SampleRequest) -> SampleRequest:
    """The request as a replica process receives it: no cancel event, no progress hook."""
    if request.cancel is None and request.on_token is None:
        return request
    return replace(request, cancel=None, on_token=None)


def _is_cancelled(request: SampleRequest) -> bool:
    return request.cancel is not None and request.cancel.is_set()


def _cancelled(request: SampleRequest) -> SampleResult:
    """A request whose caller went away before it was sent: it never reaches a replica."""
    error = SampleError("cancelled", "the request was cancelled (its client went away)")
    return SampleResult(sequences=[], adapter=request.adapter, error=error)
