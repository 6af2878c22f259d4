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

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lorafleet.distributed.placement import DistConfig
from lorafleet.interfaces import EngineSet
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.kernel_check import prove_fused_kernel
from lorafleet.model.kernels import KernelName
from lorafleet.model.loader import LoadedBase
from lorafleet.model.memory import (
    PLANNED,
    MemoryInputs,
    MemoryPlan,
    bank_row_bytes,
    device_memory,
    kv_bytes_per_token,
    plan_memory,
    unplanned,
)
from lorafleet.model.numerics import DEFAULT_NUMERICS, NumericsName, apply_numerics
from lorafleet.sample.cuda_graphs import prove_decode_graphs
from lorafleet.sample.engine import DEFAULT_MAX_ROWS, SampleEngine
from lorafleet.sample.versions import VersionStore
from lorafleet.sync.rollout_config import RolloutConfig
from lorafleet.train.engine import DEFAULT_TOKEN_BUDGET, TrainEngine
from lorafleet.train.token_budget import DecoderShape, activation_bytes_per_token

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
    "device_report",
    "plan_engine_config",
]

log = logging.getLogger(__name__)


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
    # Where the colocated trainer, sampler, banks, KV and prefix caches live ("cpu" or
    # "cuda:N", as lorafleet.hardware.resolve_device gives it); load_base puts the base there.
    device: str = "cpu"
    # Which of max_adapters, token_budget, max_sample_rows and prefix_cache_bytes are sized
    # from the device's free memory (on CUDA, model/memory.py; the flags left unset); the
    # others, and all of them on the CPU, are taken as given. `plan_engine_config` does it
    # once and records what it decided in `memory_plan`.
    memory_planned: frozenset[str] = frozenset()
    memory_plan: MemoryPlan | None = None
    # batch-invariant (a row's numbers do not depend on its batch partners) or fast (the
    # stock kernels); model/numerics.py, docs/numerics.md
    numerics: NumericsName = DEFAULT_NUMERICS


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
    decode_graphs: bool = True,
    numerics: NumericsName = DEFAULT_NUMERICS,
) -> Colocated:
    """Wraps `model` once; `train_slots`/`sample_slots` adapters (slot 0, the base, not counted).

    `copy_slot_from` needs both bank sets over the same layers with the same r_max; building
    them here in one place keeps that invariant out of every caller. On CUDA the kernels are
    proven before anything is served (`prove_kernels`); `decode_graphs` False keeps decode
    eager even where replay would pass its check. `numerics` switches the base's matmuls and
    attention (model/numerics.py) before anything is built or checked over it."""
    apply_numerics(model, numerics)
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
    # the invariant attention checks its masks on the host (a sync): no CUDA-graph capture
    graphs = decode_graphs and numerics == "fast"
    prove_kernels(adapted, sampler, r_max, decode_graphs=graphs)
    return Colocated(adapted=adapted, trainer=trainer, versions=versions, sampler=sampler)


def prove_kernels(
    adapted: AdaptedModel, sampler: SampleEngine | None, r_max: int, *, decode_graphs: bool = True
) -> None:
    """Start-up checks on the device the engines run on (no-ops on the CPU): the fused LoRA
    kernel against the torch path (model/kernel_check.py), then CUDA-graph decode against
    eager (sample/cuda_graphs.py). Each keeps the faster path only if it passes, and says why
    in the stats (`device_report`)."""
    adapted.kernel_verdict = prove_fused_kernel(adapted, r_max)
    if sampler is not None and decode_graphs:
        prove_decode_graphs(sampler)


# --------------------------------------------------------------------------- the device


def plan_engine_config(
    config: EngineConfig,
    base: LoadedBase,
    targets: Sequence[str],
    *,
    memory: Callable[[], tuple[int, int]] | None = None,
) -> EngineConfig:
    """`config` with the sizes named in `memory_planned` taken from the device's free memory
    (model/memory.py) and the decision recorded in `memory_plan`; done once (a planned config
    comes back as it is). On the CPU, and with trainer ranks or Ray replicas (whose memory is
    elsewhere), nothing is planned and the sizes stay as given. `memory` (free, total bytes)
    replaces reading the CUDA device (tests)."""
    if config.memory_plan is not None:
        return config
    unknown = sorted(config.memory_planned - PLANNED)
    if unknown:
        raise ValueError(f"cannot plan {unknown} from device memory; plannable: {sorted(PLANNED)}")
    device = torch.device(config.device)
    values = {
        "max_adapters": config.max_adapters,
        "token_budget": config.token_budget,
        "max_sample_rows": config.max_sample_rows,
        "prefix_cache_bytes": config.prefix_cache_bytes,
    }
    if config.dist is not None:
        plan = unplanned(
            str(device), values, "trainer ranks / Ray replicas: their memory is not this process's"
        )
        return replace(config, memory_plan=plan)
    if memory is None and device.type != "cuda":
        note = f"{device.type}: nothing planned (host memory is shared with the operating system)"
        return replace(config, memory_plan=unplanned(str(device), values, note))
    free, total = memory() if memory is not None else device_memory(device)
    hf_config: Any = base.model.config
    inputs = MemoryInputs(
        free_bytes=free,
        total_bytes=total,
        row_bytes=bank_row_bytes(base.model, targets, config.max_lora_rank),
        sampler_slots=config.sampler_slots,
        kv_bytes_per_token=kv_bytes_per_token(hf_config, base.dtype),
        train_bytes_per_token=activation_bytes_per_token(
            DecoderShape.from_config(hf_config), base.dtype.itemsize
        ),
    )
    given: dict[str, int] = {}
    for name, value in values.items():
        if name in config.memory_planned:
            continue
        if value is None:  # the prefix cache's own default: its bytes still count
            rows = config.max_sample_rows + max(1, config.max_sample_rows // 16)
            value = SampleEngine.default_prefix_cache_bytes(
                hf_config.get_text_config(decoder=True), base.dtype, rows
            )
        given[name] = value
    plan = plan_memory(str(device), inputs, given)
    log.info(
        "memory plan on %s (%.1f GiB free): %s",
        device,
        free / 2**30,
        ", ".join(f"{k} {v} ({plan.sources[k]})" for k, v in plan.values.items()),
    )
    planned: dict[str, Any] = {name: plan.values[name] for name in config.memory_planned}
    return replace(config, memory_plan=plan, **planned)


def device_report(config: EngineConfig, engines: EngineSet) -> dict[str, Any]:
    """The device the engines run on, as the server's stats show it: its name and memory now,
    the memory plan, which LoRA kernel runs and whether decode replays CUDA graphs (each with
    the reason), and the operations that ran out of memory."""
    device = torch.device(config.device)
    report: dict[str, Any] = {"device": str(device)}
    if device.type == "cuda":
        free, total = device_memory(device)
        report.update(
            name=torch.cuda.get_device_name(device),
            total_bytes=total,
            free_bytes=free,
            allocated_bytes=int(torch.cuda.memory_allocated(device)),
            reserved_bytes=int(torch.cuda.memory_reserved(device)),
            peak_allocated_bytes=int(torch.cuda.max_memory_allocated(device)),
        )
    else:
        from lorafleet.hardware import cpu_info

        report["name"] = cpu_info().model
    report["memory_plan"] = None if config.memory_plan is None else config.memory_plan.record()
    trainer, sampler = engines.trainer, engines.sampler
    # Ray trainer ranks: the node each runs on (distributed/ray_trainer.py)
    report["trainer_nodes"] = getattr(getattr(trainer, "client", None), "nodes", None)
    verdict = trainer.adapted.kernel_verdict if isinstance(trainer, TrainEngine) else None
    report["lora_kernel"] = None if verdict is None else verdict.record()
    if isinstance(sampler, SampleEngine):
        report["cuda_graphs"] = sampler.decode_graph_stats()
        report["sampler_out_of_memory_failures"] = sampler.out_of_memory_failures
        report["prefix_cache_out_of_memory_skips"] = sampler.prefix_cache_oom_skips
    else:
        report["cuda_graphs"] = None
    return report


# --------------------------------------------------------------------------- the factory


def build_engines(config: EngineConfig, base: LoadedBase, targets: Sequence[str]) -> EngineSet:
    """The engines for `config` over `base`, with adapters on `targets` (module paths).

    The caller loads the base and resolves the targets: it also needs the base's own modules
    (e.g. to resolve other target sets) before the engines wrap them."""
    config = plan_engine_config(config, base, targets)
    _check_on_device(config, base)
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
            numerics=config.numerics,
        ).engines()
    config.dist.validate()
    if config.dist.ray is None:
        return _torchrun_engines(config, config.dist, base, targets)
    return _ray_engines(config, config.dist, base, targets)


def _check_on_device(config: EngineConfig, base: LoadedBase) -> None:
    """The base must already be where the config says (load_base(device=...)): the banks,
    caches and optimizer state are made on the device of its weights."""
    where = {p.device for p in base.model.parameters()}
    want = torch.device(config.device)
    if any(
        d.type != want.type or (want.index is not None and d.index != want.index) for d in where
    ):
        raise ValueError(
            f"the engine config says device {config.device} but the base model's weights are on "
            f"{sorted(str(d) for d in where)}; load it with load_base(..., device={config.device!r})"
        )


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
        decode_graphs=False,  # kept for its request limits only: vLLM/SGLang sample
        numerics=config.numerics,
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
        numerics=config.numerics,
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
    apply_numerics(base.model, config.numerics)
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
    prove_kernels(adapted, sampler, config.max_lora_rank, decode_graphs=config.numerics == "fast")
    return EngineSet(trainer=trainer, sampler=sampler, owned=(trainer,))


def _ray_engines(
    config: EngineConfig, dist: DistConfig, base: LoadedBase, targets: Sequence[str]
) -> EngineSet:
    from lorafleet.distributed.ray_cluster import connect
    from lorafleet.distributed.ray_samplers import RaySamplerPool, SamplerSettings
    from lorafleet.distributed.ray_trainer import RayRanks
    from lorafleet.distributed.remote import DistTrainEngine

    connect(dist.ray or "local", num_cpus=dist.ray_num_cpus)
    trainer = DistTrainEngine(
        RayRanks(
            _rank_settings(config, dist, targets),
            dist.trainer_ranks,
            node_resource=dist.trainer_resource,
        )
    )
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
                numerics=config.numerics,
            ),
            dist.sampler_replicas,
            trainer=trainer,
            node_resource=dist.sampler_resource,
        )
    except BaseException:
        trainer.close()
        raise
    return EngineSet(trainer=trainer, sampler=pool, owned=(pool, trainer))
