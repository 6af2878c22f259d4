"""What the HTTP engines (vLLM, SGLang) share: versions, hot swap, in-flight tracking,
staging, merged pushes from a pristine base, offload. Subclasses only speak their API.

State kept per engine client:
- LoRA versions loaded on the engine under their versioned names, and the current one per
  adapter (what `AdapterSyncer` activated);
- what the engine's *weights* are: the pristine base, a merged version, or "unknown" (a merged
  push that failed or was withdrawn without a base to restore). In "unknown" every request
  is refused: nothing is served from weights nobody verified.

A request for a version is always sent under that version's own name (a LoRA name, or, for
a merged version, only while exactly that version is in the weights). A version the engine
never loaded is still sent by name, so the engine itself refuses it: the client never turns
"not loaded" into "run the base model".
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final, Literal

import torch

from lorafleet.canary import tolerance_for
from lorafleet.sync.base import (
    AdapterUpdate,
    AdapterVersion,
    BaseModel,
    EngineHTTPError,
    InFlight,
    OffloadLevel,
    RolloutEngineError,
    RolloutRequest,
    RolloutResult,
    SyncError,
    SyncMode,
    check_mode,
)
from lorafleet.sync.files import Staging, stage_peft
from lorafleet.sync.httpclient import DEFAULT_TIMEOUT_S, JsonClient
from lorafleet.sync.merged import PristineBase, merged_name

__all__ = ["HttpEngine", "RequestPlan"]

_UNKNOWN: Final = "unknown"
WeightsState = Literal["base", "unknown"] | AdapterVersion


class RequestPlan:
    """How one request is addressed: as a LoRA name, as the merged version, or as the base."""

    def __init__(self, kind: Literal["lora", "merged", "base"], name: str | None):
        self.kind = kind
        self.name = name


class HttpEngine:
    kind = "http"
    modes: frozenset[SyncMode] = frozenset()
    # How MoE expert LoRA is written for this engine's loader: per-expert 2-D keys, which is
    # what vLLM and SGLang read for Qwen3-MoE / Mixtral (they refuse PEFT's fused 3-D form).
    expert_layout = "checkpoint"

    def __init__(
        self,
        base_url: str,
        *,
        dtype: torch.dtype,
        model_name: str,
        api_key: str | None = None,
        staging: Staging | None = None,
        base_path: str | None = None,
        pristine: PristineBase | None = None,
        tolerance: float | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_concurrency: int = 16,
        swap_timeout: float | None = 600.0,
    ):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"dtype must be the engine's torch dtype (float32, bfloat16, float16), got {dtype!r}"
            )
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(
                f"model_name must be the engine's served base model name, got {model_name!r}"
            )
        if base_path is not None and (
            not isinstance(base_path, str) or not base_path.startswith("/")
        ):
            raise ValueError(
                f"base_path must be an absolute path on the engine's host, got {base_path!r}"
            )
        if pristine is not None and pristine.dtype != dtype:
            raise ValueError(
                f"the pristine base writes {pristine.dtype}, but the engine runs {dtype}"
            )
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.client = JsonClient(
            base_url, api_key=api_key, timeout=timeout, what=f"{self.kind} engine"
        )
        self.base_url = self.client.base_url
        self._dtype = dtype
        self.model_name = model_name
        self.staging = staging
        self.base_path = base_path
        self.pristine = pristine
        self._tolerance = tolerance
        self.swap_timeout = swap_timeout
        self._current: dict[str, AdapterVersion] = {}
        self._loaded: set[AdapterVersion] = set()
        self._staged: dict[AdapterVersion, str] = {}  # version -> staging name
        self._weights: WeightsState = "base"
        self._weights_path: str | None = base_path  # engine-side path of what the weights are
        self._inflight = InFlight()
        self._lock = threading.RLock()
        self._pool = ThreadPoolExecutor(
            max_workers=max_concurrency, thread_name_prefix=f"{self.kind}-requests"
        )
        self.weight_pushes = (
            0  # full-weight pushes (merged syncs, base re-sends after level-2 wake)
        )

    # ------------------------------------------------------------------ properties
    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def canary_tolerance(self) -> float:
        return self._tolerance if self._tolerance is not None else tolerance_for(self._dtype)

    @property
    def weights(self) -> WeightsState:
        return self._weights

    def loaded(self) -> set[AdapterVersion]:
        with self._lock:
            return set(self._loaded)

    # ------------------------------------------------------------------ rollouts
    def plan(self, request: RolloutRequest) -> RequestPlan:
        with self._lock:
            if self._weights == _UNKNOWN:
                raise RolloutEngineError(
                    f"{self.kind} engine at {self.base_url}: its weights are unverified after a failed merged sync; "
                    "refusing to serve until the next successful sync"
                )
            target = request.adapter
            if isinstance(target, BaseModel):
                if isinstance(self._weights, AdapterVersion):
                    raise RolloutEngineError(
                        f"{self.kind} engine at {self.base_url} holds merged weights of {self._weights.name}, not the base model"
                    )
                return RequestPlan("base", None)
            if target == self._weights:
                return RequestPlan("merged", target.name)
            return RequestPlan("lora", target.name)

    def generate(self, requests: Sequence[RolloutRequest]) -> list[RolloutResult]:
        requests = list(requests)
        plans = [self.plan(r) for r in requests]
        names = [p.name for p in plans if p.name is not None]
        with self._inflight.track(names):
            # Plans were made before the requests were counted; a merged push in between would
            # have waited for in-flight requests, so re-check that nothing moved under them.
            if [self.plan(r).kind for r in requests] != [p.kind for p in plans]:
                raise RolloutEngineError(
                    f"{self.kind} engine: its weights changed while the requests were being sent; retry"
                )
            if len(requests) == 1:
                return [self._send(requests[0], plans[0])]
            return list(self._pool.map(self._send, requests, plans))

    def _send(self, request: RolloutRequest, plan: RequestPlan) -> RolloutResult:
        raise NotImplementedError

    # ------------------------------------------------------------------ sync
    def load(self, update: AdapterUpdate, mode: SyncMode | str) -> None:
        mode = check_mode(self.kind, self.modes, mode)
        version = update.version
        with self._lock:
            if version in self._loaded or version in self._staged:
                raise SyncError(
                    f"{self.kind} engine: {version.name} is already loaded; versions are immutable"
                )
        if mode is SyncMode.MERGED:
            self._load_merged(update)
            return
        if mode is SyncMode.TENSOR:
            self._load_lora_tensors(update)
        else:
            if self.staging is None:
                raise SyncError(
                    f"{self.kind} engine: files sync needs a staging target (LocalStaging or RemoteStaging)"
                )
            path = stage_peft(self.staging, update, expert_layout=self.expert_layout)
            with self._lock:
                self._staged[version] = version.name
            try:
                self._load_lora_path(version.name, path)
            except BaseException:
                self._remove_staged(version)
                raise
        with self._lock:
            self._loaded.add(version)

    def load_staged(self, version: AdapterVersion, path: str) -> None:
        """Loads `version` from a PEFT dir someone else staged (engine-side `path`): a replica
        pool stages each version once for all its replicas, and removes the files itself
        (`withdraw` unloads the name and leaves them)."""
        with self._lock:
            if version in self._loaded or version in self._staged:
                raise SyncError(
                    f"{self.kind} engine: {version.name} is already loaded; versions are immutable"
                )
        self._load_lora_path(version.name, path)
        with self._lock:
            self._loaded.add(version)

    def _load_merged(self, update: AdapterUpdate) -> None:
        pristine, staging = self.pristine, self.staging
        if pristine is None or staging is None:
            raise SyncError(
                f"{self.kind} engine: merged sync needs a PristineBase and a staging target"
            )
        version = update.version
        name = merged_name(version.name)
        path = staging.stage(name, lambda dest: pristine.write(update, dest))
        with self._lock:
            self._staged[version] = name
        try:
            with self._inflight.exclusive(self.swap_timeout):
                with self._lock:
                    self._weights = (
                        _UNKNOWN  # from the first byte pushed until the push is complete
                    )
                self._push_weights(path, version)
                with self._lock:
                    self._weights = version
                    self._weights_path = path
                    self.weight_pushes += 1
        except BaseException:
            self._remove_staged(version)
            raise

    def activate(self, version: AdapterVersion) -> AdapterVersion | None:
        with self._lock:
            previous = self._current.get(version.adapter_id)
            self._current[version.adapter_id] = version
            return previous

    def current(self, adapter_id: str) -> AdapterVersion | None:
        with self._lock:
            return self._current.get(adapter_id)

    def retire(self, version: AdapterVersion) -> None:
        """Unloads `version` once its in-flight requests (through this client) are done."""
        with self._lock:
            is_lora = version in self._loaded
        if is_lora:
            self._inflight.when_idle(version.name, lambda: self._unload(version))
        else:  # a merged version already replaced in the weights: only its files remain
            self._remove_staged(version)

    def withdraw(self, version: AdapterVersion) -> None:
        """Removes a version that failed verification; merged weights go back to the base."""
        with self._lock:
            if self._current.get(version.adapter_id) == version:
                del self._current[version.adapter_id]
            merged = self._weights == version or (
                self._weights == _UNKNOWN
                and version in self._staged
                and version not in self._loaded
            )
        if merged:
            self._restore_base()
        else:
            self._unload(version, missing_ok=True)
        self._remove_staged(version)

    def _restore_base(self) -> None:
        if self.base_path is None:
            with self._lock:
                self._weights = _UNKNOWN
            return
        with self._inflight.exclusive(self.swap_timeout):
            with self._lock:
                self._weights = _UNKNOWN
            self._push_weights(self.base_path, None)
            with self._lock:
                self._weights = "base"
                self._weights_path = self.base_path
                self.weight_pushes += 1

    def _unload(self, version: AdapterVersion, *, missing_ok: bool = False) -> None:
        try:
            self._unload_lora(version.name)
        except EngineHTTPError as exc:
            if not (missing_ok and exc.status in (400, 404)):
                raise
        with self._lock:
            self._loaded.discard(version)
        self._remove_staged(version)

    def _remove_staged(self, version: AdapterVersion) -> None:
        with self._lock:
            name = self._staged.pop(version, None)
        if name is not None and self.staging is not None:
            self.staging.remove(name)

    # ------------------------------------------------------------------ offload
    def release_memory(self, level: OffloadLevel) -> None:
        level = OffloadLevel.parse(level)
        if level is OffloadLevel.KEEP:
            return
        with self._inflight.exclusive(self.swap_timeout):
            self._sleep(level)

    def resume_memory(self, level: OffloadLevel) -> None:
        """Wakes the engine; after level 2 the weights it held are re-sent (base or merged)."""
        level = OffloadLevel.parse(level)
        if level is OffloadLevel.KEEP:
            return
        self._wake(level)
        if level is OffloadLevel.WEIGHTS:
            with self._lock:
                path, state = self._weights_path, self._weights
            if path is None or state == _UNKNOWN:
                raise SyncError(
                    f"{self.kind} engine: woke from level 2 but has no weights to re-send "
                    "(pass base_path=<the base checkpoint on the engine host>)"
                )
            with self._inflight.exclusive(self.swap_timeout):
                self._push_weights(path, state if isinstance(state, AdapterVersion) else None)
                with self._lock:
                    self.weight_pushes += 1

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.client.close()

    # ------------------------------------------------------------------ API hooks
    def _load_lora_path(self, name: str, path: str) -> None:
        raise NotImplementedError

    def _load_lora_tensors(self, update: AdapterUpdate) -> None:
        raise NotImplementedError

    def _unload_lora(self, name: str) -> None:
        raise NotImplementedError

    def _push_weights(self, path: str, version: AdapterVersion | None) -> None:
        """Replaces the engine's full weights with the checkpoint at `path` (engine-side) and
        drops every cache derived from the old weights (prefix/radix cache)."""
        raise NotImplementedError

    def _sleep(self, level: OffloadLevel) -> None:
        raise NotImplementedError

    def _wake(self, level: OffloadLevel) -> None:
        raise NotImplementedError
