"""What every rollout engine offers, whatever runs behind it (our sampler, vLLM, SGLang).

The field's worst LoRA-RL bug is a rollout that silently runs on the base model: the adapter
was never loaded, a request went out without the adapter's name, or the engine ignored
modules whose names it did not recognise. Three rules here close those doors:

- adapters are versioned: a version is `<adapter>@<version>` (`AdapterVersion.name`), loaded
  under that name and never changed afterwards, so a request names exactly what it must run;
- every `RolloutRequest` names its adapter version, or the `BASE` sentinel when the base model
  is really wanted; there is no default, and `None` is refused;
- every sync is followed by a canary check (lorafleet.canary), and a failed one raises.
"""

from __future__ import annotations

import contextlib
import enum
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from lorafleet.adapters.peft_io import peft_config
from lorafleet.canary import SyncVerificationError, layers_are_zero
from lorafleet.fsio import safe_name
from lorafleet.interfaces import AdapterBank
from lorafleet.model.banks import AdapterSpec

__all__ = [
    "BASE",
    "AdapterUpdate",
    "AdapterVersion",
    "BaseModel",
    "EngineHTTPError",
    "InFlight",
    "OffloadLevel",
    "RolloutEngine",
    "RolloutEngineError",
    "RolloutParams",
    "RolloutRequest",
    "RolloutResult",
    "SyncError",
    "SyncMode",
    "SyncVerificationError",
    "UnsupportedSyncModeError",
]


class SyncMode(enum.StrEnum):
    """How a new adapter version reaches the engine (DESIGN.md, "Sync to samplers")."""

    TENSOR = "tensor"  # tensors in memory: in-process copy, or SGLang's load-from-tensors
    FILES = "files"  # a PEFT directory + the engine's load endpoint
    MERGED = "merged"  # W + scale * B @ A pushed as full weights (single-adapter engines)

    @classmethod
    def parse(cls, value: str | SyncMode) -> SyncMode:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"sync mode must be one of {[m.value for m in cls]}, got {value!r}"
            ) from None


class OffloadLevel(enum.IntEnum):
    """What a colocated engine gives back between rollout and training.

    KEEP: nothing. KV_CACHE: the KV cache (vLLM sleep level 1, SGLang release of the
    kv_cache tag). WEIGHTS: also the engine's weights; the base is re-sent on wake.
    With LoRA at level <= 1 only the adapter moves on each sync.
    """

    KEEP = 0
    KV_CACHE = 1
    WEIGHTS = 2

    @classmethod
    def parse(cls, value: int | OffloadLevel) -> OffloadLevel:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"offload level must be 0, 1 or 2, got {value!r}")
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"offload level must be 0, 1 or 2, got {value!r}") from None


class RolloutEngineError(RuntimeError):
    """An engine could not do what was asked; the message says which engine and why."""


class EngineHTTPError(RolloutEngineError):
    """An engine's HTTP API answered with an error status or an unreadable body."""

    def __init__(self, message: str, *, status: int | None = None, url: str | None = None):
        super().__init__(message)
        self.status = status
        self.url = url


class SyncError(RolloutEngineError):
    """A new version could not be delivered to the engine (before any verification)."""


class UnsupportedSyncModeError(SyncError, ValueError):
    """The engine cannot take adapters this way (e.g. merged weights into a multi-adapter sampler)."""


_VERSION_NAME = re.compile(r"(?P<adapter>[A-Za-z0-9._-]+)@(?P<version>[0-9]+)")


@dataclass(frozen=True, order=True)
class AdapterVersion:
    """One immutable published version of one adapter. `name` is what engines load it as."""

    adapter_id: str
    version: int

    def __post_init__(self) -> None:
        safe_name(self.adapter_id, "adapter_id")
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"version must be an integer >= 0, got {self.version!r}")

    @property
    def name(self) -> str:
        return f"{self.adapter_id}@{self.version}"

    @property
    def key(self) -> tuple[str, int]:
        """The (adapter_id, version) key the embedded sampler's VersionStore uses."""
        return (self.adapter_id, self.version)

    @classmethod
    def parse(cls, name: str) -> AdapterVersion:
        match = _VERSION_NAME.fullmatch(name) if isinstance(name, str) else None
        if match is None:
            raise ValueError(
                f"adapter version name must look like '<adapter>@<version>', got {name!r}"
            )
        return cls(match["adapter"], int(match["version"]))

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class BaseModel:
    """Sentinel type: a request that deliberately runs the base model (e.g. reference logprobs)."""

    def __repr__(self) -> str:
        return "BASE"


BASE = BaseModel()
"""Pass as `RolloutRequest.adapter` to run the base model on purpose."""

Target = AdapterVersion | BaseModel


@dataclass(frozen=True)
class RolloutParams:
    """Sampling parameters every engine honours the same way.

    `stop_token_ids`: None = stop at the model's EOS; [] = never stop early; a list = stop on
    exactly those ids (EOS then not implied). Log-probs returned are raw (temperature 1,
    before top-k/top-p), as in lorafleet.sample and vLLM's default.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass(frozen=True)
class RolloutRequest:
    """One prompt (token ids, never text: tokenization must not differ between trainer and
    engine) and the adapter version it must run, named explicitly."""

    prompt: Sequence[int]
    adapter: Target
    params: RolloutParams = field(default_factory=RolloutParams)
    prompt_logprobs: bool = False
    # whose prompt it is: engines with a prefix cache keep it to requests of the same salt
    # (vLLM's `cache_salt`); "" shares it with every unsalted request
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.adapter, AdapterVersion | BaseModel):
            raise ValueError(
                f"adapter must be an AdapterVersion, or BASE to run the base model on purpose; got {self.adapter!r}"
            )
        prompt = [int(t) for t in self.prompt]
        if not prompt:
            raise ValueError("prompt must hold at least one token id")
        if min(prompt) < 0:
            raise ValueError(f"prompt token ids must be >= 0, got {min(prompt)}")
        object.__setattr__(self, "prompt", prompt)


@dataclass
class RolloutResult:
    """What came back for one request.

    `served_by` is the adapter the engine itself says it used (vLLM's `model` field, SGLang's
    `weight_version` for merged weights, our sampler's version key), or None where its API does
    not say; the engines refuse a reply whose `served_by` contradicts the request.
    """

    tokens: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    adapter: Target
    served_by: str | None
    prompt_logprobs: list[float | None] | None = None


@dataclass
class AdapterUpdate:
    """A trainer slot about to become `version` on an engine.

    It refers to the trainer's bank rather than copying it: a sync runs between optimizer
    steps, and each delivery path takes exactly what it needs (a bank-to-bank copy, a PEFT
    export, fp32 A/B for merging or shipping) once. `weights()` caches its copy.
    """

    version: AdapterVersion
    bank: AdapterBank  # the trainer's (a BankSet, or a sharded trainer's mirror of one)
    slot: int
    base_model_id: str
    _weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.bank.check_slot(self.slot)

    @property
    def spec(self) -> AdapterSpec:
        return self.bank.check_slot(self.slot).spec

    @property
    def targets(self) -> tuple[str, ...]:
        return self.bank.check_slot(self.slot).targets

    def weights(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """module path -> (A[rank, in], B[out, rank]) fp32 CPU copies."""
        if self._weights is None:
            self._weights = {
                path: (A.cpu(), B.cpu())
                for path, (A, B) in self.bank.slot_weights(self.slot).items()
            }
        return self._weights

    def peft_config(self) -> dict[str, Any]:
        return peft_config(self.spec, list(self.targets), self.base_model_id)

    def is_zero(self) -> bool:
        """True when the LoRA delta is exactly zero (a fresh adapter: B = 0)."""
        return layers_are_zero(self.weights().values())


class InFlight:
    """Counts in-flight requests per served name, runs deferred unloads when a name goes idle,
    and gives merged-weight pushes exclusive access (no request runs across a weight swap).

    Only requests sent through this client are known: other clients of the same engine are
    not, which is why each engine should have one owner.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count: Counter[str] = Counter()
        self._pending: dict[str, Callable[[], None]] = {}
        self._exclusive = False

    @contextlib.contextmanager
    def track(self, names: Iterable[str]) -> Iterator[None]:
        names = list(names)
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._count.update(names)
        try:
            yield
        finally:
            ready: list[Callable[[], None]] = []
            with self._cond:
                self._count.subtract(names)
                for name in set(names):
                    if self._count[name] <= 0:
                        del self._count[name]
                        if name in self._pending:
                            ready.append(self._pending.pop(name))
                self._cond.notify_all()
            for action in ready:
                action()

    def count(self, name: str) -> int:
        with self._cond:
            return self._count[name]

    def when_idle(self, name: str, action: Callable[[], None]) -> bool:
        """Runs `action` now if nothing is in flight on `name` (returns True), else once the
        last in-flight request on it finishes (returns False)."""
        with self._cond:
            if self._count[name] > 0:
                self._pending[name] = action
                return False
        action()
        return True

    def pending(self) -> list[str]:
        with self._cond:
            return sorted(self._pending)

    @contextlib.contextmanager
    def exclusive(self, timeout: float | None = None) -> Iterator[None]:
        """Blocks new requests and waits for the running ones to finish."""
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            if not self._cond.wait_for(lambda: sum(self._count.values()) == 0, timeout=timeout):
                self._exclusive = False
                self._cond.notify_all()
                raise SyncError(
                    f"requests still in flight after {timeout} s; not swapping weights under them"
                )
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class RolloutEngine(Protocol):
    """A sampler that serves versioned adapters and can be synced three ways.

    The hot-swap contract (driven by `AdapterSyncer`): `load` makes a new version servable
    under its own name without touching the current one; the canary runs against it by name;
    `activate` switches new requests to it; `retire` unloads the old one once its in-flight
    requests are done (at once if there are none). `withdraw` removes a version that failed
    verification. Merged-weight engines hold one version at a time: their `load` replaces the
    served weights after in-flight requests finish.
    """

    kind: str
    modes: frozenset[SyncMode]

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def canary_tolerance(self) -> float: ...

    def generate(self, requests: Sequence[RolloutRequest]) -> list[RolloutResult]: ...

    def load(self, update: AdapterUpdate, mode: SyncMode) -> None: ...

    def activate(self, version: AdapterVersion) -> AdapterVersion | None: ...

    def current(self, adapter_id: str) -> AdapterVersion | None: ...

    def retire(self, version: AdapterVersion) -> None: ...

    def withdraw(self, version: AdapterVersion) -> None: ...

    def release_memory(self, level: OffloadLevel) -> None: ...

    def resume_memory(self, level: OffloadLevel) -> None: ...

    def close(self) -> None: ...


def check_mode(engine_kind: str, modes: frozenset[SyncMode], mode: SyncMode | str) -> SyncMode:
    mode = SyncMode.parse(mode)
    if mode not in modes:
        raise UnsupportedSyncModeError(
            f"the {engine_kind} engine cannot sync by {mode.value!r}; it supports {sorted(m.value for m in modes)}"
        )
    return mode


def served_name(target: Target, base_name: str) -> str:
    return target.name if isinstance(target, AdapterVersion) else base_name
