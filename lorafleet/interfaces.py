"""The seams between the server (and the RL job) and the engines, as protocols.

The server reaches its engines only through these names, whatever runs them:
- colocated: `TrainEngine`, `SampleEngine` and `VersionStore` over one frozen base in this
  process (`lorafleet.engines.colocate`);
- torchrun/FSDP2: `DistTrainEngine` driving sharded trainer ranks, with the sampler in process;
- Ray: `DistTrainEngine` over trainer-rank actors, `RaySamplerPool` over sampler replicas and its
  `RayVersionStore`.
`lorafleet.engines.build_engines` picks one and returns an `EngineSet`.

What an engine can and cannot do is part of its seam, required of every implementation, so the
server reads it the same way whatever runs and never probes for it (no runtime-checkable
protocol, no `isinstance` on one, no engine's name above the seam): a `Sampler` declares its
`features` and reports its `health`, `rollout_stats` and `prefix_cache_stats`; a `VersionStore`
its `paging` and what it `verified` itself; a `Trainer` its `pager` (None: hard slots).

This module imports types only (under TYPE_CHECKING), so that any layer, however low, may name
a seam without importing what implements it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from concurrent.futures import Future
    from pathlib import Path

    import torch

    from lorafleet.adapters.checkpoint import TrainingState
    from lorafleet.adapters.hparams import OptimHParams
    from lorafleet.canary import CanaryReport
    from lorafleet.fsio import PathLike
    from lorafleet.model.banks import AdapterSpec, SlotInfo
    from lorafleet.sample.prefix_cache import PrefixCacheStats
    from lorafleet.sample.reports import RolloutStats, SamplerFeatures, SamplerHealth
    from lorafleet.sample.types import SampleRequest, SampleResult, VersionKey
    from lorafleet.sample.validate import ModelLimits
    from lorafleet.train.engine import BatchOutput
    from lorafleet.train.items import PreparedItem, TrainItem
    from lorafleet.train.slot_state import SlotState

__all__ = [
    "AdapterBank",
    "Closeable",
    "EngineSet",
    "Sampler",
    "SlotPager",
    "SlotRows",
    "Trainer",
    "VersionRecord",
    "VersionStore",
]


class SlotRows(Protocol):
    """`bank.params[slot]`: one slot's flat parameter row (a tensor, or fetched on demand)."""

    def __getitem__(self, slot: int, /) -> torch.Tensor: ...


class AdapterBank(Protocol):
    """A trainer's adapter slots as exporters, publishing and the canary read them: the slot
    table, and each slot's weights (a `BankSet`, or a sharded trainer's `RemoteBank` mirror)."""

    @property
    def name(self) -> str: ...

    @property
    def num_slots(self) -> int: ...

    @property
    def r_max(self) -> int: ...

    @property
    def row_size(self) -> int: ...

    @property
    def slots(self) -> Sequence[SlotInfo | None]: ...

    @property
    def layers(self) -> Mapping[str, object]: ...

    @property
    def scales(self) -> torch.Tensor: ...

    @property
    def params(self) -> SlotRows: ...

    def free_slots(self) -> list[int]: ...

    def used_slots(self) -> list[int]: ...

    def check_slot(self, slot: int) -> SlotInfo: ...

    def slot_weights(self, slot: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]: ...

    def layout(self) -> list[tuple[str, tuple[int, int], tuple[int, int]]]: ...


class Trainer(Protocol):
    """Mixed-adapter training: what the server's executor, sync/ and the canary call.

    Items are validated by `prepare` before anything runs (so one bad request fails alone);
    `forward` also accepts slot 0, the base model."""

    @property
    def bank(self) -> AdapterBank: ...

    @property
    def base_model_id(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_length(self) -> int | None: ...

    @property
    def pager(self) -> SlotPager | None:
        """This trainer's slots as a cache (`SlotPager`), or None where it keeps hard slots (the
        sharded trainers): the server then holds a run per slot and refuses one past them."""
        ...

    def create_adapter(
        self, spec: AdapterSpec, slot: int | None = None, *, optimizer: str = "adamw"
    ) -> int:
        """`optimizer`: the adapter's optimizer family for life (`adapters.hparams.OPTIMIZERS`)."""
        ...

    def free_adapter(self, slot: int) -> None: ...

    def prepare(
        self, items: Sequence[TrainItem], *, allow_base: bool = False
    ) -> list[PreparedItem]: ...

    def forward(self, items: Sequence[TrainItem] | Sequence[PreparedItem]) -> BatchOutput: ...

    def canary_logprobs(self, slot: int | None, tokens: Sequence[int]) -> torch.Tensor:
        """The trainer's side of the canary (`lorafleet.train.canary_probe`); None = base."""
        ...

    def forward_backward(
        self, items: Sequence[TrainItem] | Sequence[PreparedItem]
    ) -> BatchOutput: ...

    def optim_step(self, hparams: Mapping[int, OptimHParams]) -> dict[int, dict[str, float]]: ...

    def save_state(
        self,
        slot: int,
        dest: str | Path,
        *,
        metadata: dict | None = None,
        overwrite: bool = False,
    ) -> Path: ...

    def load_state(
        self,
        src: str | Path | TrainingState,
        *,
        slot: int | None = None,
        with_optimizer: bool = True,
        source: str | Path | None = None,
        optimizer: str | None = None,
    ) -> int: ...

    def export_peft(self, slot: int, dest: str | Path, *, overwrite: bool = False) -> Path: ...

    def import_peft(self, src: str | Path, *, slot: int | None = None, seed: int = 0) -> int: ...


class SlotPager(Protocol):
    """A trainer whose slots are a cache (`Trainer.pager`): a run's whole state (weights,
    optimizer moments and step, hyper-parameters, a pending gradient) leaves its slot and comes
    back bit for bit. The colocated `TrainEngine` is one."""

    def export_slot(self, slot: int) -> SlotState: ...

    def import_slot(self, state: SlotState, slot: int | None = None) -> int: ...

    def write_slot(self, state: SlotState, dest: str | Path) -> int: ...

    def read_slot(self, src: str | Path) -> SlotState: ...


class VersionRecord(Protocol):
    """What a version store knows of one published version."""

    @property
    def key(self) -> VersionKey: ...

    @property
    def path(self) -> Path | None: ...  # its saved files, if any (the source after eviction)


class VersionStore(Protocol):
    """Immutable published adapter versions, `(adapter_id, version)`, that samplers serve."""

    def info(self, key: VersionKey) -> VersionRecord: ...

    def latest(self, adapter_id: str) -> VersionKey: ...

    def resident(self) -> list[VersionKey]: ...

    def retiring(self) -> list[VersionKey]:
        """Versions retired while running sequences still use them (dropped after the last)."""
        ...

    def publish(
        self,
        adapter_id: str,
        source: AdapterBank,
        source_slot: int,
        *,
        version: int | None = None,
        path: PathLike | None = None,
    ) -> VersionKey: ...

    def register(self, adapter_id: str, version: int, path: PathLike) -> VersionKey: ...

    def set_path(self, key: VersionKey, path: PathLike) -> None: ...

    def evict(self, key: VersionKey) -> None: ...

    def drop(self, key: VersionKey) -> None: ...

    def retire(self, key: VersionKey) -> bool:
        """Drops `key` once no running sequence uses it (True: at once); refuses new use now."""
        ...

    def paging(self) -> dict[str, object]:
        """How its versions move in and out of the samplers' slots (the server's
        `stats()["paging"]["sampler"]`); the counters differ per store, so a dict."""
        ...

    def verified(self, key: VersionKey) -> CanaryReport[VersionKey] | None:
        """What the canary measured when this store checked `key` itself while publishing it
        (on every replica, the trainer's side once), so the publisher does not check it a
        second time; None when it did not (the in-process store: the publisher checks)."""
        ...


class Sampler(Protocol):
    """Generation over published versions (and the base, adapter None).

    `submit` queues requests into the running batch and `step` advances it (the server's worker
    interleaves steps with training); `generate` runs requests to completion. A sampler whose
    batches run elsewhere (Ray replicas) completes them inside `submit`, and `step` then has
    nothing to do.

    Every sampler also reports itself (`features`, `health`, `rollout_stats`,
    `prefix_cache_stats`, `lorafleet.sample.reports`): the server reads these the same way
    whatever samples, with no default of its own. They are read on the server's event loop and
    stats threads, so they answer from what the sampler already knows (its replicas' last
    liveness checks), never waiting on a replica."""

    @property
    def versions(self) -> VersionStore: ...

    @property
    def features(self) -> SamplerFeatures:
        """The request features it honours (the OpenAI routes refuse the others up front)."""
        ...

    def health(self) -> SamplerHealth:
        """ "ok", "degraded" (some replicas out of rotation) or "unavailable" (none serves);
        /healthz's `rollout`."""
        ...

    def rollout_stats(self) -> RolloutStats:
        """Which engine samples and each replica's state, versions, last canary, restarts and
        error: the operator's view (`stats()["rollout"]`, the console)."""
        ...

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Its prefix cache (summed over replicas); None where it keeps none that it can read."""
        ...

    @property
    def limits(self) -> ModelLimits: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def submit(self, requests: Sequence[SampleRequest]) -> list[Future[SampleResult]]: ...

    def step(self) -> bool: ...

    def generate(self, requests: Sequence[SampleRequest]) -> list[SampleResult]: ...

    def probe_logprobs(self, key: VersionKey | None, tokens: Sequence[int]) -> torch.Tensor:
        """Log-probs of tokens[1:] under `key` (None = base) at once, beside the running batch
        (the canary's side, `lorafleet.sample.canary_probe`)."""
        ...

    def release_cache(self) -> None: ...


class Closeable(Protocol):
    """Something an engine set started (trainer ranks, replica actors) and must stop."""

    def close(self) -> None: ...


@dataclass
class EngineSet:
    """The engines one server drives: a trainer, a sampler, and what must be stopped at the end.

    `owned` lists what the set started, in the order it is stopped (empty when everything lives
    in this process and goes with it)."""

    trainer: Trainer
    sampler: Sampler
    owned: tuple[Closeable, ...] = ()

    @property
    def versions(self) -> VersionStore:
        return self.sampler.versions

    def close(self) -> None:
        """Stops every owned part, in order, even when an earlier one fails (its error is raised
        after the others were stopped)."""
        with contextlib.ExitStack() as stack:
            for part in reversed(self.owned):
                stack.callback(part.close)
