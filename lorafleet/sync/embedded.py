"""Our own sampler (lorafleet.sample) as a RolloutEngine.

`tensor` sync is `VersionStore.publish`: one row copy from the trainer's bank into a sampler
slot, in process. `files` sync exports the PEFT directory to local staging, registers it as
the version's source and loads it into a sampler slot at once (so a bad file fails the sync,
not a later rollout). `merged` is refused: the sampler shares its base weights with the
trainer and serves many adapters at once, so there is no single model to merge into.

Offload: the row KV cache is released at level >= 1. The base weights are the trainer's own
tensors (same process, same model), so level 2 has nothing more to give back here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import torch

from lorafleet.canary import tolerance_for
from lorafleet.model.numerics import model_numerics
from lorafleet.sample.engine import SampleEngine
from lorafleet.sample.types import SampleRequest, SamplingParams
from lorafleet.sample.versions import UnknownVersionError, VersionError
from lorafleet.sync.base import (
    AdapterUpdate,
    AdapterVersion,
    InFlight,
    OffloadLevel,
    RolloutEngineError,
    RolloutRequest,
    RolloutResult,
    SyncError,
    SyncMode,
    check_mode,
)
from lorafleet.sync.files import LocalStaging, stage_peft

__all__ = ["EmbeddedEngine"]

BASE_NAME = "base"


class EmbeddedEngine:
    """RolloutEngine over a SampleEngine in this process."""

    kind = "embedded"
    modes = frozenset({SyncMode.TENSOR, SyncMode.FILES})

    def __init__(self, sampler: SampleEngine, *, staging: LocalStaging | None = None):
        self.sampler = sampler
        self.versions = sampler.versions
        self.staging = staging
        self._current: dict[str, AdapterVersion] = {}
        self._staged: set[AdapterVersion] = set()
        self._inflight = InFlight()
        self._lock = threading.Lock()

    @property
    def dtype(self) -> torch.dtype:
        return self.sampler.dtype

    @property
    def canary_tolerance(self) -> float:
        return tolerance_for(
            self.dtype,
            same_implementation=True,
            invariant=model_numerics(self.sampler.adapted.model) == "batch-invariant",
        )

    # ------------------------------------------------------------------ rollouts
    def generate(self, requests: Sequence[RolloutRequest]) -> list[RolloutResult]:
        requests = list(requests)
        sample_requests = [self._convert(r) for r in requests]
        names = [r.adapter.name for r in requests if isinstance(r.adapter, AdapterVersion)]
        with self._inflight.track(names):
            results = self.sampler.generate(sample_requests)
        out: list[RolloutResult] = []
        for index, (request, result) in enumerate(zip(requests, results, strict=True)):
            if result.error is not None:
                raise RolloutEngineError(
                    f"embedded engine, request {index}: {result.error.code}: {result.error.message}"
                )
            seq = result.sequences[0]
            served = BASE_NAME if result.adapter is None else AdapterVersion(*result.adapter).name
            out.append(
                RolloutResult(
                    tokens=list(seq.tokens),
                    logprobs=list(seq.logprobs),
                    finish_reason=seq.stop_reason,
                    adapter=request.adapter,
                    served_by=served if isinstance(request.adapter, AdapterVersion) else None,
                    prompt_logprobs=result.prompt_logprobs,
                )
            )
        return out

    @staticmethod
    def _convert(request: RolloutRequest) -> SampleRequest:
        params = request.params
        stop = None if params.stop_token_ids is None else list(params.stop_token_ids)
        sampling = SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            stop=stop,
            seed=params.seed,
        )
        key = request.adapter.key if isinstance(request.adapter, AdapterVersion) else None
        return SampleRequest(
            list(request.prompt), sampling, adapter=key, prompt_logprobs=request.prompt_logprobs
        )

    # ------------------------------------------------------------------ versions
    def load(self, update: AdapterUpdate, mode: SyncMode | str) -> None:
        mode = check_mode(self.kind, self.modes, mode)
        version = update.version
        if mode is SyncMode.TENSOR:
            try:
                self.versions.publish(
                    version.adapter_id, update.bank, update.slot, version=version.version
                )
            except (VersionError, ValueError) as exc:
                raise SyncError(f"embedded engine: cannot publish {version.name}: {exc}") from exc
            return
        if self.staging is None:
            raise SyncError(
                "embedded engine: files sync needs a staging directory (EmbeddedEngine(staging=LocalStaging(...)))"
            )
        path = stage_peft(self.staging, update)
        self._staged.add(version)
        try:
            key = self.versions.register(version.adapter_id, version.version, path)
            self.versions.acquire(key)  # loads the files into a sampler slot now
            self.versions.release(key)
        except (VersionError, ValueError) as exc:
            self.withdraw(version)
            raise SyncError(
                f"embedded engine: cannot load {version.name} from {path}: {exc}"
            ) from exc

    def activate(self, version: AdapterVersion) -> AdapterVersion | None:
        with self._lock:
            previous = self._current.get(version.adapter_id)
            self._current[version.adapter_id] = version
            return previous

    def current(self, adapter_id: str) -> AdapterVersion | None:
        with self._lock:
            return self._current.get(adapter_id)

    def retire(self, version: AdapterVersion) -> None:
        """Drops the version once no request of this engine is running on it."""
        self._inflight.when_idle(version.name, lambda: self._drop(version))

    def withdraw(self, version: AdapterVersion) -> None:
        with self._lock:
            if self._current.get(version.adapter_id) == version:
                del self._current[version.adapter_id]
        self._drop(version)

    def _drop(self, version: AdapterVersion) -> None:
        with contextlib.suppress(UnknownVersionError):  # never registered (load failed), or dropped
            self.versions.drop(version.key)
        if version in self._staged and self.staging is not None:
            self._staged.discard(version)
            self.staging.remove(version.name)

    # ------------------------------------------------------------------ offload
    def release_memory(self, level: OffloadLevel) -> None:
        if OffloadLevel.parse(level) >= OffloadLevel.KV_CACHE:
            self.sampler.release_cache()

    def resume_memory(self, level: OffloadLevel) -> None:
        OffloadLevel.parse(level)  # the cache is re-allocated by the next generate

    def close(self) -> None:
        for version in list(self._current.values()):
            self.withdraw(version)
