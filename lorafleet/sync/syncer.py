"""Trainer slot -> rollout engine, one verified version at a time.

`AdapterSyncer.sync(adapter_id, slot)` is the whole protocol:
1. `engine.load(update, mode)`: the new version becomes servable under `<adapter>@<version>`
   (LoRA modes) or replaces the weights (merged, after in-flight requests finish);
2. the canary (`lorafleet.canary`) runs against that version *by name*; on failure the version is
   withdrawn (unloaded; merged weights go back to the base) and SyncVerificationError raised;
3. `engine.activate(version)` switches new requests to it; the previous version is retired:
   unloaded once its in-flight requests are done. Requests never see a moment without an
   adapter: the old version is served until the switch and stays loaded until it is idle.

At construction the engine's base model is checked against the trainer's (same canary):
an engine running another base (a different checkpoint, revision or dtype) would fail every
sync with a confusing message later. For merged mode this is also where the engine's base
log-probs are captured, before any merged push overwrites its weights.

Offload levels for colocated runs (`release(level)` between rollout and training, `resume()`
before the next rollout or sync) say what the rollout engine gives back while training runs:
- 0 (KEEP): nothing moves; the next sync sends only the new adapter.
- 1 (KV_CACHE): the engine releases its KV cache (vLLM `/sleep?level=1`, SGLang
  `release_memory_occupation` of `kv_cache`, our sampler `release_cache()`); its weights stay
  resident, so with LoRA only the adapter moves on the next sync.
- 2 (WEIGHTS): the engine also releases its weights; on wake they are re-sent (the pristine
  base for LoRA modes, the current merged checkpoint for merged mode) before anything else.
Waking re-verifies what the engine serves: after `resume()`, every current version passes the
canary again against the log-probs recorded when it was synced, so memory that came back wrong
(a base that was not re-sent, an adapter slot lost across sleep) fails loudly before the next
rollout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass

import torch

from lorafleet.canary import CanaryReport, canary_tokens, check_tokens, compare, compare_base
from lorafleet.interfaces import Trainer
from lorafleet.sync.base import (
    BASE,
    AdapterUpdate,
    AdapterVersion,
    OffloadLevel,
    RolloutEngine,
    SyncMode,
    check_mode,
)
from lorafleet.sync.verify import engine_logprobs

__all__ = ["AdapterSyncer", "SyncReport"]


@dataclass(frozen=True)
class SyncReport:
    version: AdapterVersion
    mode: SyncMode
    deliver_s: float  # staging/transfer/load (or merge + push)
    # the engine's canary, and what is left of the trainer reference (it overlaps delivery)
    verify_s: float
    total_s: float
    canary: CanaryReport[AdapterVersion]
    retired: AdapterVersion | None


@dataclass
class _Record:
    """What a current version must keep matching: the trainer's log-probs when it was synced."""

    expected: torch.Tensor
    zero: bool  # the adapter was exactly zero (the "differs from base" rule does not apply)


class AdapterSyncer:
    """Syncs trainer slots to one engine by one mode, verifying every version it delivers."""

    def __init__(
        self,
        engine: RolloutEngine,
        trainer: Trainer,
        *,
        mode: SyncMode | str,
        tokens: Sequence[int] | None = None,
        tolerance: float | None = None,
        check_base: bool = True,
    ):
        self.engine = engine
        self.trainer = trainer
        self.mode = check_mode(engine.kind, engine.modes, mode)
        self.tokens = check_tokens(
            tokens if tokens is not None else canary_tokens(trainer.vocab_size)
        )
        self.tolerance = float(tolerance) if tolerance is not None else engine.canary_tolerance
        self._latest: dict[str, int] = {}
        self._records: dict[AdapterVersion, _Record] = {}
        self._lock = threading.RLock()
        self.offloaded = OffloadLevel.KEEP
        self._pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sync-reference")
        self.engine_base, _ = engine_logprobs(engine, BASE, self.tokens)
        if check_base:
            compare_base(
                self.engine_base,
                trainer.canary_logprobs(None, self.tokens),
                tolerance=self.tolerance,
                engine=engine.kind,
            )

    def next_version(self, adapter_id: str) -> int:
        with self._lock:
            return self._latest.get(adapter_id, -1) + 1

    def sync(self, adapter_id: str, trainer_slot: int, *, version: int | None = None) -> SyncReport:
        """Delivers trainer slot `trainer_slot` as the next (or given) version of `adapter_id`."""
        with self._lock:
            if self.offloaded is not OffloadLevel.KEEP:
                raise RuntimeError(
                    f"the engine is offloaded (level {int(self.offloaded)}); call resume() before syncing"
                )
            number = self.next_version(adapter_id) if version is None else version
            update = AdapterUpdate(
                AdapterVersion(adapter_id, number),
                self.trainer.bank,
                trainer_slot,
                self.trainer.base_model_id,
            )
            started = time.perf_counter()
            # The trainer's reference log-probs are computed while the engine takes and runs
            # the new version (another process for HTTP engines, another thread here): the
            # trainer slot does not change during a sync, and routing scopes are per thread.
            reference = self._pool.submit(self.trainer.canary_logprobs, trainer_slot, self.tokens)
            try:
                self.engine.load(update, self.mode)
            except BaseException:
                reference.cancel()
                futures.wait([reference])
                raise
            delivered = time.perf_counter()
            try:
                values, served_by = engine_logprobs(self.engine, update.version, self.tokens)
                record = _Record(reference.result(), update.is_zero())
                report = self._compare(update.version, record, values, served_by)
            except BaseException:
                futures.wait([reference])
                self.engine.withdraw(update.version)
                raise
            previous = self.engine.activate(update.version)
            if previous is not None and previous != update.version:
                self.engine.retire(previous)
                self._records.pop(previous, None)
            self._records[update.version] = record
            self._latest[adapter_id] = max(number, self._latest.get(adapter_id, -1))
            finished = time.perf_counter()
            return SyncReport(
                version=update.version,
                mode=self.mode,
                deliver_s=delivered - started,
                verify_s=finished - delivered,
                total_s=finished - started,
                canary=report,
                retired=previous if previous != update.version else None,
            )

    def _check(self, version: AdapterVersion, record: _Record) -> CanaryReport[AdapterVersion]:
        values, served_by = engine_logprobs(self.engine, version, self.tokens)
        return self._compare(version, record, values, served_by)

    def _compare(
        self, version: AdapterVersion, record: _Record, values: torch.Tensor, served_by: str | None
    ) -> CanaryReport[AdapterVersion]:
        return compare(
            version,
            values,
            name=version.name,
            expected=record.expected,
            engine_base=self.engine_base,
            adapter_zero=record.zero,
            tolerance=self.tolerance,
            engine=self.engine.kind,
            served_by=served_by,
        )

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def verify_current(self) -> list[CanaryReport[AdapterVersion]]:
        """Re-runs the canary for every version this syncer made current."""
        with self._lock:
            return [
                self._check(version, record) for version, record in sorted(self._records.items())
            ]

    # ------------------------------------------------------------------ offload
    def release(self, level: OffloadLevel | int) -> None:
        """Between rollout and training: give memory back (levels: module docstring)."""
        level = OffloadLevel.parse(level)
        with self._lock:
            if self.offloaded is not OffloadLevel.KEEP:
                raise RuntimeError(
                    f"the engine is already offloaded at level {int(self.offloaded)}"
                )
            if level is OffloadLevel.KEEP:
                return
            self.engine.release_memory(level)
            self.offloaded = level

    def resume(self) -> list[CanaryReport[AdapterVersion]]:
        """Before the next rollout/sync: take memory back and re-verify what is served."""
        with self._lock:
            if self.offloaded is not OffloadLevel.KEEP:
                self.engine.resume_memory(self.offloaded)
                self.offloaded = OffloadLevel.KEEP
            return self.verify_current()
