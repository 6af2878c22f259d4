"""What every sampler reports about itself through the `Sampler` seam (lorafleet/interfaces.py):
which request features it honours, how its replicas are, and its prefix cache.

These are required members of the seam, not optional capabilities probed at run time: the
server reads them the same way whatever samples (the embedded engine in this process, Ray
sampler replicas, vLLM/SGLang replicas), so it never guesses a default nor branches on an
engine's name. They live here, in `sample/`, because every sampler implementation may import
this layer (`interfaces` imports nothing at run time).

The report shapes are fixed: `as_dict()` gives the JSON the console and
`GET /api/v1/lorafleet/stats` read (`stats()["rollout"]`, docs/rollout_engines.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "CanaryRecord",
    "ReplicaState",
    "ReplicaStats",
    "RolloutStats",
    "SamplerFeatures",
    "SamplerHealth",
]

SamplerHealth = Literal["ok", "degraded", "unavailable"]
""""ok": every replica serves; "degraded": some are out of rotation; "unavailable": none is
(samples cannot run until one comes back; /healthz answers 503)."""

ReplicaState = Literal["healthy", "unhealthy", "starting", "restarting"]


@dataclass(frozen=True)
class SamplerFeatures:
    """What a sampler can honour, declared by the sampler itself. The OpenAI routes refuse what
    it cannot before anything is queued, naming OpenAI's field (the sampler would refuse it too,
    naming the Tinker field the request became)."""

    engine: str  # what samples, for messages only ("the vllm rollout engine")
    stop_strings: bool  # ends samples at strings (else at token ids only)
    top_logprobs: bool  # log-probs of alternatives to each sampled token (else the sampled only)
    token_streaming: bool  # calls a request's `on_token` hook as each token is drawn (else the
    # whole completion arrives at the end, and a streaming route sends it at once)


@dataclass(frozen=True)
class CanaryRecord:
    """The last canary a replica ran: which version, whether it passed, what it measured."""

    version: str  # `<adapter>@<version>`
    ok: bool
    max_abs_diff: float | None  # None when the failure measured no difference
    at: float  # wall-clock time (time.time())

    def as_dict(self) -> dict[str, object]:
        return {
            "version": self.version,
            "ok": self.ok,
            "max_abs_diff": self.max_abs_diff,
            "at": self.at,
        }


@dataclass(frozen=True)
class ReplicaStats:
    """One replica as the operator sees it."""

    name: str
    url: str  # where it runs: an engine's URL, a Ray actor's node and pid, "in-process"
    state: ReplicaState
    versions: tuple[str, ...]  # the versions it holds now, `<adapter>@<version>`
    last_canary: CanaryRecord | None
    restarts: int
    error: str | None  # why it is out of rotation, or the last failure it recovered from
    # a Ray replica's node (node_id, node_ip, pid); None for replicas that are not Ray actors
    node: Mapping[str, object] | None = None

    def as_dict(self) -> dict[str, object]:
        shown: dict[str, object] = {
            "name": self.name,
            "url": self.url,
            "state": self.state,
            "versions": list(self.versions),
            "last_canary": None if self.last_canary is None else self.last_canary.as_dict(),
            "restarts": self.restarts,
            "error": self.error,
        }
        if self.node is not None:
            shown["node"] = dict(self.node)
        return shown


@dataclass(frozen=True)
class RolloutStats:
    """Which engine samples, how versions reach it, and each of its replicas."""

    engine: str
    sync: str  # lorafleet.sync.base.SyncMode's value: "tensor", "files" or "merged"
    replicas: tuple[ReplicaStats, ...]

    def health(self) -> SamplerHealth:
        return health_of(r.state for r in self.replicas)

    def as_dict(self) -> dict[str, object]:
        return {
            "engine": self.engine,
            "sync": self.sync,
            "replicas": [r.as_dict() for r in self.replicas],
        }


def health_of(states: Iterable[ReplicaState]) -> SamplerHealth:
    """ "ok" when every replica is healthy, "degraded" when some are, "unavailable" when none."""
    listed = list(states)
    healthy = sum(state == "healthy" for state in listed)
    if listed and healthy == len(listed):
        return "ok"
    return "degraded" if healthy else "unavailable"
