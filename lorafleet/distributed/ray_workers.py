"""Ray placement: trainer ranks and sampler replicas as actors, versions through the object store.

- `RayRanks`: one actor per trainer rank (a GPU each on a GPU cluster); rank 0's node hosts the
  rendezvous, the ranks form a gloo/NCCL group and shard the base with FSDP2 (fsdp.py). The
  server calls every rank with each collective command (Ray runs an actor's calls in order).
- `RaySamplerPool`: M sampler replicas, each with its own full base and `SampleEngine`. It is
  the server's sampler *and* its version store: publishing a version asks trainer rank 0 for
  the adapter's per-layer tensors as an object-store object and hands that same object to every
  replica (no shared filesystem; the tensors never pass through the server), then checks each
  replica's canary log-probs against the trainer's. A replica that dies is replaced, re-synced
  with every known version, and only then serves again; the batch it was running is re-run on
  another replica, so no request is lost.

Replicas hold versions in memory only. The pool keeps each version's source (its object in
the store while unsaved, the server's files once saved), so a version a replica's LRU evicted,
or a replica that restarted, gets the tensors again: no replica needs a disk, and nothing is
written on the sync path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lorafleet.adapters.checkpoint import read_training_state
from lorafleet.adapters.peft_io import read_peft
from lorafleet.distributed.fsdp import DistError
from lorafleet.distributed.protocol import LOCAL_COMMANDS, RankSettings, Reply, command, dumps
from lorafleet.fsio import PathLike
from lorafleet.model.banks import AdapterSpec
from lorafleet.sample.types import SampleRequest, SampleResult, SamplingParams, VersionKey
from lorafleet.sample.verify import (
    TOLERANCES,
    SyncVerificationError,
    canary_tokens,
    trainer_canary_logprobs,
)
from lorafleet.sample.versions import (
    UnknownVersionError,
    VersionError,
    VersionUnavailableError,
    detect_kind,
)

log = logging.getLogger(__name__)

Payload = tuple[AdapterSpec, dict[str, tuple[torch.Tensor, torch.Tensor]]]
"""An adapter version: its spec (targets resolved) and per-layer A/B, fp32."""
WirePayload = tuple[AdapterSpec, dict[str, tuple[np.ndarray, np.ndarray]]]
"""The same in the object store: numpy arrays, which Ray reads without a copy on the node."""


def to_wire(
    spec: AdapterSpec, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> WirePayload:
    return spec, {
        path: (A.detach().cpu().numpy(), B.detach().cpu().numpy())
        for path, (A, B) in weights.items()
    }


def from_wire(payload: WirePayload) -> Payload:
    """Tensors over the (read-only) object-store arrays; the bank copies them right away."""
    spec, arrays = payload
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return spec, {
            path: (torch.from_numpy(A), torch.from_numpy(B)) for path, (A, B) in arrays.items()
        }


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "Ray placement needs the 'dist' extra: pip install 'lorafleet[dist]'"
        ) from exc
    return ray


def connect(address: str, *, num_cpus: int | None = None) -> None:
    """`address`: a Ray address (`ray://host:10001`, `host:6379`), `auto` (the cluster this
    machine belongs to), or `local` (start a private one-machine cluster, no dashboard)."""
    ray = _ray()
    if ray.is_initialized():
        return
    env = {
        k: v for k, v in os.environ.items() if k in ("HF_HUB_OFFLINE", "LORAFLEET_CACHE", "HF_HOME")
    }
    runtime_env = {"env_vars": env} if env else None
    if address == "local":
        ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env)
    else:
        ray.init(address=address, runtime_env=runtime_env)


# ====================================================================== trainer ranks


class TrainerRankActor:
    """One trainer rank in a Ray actor (wrapped with `ray.remote` at placement time)."""

    def __init__(self, rank: int, world: int):
        self.rank = rank
        self.world = world
        self.worker: Any = None

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it, for the group's rendezvous."""
        ip = _ray().util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind(("", 0))
            return ip, int(sock.getsockname()[1])

    def setup(self, settings: RankSettings, master_addr: str, master_port: int) -> Reply:
        from lorafleet.distributed.trainer_worker import RankWorker, init_distributed

        try:
            os.environ["MASTER_ADDR"] = master_addr
            os.environ["MASTER_PORT"] = str(master_port)
            cpu_group = init_distributed(settings, self.rank, self.world)
            self.worker = RankWorker(settings, cpu_group=cpu_group)
            return Reply(ok=True, value=self.worker.info, rank=self.rank)
        except Exception as exc:  # reported to the server, which stops the group
            log.exception("trainer rank %d failed to start", self.rank)
            return Reply.failure(exc, self.rank)

    def call(self, name: str, message: bytes) -> bytes:
        """Commands and replies cross Ray as `protocol.dumps` bytes (fast tensor pickling)."""
        return dumps(self.worker.handle(name, pickle.loads(message)))

    def payload(self, slot: int) -> WirePayload:
        """The adapter's spec and per-layer arrays, returned as an object-store object that the
        samplers read directly (raises, into the object, if the slot is empty)."""
        return to_wire(*self.worker.trainer.slot_weights(slot))

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class RayRanks:
    """Trainer ranks as Ray actors; same `call` interface as the torchrun launcher."""

    def __init__(
        self, settings: RankSettings, nproc: int, *, actor_options: dict[str, Any] | None = None
    ):
        settings.validate()
        if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
            raise ValueError(f"trainer ranks must be a positive integer, got {nproc!r}")
        ray = _ray()
        options = dict(actor_options or {})
        if settings.device == "cuda":
            options.setdefault("num_gpus", 1)
        actor_class = ray.remote(TrainerRankActor).options(max_restarts=0, **options)
        self.actors = [actor_class.remote(rank, nproc) for rank in range(nproc)]
        try:
            addr, port = ray.get(self.actors[0].address.remote())
            replies = ray.get([actor.setup.remote(settings, addr, port) for actor in self.actors])
            failed = [r for r in replies if not r.ok]
            if failed:
                raise DistError(
                    "trainer ranks failed to start: "
                    + "; ".join(f"rank {r.rank}: {r.error}" for r in failed)
                )
        except BaseException:
            self._kill()
            raise
        self.info: dict[str, Any] = replies[0].value

    def call(self, name: str, **kwargs: Any) -> Any:
        ray = _ray()
        message_name, message = command(name, **kwargs)
        try:
            if message_name in LOCAL_COMMANDS:
                return pickle.loads(
                    ray.get(self.actors[0].call.remote(message_name, dumps(message)))
                ).unwrap()
            shared = ray.put(dumps(message))  # one copy in the object store, read by every rank
            replies: list[Reply] = [
                pickle.loads(b)
                for b in ray.get([a.call.remote(message_name, shared) for a in self.actors])
            ]
        except ray.exceptions.RayActorError as exc:
            raise DistError(f"a trainer rank died: {exc}") from exc
        failed = [r for r in replies if not r.ok]
        if failed and len(failed) < len(replies):
            raise DistError(
                "ranks disagree: " + "; ".join(f"rank {r.rank}: {r.error}" for r in failed)
            )
        return replies[0].unwrap()

    def payload_ref(self, slot: int) -> Any:
        return self.actors[0].payload.remote(slot)

    def _kill(self) -> None:
        ray = _ray()
        for actor in self.actors:
            with contextlib.suppress(Exception):  # best effort: the actor may be gone already
                ray.kill(actor, no_restart=True)

    def close(self) -> None:
        ray = _ray()
        with contextlib.suppress(Exception):  # closing a group whose ranks may be dead
            ray.get([actor.shutdown.remote() for actor in self.actors], timeout=30)
        self._kill()


# ====================================================================== sampler replicas


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


class SamplerReplica:
    """One sampler replica in a Ray actor: full base + sampler bank + version store.

    Versions live in memory only: when its LRU evicts one, or it restarts, the pool sends the
    tensors again (from the object store, or from the server's saved files), so a replica needs
    no disk of its own and nothing is written on the sync path.
    """

    def __init__(self, settings: SamplerSettings, index: int):
        from lorafleet.model.adapted import AdaptedModel
        from lorafleet.model.loader import load_base
        from lorafleet.sample.engine import SampleEngine
        from lorafleet.sample.versions import VersionStore

        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        device = "cuda" if settings.device == "cuda" else "cpu"
        base = load_base(settings.base_model, dtype=settings.dtype, device=device)
        self.index = index
        self.base_model_id = base.model_id
        adapted = AdaptedModel(base.model, settings.targets)
        sample = adapted.add_bank(
            "sample", num_slots=settings.slots + 1, r_max=settings.r_max, trainable=False
        )
        # A staging slot: VersionStore publishes from a bank slot, so received tensors land here first.
        self.inbox = adapted.add_bank("inbox", num_slots=2, r_max=settings.r_max, trainable=False)
        self.versions = VersionStore(sample, base_model_id=base.model_id)
        self.engine = SampleEngine(
            adapted, self.versions, tokenizer=base.tokenizer, max_rows=settings.max_rows
        )
        # versions received and not dropped (resident or evicted)
        self._keys: set[VersionKey] = set()
        self._load_lock = threading.Lock()

    def ready(self) -> dict[str, Any]:
        return {
            "limits": self.engine.limits,
            "dtype": self.engine.dtype,
            "base_model_id": self.base_model_id,
            "pid": os.getpid(),
        }

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

    def canary_logprobs(self, key: VersionKey, tokens: list[int]) -> list[float]:
        params = SamplingParams(max_tokens=1, temperature=0.0, stop=[])
        (result,) = self.engine.generate(
            [SampleRequest(tokens, params, adapter=key, prompt_logprobs=True)]
        )
        if result.error is not None or result.prompt_logprobs is None:
            raise SyncVerificationError(
                f"canary: replica {self.index} cannot run {key!r}: {result.error}"
            )
        return [float(v) for v in result.prompt_logprobs[1:]]  # type: ignore[arg-type]

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
    index: int
    handle: Any
    state: str = "ready"  # "ready" | "restarting" | "dead"
    incarnation: int = 0


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


class RaySamplerPool:
    """The server's sampler and version store over M replica actors (see the module docstring)."""

    def __init__(
        self,
        settings: SamplerSettings,
        replicas: int,
        *,
        trainer: Any = None,
        actor_options: dict[str, Any] | None = None,
        verify: bool = True,
        restart_timeout_s: float = 600.0,
        health_interval_s: float = 5.0,
    ):
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"sampler replicas must be a positive integer, got {replicas!r}")
        ray = _ray()
        self.settings = settings
        self.trainer = trainer  # a DistTrainEngine: source of payloads and of canary log-probs
        self.verify = verify and trainer is not None
        self.restart_timeout_s = restart_timeout_s
        self.versions = self  # the executor and verify.py reach the store as `sampler.versions`
        self._entries: dict[VersionKey, _Entry] = {}
        self._lock = threading.RLock()
        self._ready = threading.Condition(self._lock)
        self._next = 0
        self.restarts = 0
        self._busy: dict[int, int] = {}  # replica index -> batches running on it
        self._closed = False
        self._stop = threading.Event()
        options = dict(actor_options or {})
        if settings.device == "cuda":
            options.setdefault("num_gpus", 1)
        self._actor_class = ray.remote(SamplerReplica).options(max_restarts=0, **options)
        self._replicas = [
            _Replica(i, self._actor_class.remote(settings, i)) for i in range(replicas)
        ]
        try:
            ready = ray.get([r.handle.ready.remote() for r in self._replicas])
        except BaseException:
            self.close()
            raise
        self.limits = ready[0]["limits"]
        self.dtype: torch.dtype = ready[0]["dtype"]
        self.base_model_id: str = ready[0]["base_model_id"]
        if health_interval_s > 0:
            threading.Thread(
                target=self._monitor,
                args=(health_interval_s,),
                name="lorafleet-replica-health",
                daemon=True,
            ).start()

    # ================================================================ version store API
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

    def _new_key(self, adapter_id: str, version: int | None) -> VersionKey:
        if not isinstance(adapter_id, str) or not adapter_id:
            raise ValueError(f"adapter_id must be a non-empty string, got {adapter_id!r}")
        if version is None:
            existing = [v for (a, v) in self._entries if a == adapter_id]
            version = max(existing) + 1 if existing else 0
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an integer >= 0, got {version!r}")
        key = (adapter_id, version)
        if key in self._entries:
            raise VersionError(f"version {key!r} is already published; versions are immutable")
        return key

    def publish(
        self,
        adapter_id: str,
        source: Any,
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
        try:
            self._fan_out(entry)
            if self.verify and source is getattr(self.trainer, "bank", None):
                self.verify_everywhere(key, source_slot)
        except BaseException:
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
            self._fan_out(entry)
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

    def drop(self, key: VersionKey) -> None:
        ray = _ray()
        with self._lock:
            if key not in self._entries:
                raise UnknownVersionError(
                    f"adapter version {key!r} was never published or registered on this sampler"
                )
            del self._entries[key]
            handles = [r.handle for r in self._replicas if r.state == "ready"]
        for handle in handles:
            with contextlib.suppress(ray.exceptions.RayActorError):
                ray.get(handle.drop.remote(key))

    def evict(self, key: VersionKey) -> None:
        ray = _ray()
        self.info(key)
        for handle in self._ready_handles():
            with contextlib.suppress(ray.exceptions.RayActorError):
                ray.get(handle.evict.remote(key))

    # ================================================================ moving versions
    def _payload_ref(self, source: Any, slot: int) -> Any:
        """The trainer's own object when the source is the Ray trainer (rank 0 -> replicas
        directly); otherwise the tensors are put into the object store from here."""
        client = getattr(self.trainer, "client", None)
        if source is getattr(self.trainer, "bank", None) and hasattr(client, "payload_ref"):
            return client.payload_ref(slot)
        info = source.check_slot(slot)
        return _ray().put(to_wire(info.spec, source.slot_weights(slot)))

    def _source_of(self, entry: _Entry) -> Any:
        if entry.ref is not None:
            return entry.ref
        assert entry.path is not None
        try:
            payload = read_payload(entry.path)
        except (VersionError, ValueError, OSError) as exc:  # malformed or deleted files
            raise VersionUnavailableError(
                f"version {entry.key!r}: cannot read {entry.path}: {exc}"
            ) from exc
        return _ray().put(to_wire(*payload))

    def _fan_out(self, entry: _Entry) -> None:
        """Loads `entry` into every ready replica; one that dies meanwhile is replaced (and
        re-synced, this version included) in the background."""
        ray = _ray()
        source = self._source_of(entry)
        with self._lock:
            targets = [r for r in self._replicas if r.state == "ready"]
        pending = [(r, r.incarnation, r.handle.load.remote(entry.key, source)) for r in targets]
        for replica, incarnation, ref in pending:
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                self._failed(replica, incarnation)

    def verify_everywhere(self, key: VersionKey, trainer_slot: int) -> None:
        """Every replica's canary log-probs must match the trainer's for this slot."""
        ray = _ray()
        tokens = canary_tokens(self.limits.vocab_size)
        expected = trainer_canary_logprobs(self.trainer, trainer_slot, tokens)
        tolerance = TOLERANCES.get(self.dtype, 0.02)
        with self._lock:
            targets = [(r, r.incarnation, r.handle) for r in self._replicas if r.state == "ready"]
        for replica, incarnation, handle in targets:
            try:
                got = torch.tensor(ray.get(handle.canary_logprobs.remote(key, tokens)))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                self._failed(replica, incarnation)
                continue
            diff = float((got - expected).abs().max())
            if not diff <= tolerance:
                raise SyncVerificationError(
                    f"canary mismatch for {key!r} on sampler replica {replica.index}: log-probs differ from trainer "
                    f"slot {trainer_slot} by {diff:.3g} (tolerance {tolerance:.3g})"
                )

    # ================================================================ replica health
    def _ready_handles(self) -> list[Any]:
        with self._lock:
            return [r.handle for r in self._replicas if r.state == "ready"]

    def _failed(self, replica: _Replica, incarnation: int) -> None:
        with self._lock:
            if self._closed or replica.state != "ready" or replica.incarnation != incarnation:
                return  # already being replaced
            replica.state = "restarting"
            log.warning("sampler replica %d failed; replacing it", replica.index)
        threading.Thread(
            target=self._restart,
            args=(replica,),
            name=f"lorafleet-replica-{replica.index}",
            daemon=True,
        ).start()

    def _restart(self, replica: _Replica) -> None:
        ray = _ray()
        with contextlib.suppress(Exception):  # the old actor is usually gone already
            ray.kill(replica.handle, no_restart=True)
        deadline = time.monotonic() + self.restart_timeout_s
        while time.monotonic() < deadline and not self._closed:
            handle = self._actor_class.remote(self.settings, replica.index)
            try:
                ray.get(handle.ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
                self._resync(replica, handle)
                return
            except (ray.exceptions.RayError, SyncVerificationError, OSError, ValueError) as exc:
                log.warning("sampler replica %d: restart failed (%s); retrying", replica.index, exc)
                with contextlib.suppress(Exception):  # best effort cleanup
                    ray.kill(handle, no_restart=True)
                time.sleep(1.0)
        with self._lock:
            replica.state = "dead"
            self._ready.notify_all()
        log.error("sampler replica %d could not be restarted", replica.index)

    def _resync(self, replica: _Replica, handle: Any) -> None:
        """Loads every version the pool serves, then puts the replica back in rotation; versions
        published meanwhile are caught by the loop (the last check and the switch are atomic)."""
        ray = _ray()
        loaded: set[VersionKey] = set()
        while True:
            with self._lock:
                missing = [e for key, e in self._entries.items() if key not in loaded]
                if not missing:
                    stale = [k for k in loaded if k not in self._entries]
                    replica.handle = handle
                    replica.incarnation += 1
                    replica.state = "ready"
                    self.restarts += 1
                    self._ready.notify_all()
                    break
            for entry in missing:
                try:
                    source = self._source_of(entry)
                except VersionUnavailableError as exc:
                    log.warning(
                        "sampler replica %d: not re-syncing %s: %s", replica.index, entry.key, exc
                    )
                else:
                    ray.get(handle.load.remote(entry.key, source))
                loaded.add(entry.key)
        for key in stale:
            ray.get(handle.drop.remote(key))
        log.info(
            "sampler replica %d is back with %d versions", replica.index, len(loaded) - len(stale)
        )

    def _monitor(self, interval_s: float) -> None:
        """Finds replicas that died while idle (a call to a busy one would just wait, so only an
        answer that says "dead" counts)."""
        ray = _ray()
        while not self._stop.wait(interval_s):
            with self._lock:
                targets = [
                    (r, r.incarnation, r.handle) for r in self._replicas if r.state == "ready"
                ]
            for replica, incarnation, handle in targets:
                ref = handle.ready.remote()
                done, _ = ray.wait([ref], timeout=1.0)
                if not done:
                    continue  # busy generating: alive
                try:
                    ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                    self._failed(replica, incarnation)

    def busy(self) -> dict[int, int]:
        """Batches running per replica index (tests pick a busy replica to kill)."""
        with self._lock:
            return {i: n for i, n in self._busy.items() if n}

    def _pick(self) -> _Replica:
        """The next ready replica (round robin), waiting while every replica is restarting."""
        deadline = time.monotonic() + self.restart_timeout_s
        with self._lock:
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
        with self._lock:
            while any(r.state == "restarting" for r in self._replicas):
                if not self._ready.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise RuntimeError("a sampler replica is still restarting")

    # ================================================================ sampler API
    def generate(self, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        """Runs the batch on one replica. If that replica dies the batch runs again on another
        (sampling is seeded per request, so a retry is the same request); requests for a version
        the pool serves but the replica lacks (evicted from its LRU) get the version sent again
        and run again there. Other errors are the requests' own."""
        ray = _ray()
        requests = list(requests)
        results: list[SampleResult | None] = [None] * len(requests)
        pending = list(range(len(requests)))
        attempts = 2 * len(self._replicas) + 2
        for _ in range(attempts):
            replica = self._pick()
            with self._lock:
                incarnation, handle = replica.incarnation, replica.handle
                self._busy[replica.index] = self._busy.get(replica.index, 0) + 1
            try:
                batch = [requests[i] for i in pending]
                out: list[SampleResult] = ray.get(handle.generate.remote(batch))
                retry = []
                for index, result in zip(pending, out, strict=True):
                    results[index] = result
                    missing = result.error is not None and result.error.code in (
                        "unknown_version",
                        "version_unavailable",
                    )
                    if missing and requests[index].adapter in self._entries:
                        retry.append(index)
                keys = {requests[i].adapter for i in retry}
                if keys:
                    log.info(
                        "sampler replica %d: sending %d evicted or missing version(s) again",
                        replica.index,
                        len(keys),
                    )
                unavailable = set()
                for key in keys:
                    try:
                        source = self._source_of(self.info(key))
                    except VersionError:  # dropped meanwhile, or its files are gone
                        unavailable.add(key)
                        continue
                    ray.get(handle.load.remote(key, source))
                retry = [i for i in retry if requests[i].adapter not in unavailable]
                if not retry:
                    return [r for r in results if r is not None]
                pending = retry
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                self._failed(replica, incarnation)
            finally:
                with self._lock:
                    self._busy[replica.index] -= 1
        if all(r is not None for r in results):
            return [r for r in results if r is not None]  # the last attempt's errors stand
        raise RuntimeError(f"the batch failed on every sampler replica ({attempts} attempts)")

    def generate_on(self, index: int, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        """Runs a batch on one given replica (tests: every replica must serve the same)."""
        return _ray().get(self._replicas[index].handle.generate.remote(list(requests)))

    def known_on(self, index: int) -> list[VersionKey]:
        return _ray().get(self._replicas[index].handle.known.remote())

    def replica_handle(self, index: int) -> Any:
        return self._replicas[index].handle

    def release_cache(self) -> None:
        ray = _ray()
        for handle in self._ready_handles():
            with contextlib.suppress(ray.exceptions.RayActorError):
                ray.get(handle.release_cache.remote())

    def close(self) -> None:
        ray = _ray()
        with self._lock:
            self._closed = True
            self._ready.notify_all()
        self._stop.set()
        for replica in self._replicas:
            with contextlib.suppress(Exception):  # best effort: the replica may be gone
                ray.kill(replica.handle, no_restart=True)
