"""Offload levels for colocated runs: what the rollout engine gives back while training runs.

- 0 (KEEP): nothing moves; the next sync sends only the new adapter.
- 1 (KV_CACHE): the engine releases its KV cache (vLLM `/sleep?level=1`, SGLang
  `release_memory_occupation` of `kv_cache`, our sampler `release_cache()`); its weights stay
  resident, so with LoRA only the adapter moves on the next sync.
- 2 (WEIGHTS): the engine also releases its weights; on wake they are re-sent (the pristine
  base for LoRA modes, the current merged checkpoint for merged mode) before anything else.

After every wake the syncer re-runs the canary for each current version against the
log-probs recorded when it was synced: memory that came back wrong (a base that was not
re-sent, an adapter slot lost across sleep) fails loudly before the next rollout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lorafleet.sync.base import OffloadLevel
from lorafleet.sync.verify import CanaryReport

if TYPE_CHECKING:
    from lorafleet.sync.syncer import AdapterSyncer

__all__ = ["release", "resume"]


def release(syncer: AdapterSyncer, level: OffloadLevel | int) -> None:
    level = OffloadLevel.parse(level)
    with syncer._lock:
        if syncer.offloaded is not OffloadLevel.KEEP:
            raise RuntimeError(f"the engine is already offloaded at level {int(syncer.offloaded)}")
        if level is OffloadLevel.KEEP:
            return
        syncer.engine.release_memory(level)
        syncer.offloaded = level


def resume(syncer: AdapterSyncer) -> list[CanaryReport]:
    with syncer._lock:
        level = syncer.offloaded
        if level is not OffloadLevel.KEEP:
            syncer.engine.resume_memory(level)
            syncer.offloaded = OffloadLevel.KEEP
        return syncer.verify_current()
