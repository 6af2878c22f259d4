"""The one factory of a server's engines: colocated, torchrun/FSDP2 or Ray, from config.

`build_engines` returns an `EngineSet` (lorafleet.interfaces) whatever the placement, so the
server calls the same `Trainer`, `Sampler` and `VersionStore` seams:
- colocated (`dist` None): a trainer and a sampler over one frozen base in this process
  (`colocate`);
- torchrun (`dist.trainer_ranks` N, no Ray): N local trainer ranks shard the base with FSDP2;
  the sampler stays in the server process over its own copy of the base;
- Ray (`dist.ray`): N trainer-rank actors and M sampler-replica actors; versions travel through
  the Ray object store.

This module sits above `train/`, `sample/` and `distributed/` (it wires them together), so
none of those needs to import another to be built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from lorafleet.distributed.placement import DistConfig
from lorafleet.interfaces import EngineSet
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.kernels import KernelName
from lorafleet.model.loader import LoadedBase
from lorafleet.sample.engine import DEFAULT_MAX_ROWS, SampleEngine
from lorafleet.sample.versions import VersionStore
from lorafleet.sync.rollout_config import RolloutConfig
from lorafleet.train.engine import DEFAULT_TOKEN_BUDGET, TrainEngine

if TYPE_CHECKING:
    from lorafleet.distributed.protocol import RankSettings
    from lorafleet.distributed.remote import DistTrainEngine

__all__ = [
    "Colocated",
    "DistConfig",
    "EngineConfig",
    "EngineSet",
    "RolloutConfig",
    "build_engines",
    "colocate",
]


@dataclass(frozen=True)
class EngineConfig:
    base_model: str
    dtype: str = "float32"
    max_adapters: int = 8
    sampler_slots: int = 16
    max_lora_rank: int = 32
    lora_alpha: float = 32.0
    max_sample_rows: int = 32
    token_budget: int = DEFAULT_TOKEN_BUDGET
    ephemeral_keep: int = (
        8  # files kept per model for save_weights_and_get_sampling_client; 0 = memory only
    )
    dist: DistConfig | None = None  # sharded trainer ranks / Ray placement; None = one process
    # Host memory for training runs paged out of their slots (the warm tier); past it the least
    # recently used go to disk (lorafleet.server.engine.live_models). Pinned memory on an accelerator.
    warm_bytes: int = 1 << 30
    # which engine samples (lorafleet.sync.rollout_config): None or embedded = the colocated
    # sampler; vLLM/SGLang replicas sample while the colocated trainer stays the source
    rollout: RolloutConfig | None = None
    # KV of prompt prefixes the embedded sampler keeps across requests (sample/prefix_cache.py),
    # per Ray sampler replica likewise; None = its default (a share of the row pool's KV),
    # 0 = off. vLLM/SGLang replicas keep their own.
    prefix_cache_bytes: int | None = None


# --------------------------------------------------------------------------- colocated


@dataclass
class Colocated:
    """A trainer and a sampler over one frozen base model, wired so that publishing works."""

    adapted: AdaptedModel
    trainer: TrainEngine
    versions: VersionStore
    sampler: SampleEngine

    def engines(self) -> EngineSet:
        return EngineSet(trainer=self.trainer, sampler=self.sampler)


def colocate(
    model: nn.Module,
    layer_paths: Sequence[str],
    *,
    base_model_id: str,
    tokenizer: Any | None = None,
    train_slots: int = 8,
    sample_slots: int = 8,
    r_max: int = 16,
    max_rows: int = DEFAULT_MAX_ROWS,
    kernel: KernelName = "auto",
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    prefix_cache_bytes: int | None = None,
) -> Colocated:
    """Wraps `model` once; `train_slots`/`sample_slots` adapters (slot 0, the base, not counted).

    `copy_slot_from` needs both bank sets over the same layers with the same r_max; building
    them here in one place keeps that invariant out of every caller."""
    adapted = AdaptedModel(model, layer_paths, kernel=kernel)
    adapted.add_bank("train", num_slots=train_slots + 1, r_max=r_max)
    sample_bank = adapted.add_bank(
        "sample", num_slots=sample_slots + 1, r_max=r_max, trainable=False
    )
    trainer = TrainEngine(
        adapted, bank="train", base_model_id=base_model_id, token_budget=token_budget
    )
    versions = VersionStore(sample_bank, base_model_id=base_model_id)
    sampler = SampleEngine(
        adapted,
        versions,
        tokenizer=tokenizer,
        max_rows=max_rows,
        prefix_cache_bytes=prefix_cache_bytes,
    )
    return Colocated(adapted=adapted, trainer=trainer, versions=versions, sampler=sampler)


# --------------------------------------------------------------------------- the factory


def build_engines(config: EngineConfig, base: LoadedBase, targets: Sequence[str]) -> EngineSet:
    """The engines for `config` over `base`, with adapters on `targets` (module paths).

    The caller loads the base and resolves the targets: it also needs the base's own modules
    (e.g. to resolve other target sets) before the engines wrap them."""
    if config.rollout is not None and config.rollout.external:
        return _rollout_engines(config, config.rollout, base, targets)
    if config.dist is None:
        return colocate(
            base.model,
            targets,
            base_model_id=base.model_id,
            tokenizer=base.tokenizer,
            train_slots=config.max_adapters,
            sample_slots=config.sampler_slots,
            r_max=config.max_lora_rank,
            max_rows=config.max_sample_rows,
            token_budget=config.token_budget,
            prefix_cache_bytes=config.prefix_cache_bytes,
        ).engines()
    config.dist.validate()
    if config.dist.ray is None:
        return _torchrun_engines(config, config.dist, base, targets)
    return _ray_engines(config, config.dist, base, targets)


def _rollout_engines(
    config: EngineConfig, rollout: RolloutConfig, base: LoadedBase, targets: Sequence[str]
) -> EngineSet:
    """The colocated trainer, with vLLM/SGLang replicas sampling (`sync.pool.RolloutPool`); the
    embedded sampler is kept (one slot) only for its request limits."""
    if config.dist is not None:
        raise ValueError(
            f"--rollout-engine {rollout.engine} runs with the colocated trainer only, not with "
            "--trainer-ranks/--ray"
        )
    from lorafleet.sync.pool_builder import build_pool

    stack = colocate(
        base.model,
        targets,
        base_model_id=base.model_id,
        tokenizer=base.tokenizer,
        train_slots=config.max_adapters,
        sample_slots=1,
        r_max=config.max_lora_rank,
        max_rows=config.max_sample_rows,
        token_budget=config.token_budget,
    )
    pool = build_pool(
        rollout,
        stack.trainer,
        limits=stack.sampler.limits,
        dtype=config.dtype,
        model_dir=base.path,
        max_lora_rank=config.max_lora_rank,
    )
    return EngineSet(trainer=stack.trainer, sampler=pool, owned=(pool,))


def _rank_settings(config: EngineConfig, dist: DistConfig, targets: Sequence[str]) -> RankSettings:
    from lorafleet.distributed.protocol import RankSettings

    return RankSettings(
        base_model=config.base_model,
        targets=tuple(targets),
        num_slots=config.max_adapters + 1,
        r_max=config.max_lora_rank,
        dtype=config.dtype,
        token_budget=config.token_budget,
        device=dist.device,
        torch_threads=dist.torch_threads,
        collective_timeout_s=dist.collective_timeout_s,
    )


def _check_same_base(trainer: DistTrainEngine, base_model_id: str) -> None:
    """The ranks load the base themselves; it must be the server's, and dense (no fused MoE)."""
    if trainer.base_model_id != base_model_id:
        trainer.close()
        raise ValueError(
            f"the trainer ranks loaded base model {trainer.base_model_id!r} but the server has {base_model_id!r}; "
            "use a preset name or the same absolute path on every machine"
        )
    if any(shape.num_experts != 1 for shape in trainer.bank.layers.values()):
        trainer.close()
        raise NotImplementedError(
            "the sharded trainer does not handle fused MoE expert banks yet (export and publish)"
        )


def _torchrun_engines(
    config: EngineConfig, dist: DistConfig, base: LoadedBase, targets: Sequence[str]
) -> EngineSet:
    from lorafleet.distributed.launcher import TorchrunRanks
    from lorafleet.distributed.remote import DistTrainEngine

    trainer = DistTrainEngine(
        TorchrunRanks(_rank_settings(config, dist, targets), dist.trainer_ranks)
    )
    _check_same_base(trainer, base.model_id)
    adapted = AdaptedModel(base.model, targets)
    bank = adapted.add_bank(
        "sample", num_slots=config.sampler_slots + 1, r_max=config.max_lora_rank, trainable=False
    )
    if bank.layout() != trainer.bank.layout():
        trainer.close()
        raise RuntimeError("the sampler bank and the trainer ranks' bank have different layouts")
    versions = VersionStore(bank, base_model_id=base.model_id)
    sampler = SampleEngine(
        adapted,
        versions,
        tokenizer=base.tokenizer,
        max_rows=config.max_sample_rows,
        prefix_cache_bytes=config.prefix_cache_bytes,
    )
    return EngineSet(trainer=trainer, sampler=sampler, owned=(trainer,))


def _ray_engines(
    config: EngineConfig, dist: DistConfig, base: LoadedBase, targets: Sequence[str]
) -> EngineSet:
    from lorafleet.distributed.ray_cluster import connect
    from lorafleet.distributed.ray_samplers import RaySamplerPool, SamplerSettings
    from lorafleet.distributed.ray_trainer import RayRanks
    from lorafleet.distributed.remote import DistTrainEngine

    connect(dist.ray or "local", num_cpus=dist.ray_num_cpus)
    trainer = DistTrainEngine(RayRanks(_rank_settings(config, dist, targets), dist.trainer_ranks))
    _check_same_base(trainer, base.model_id)
    try:
        pool = RaySamplerPool(
            SamplerSettings(
                base_model=config.base_model,
                targets=tuple(targets),
                slots=config.sampler_slots,
                r_max=config.max_lora_rank,
                dtype=config.dtype,
                max_rows=config.max_sample_rows,
                device=dist.device,
                torch_threads=dist.torch_threads,
                prefix_cache_bytes=config.prefix_cache_bytes,
            ),
            dist.sampler_replicas,
            trainer=trainer,
        )
    except BaseException:
        trainer.close()
        raise
    return EngineSet(trainer=trainer, sampler=pool, owned=(pool, trainer))
