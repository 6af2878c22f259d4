"""The server's engines when training is sharded or placed by Ray.

`build_dist_stack` returns what `sample.colocate` returns for one process (`trainer`,
`sampler`, `versions`), plus `close`, so the executor keeps calling the same interfaces:
- `--trainer-ranks N` (no Ray): N local ranks under torchrun; the sampler stays in the server
  process over its own copy of the base;
- `--ray ADDRESS`: N trainer-rank actors and M sampler-replica actors; versions travel through
  the Ray object store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lorafleet.distributed.protocol import RankSettings
from lorafleet.distributed.remote import DistTrainEngine


@dataclass(frozen=True)
class DistConfig:
    """Placement of the trainer and samplers (`lorafleet serve` flags)."""

    trainer_ranks: int = 1
    ray: str | None = None  # Ray address, "auto" or "local"; None = torchrun on this machine
    sampler_replicas: int = 1  # Ray only
    device: str = "cpu"  # trainer ranks (and Ray samplers): "cpu" (gloo) or "cuda" (NCCL)
    torch_threads: int | None = None  # per rank / replica
    ray_num_cpus: int | None = None  # only for ray="local"
    collective_timeout_s: float = 600.0

    def validate(self) -> None:
        for name in ("trainer_ranks", "sampler_replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.ray is None and self.sampler_replicas != 1:
            raise ValueError(
                "sampler_replicas needs Ray placement (--ray); without it the sampler runs in the server"
            )
        if self.ray is not None and not self.ray:
            raise ValueError("ray must be an address, 'auto' or 'local'")


@dataclass
class DistStack:
    trainer: DistTrainEngine
    sampler: Any  # SampleEngine (torchrun) or RaySamplerPool (Ray)
    versions: Any  # VersionStore or the pool itself

    def close(self) -> None:
        close = getattr(self.sampler, "close", None)
        try:
            if close is not None:
                close()
        finally:
            self.trainer.close()


def build_dist_stack(engine: Any, base: Any, targets: Sequence[str]) -> DistStack:
    """`engine` is the server's EngineConfig (with `dist` set), `base` its LoadedBase."""
    config: DistConfig = engine.dist
    config.validate()
    settings = RankSettings(
        base_model=engine.base_model,
        targets=tuple(targets),
        num_slots=engine.max_adapters + 1,
        r_max=engine.max_lora_rank,
        dtype=engine.dtype,
        token_budget=engine.token_budget,
        device=config.device,
        torch_threads=config.torch_threads,
        collective_timeout_s=config.collective_timeout_s,
    )
    if config.ray is None:
        return _torchrun_stack(engine, base, targets, config, settings)
    return _ray_stack(engine, base, targets, config, settings)


def _check_same_base(trainer: DistTrainEngine, base_model_id: str) -> None:
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


def _torchrun_stack(
    engine: Any, base: Any, targets: Sequence[str], config: DistConfig, settings: RankSettings
) -> DistStack:
    from lorafleet.distributed.launcher import TorchrunRanks
    from lorafleet.model.adapted import AdaptedModel
    from lorafleet.sample.engine import SampleEngine
    from lorafleet.sample.versions import VersionStore

    trainer = DistTrainEngine(TorchrunRanks(settings, config.trainer_ranks))
    _check_same_base(trainer, base.model_id)
    adapted = AdaptedModel(base.model, targets)
    bank = adapted.add_bank(
        "sample", num_slots=engine.sampler_slots + 1, r_max=engine.max_lora_rank, trainable=False
    )
    if bank.layout() != trainer.bank.layout():
        trainer.close()
        raise RuntimeError("the sampler bank and the trainer ranks' bank have different layouts")
    versions = VersionStore(bank, base_model_id=base.model_id)
    sampler = SampleEngine(
        adapted, versions, tokenizer=base.tokenizer, max_rows=engine.max_sample_rows
    )
    return DistStack(trainer=trainer, sampler=sampler, versions=versions)


def _ray_stack(
    engine: Any, base: Any, targets: Sequence[str], config: DistConfig, settings: RankSettings
) -> DistStack:
    from lorafleet.distributed.ray_workers import RayRanks, RaySamplerPool, SamplerSettings, connect

    connect(config.ray or "local", num_cpus=config.ray_num_cpus)
    trainer = DistTrainEngine(RayRanks(settings, config.trainer_ranks))
    _check_same_base(trainer, base.model_id)
    try:
        pool = RaySamplerPool(
            SamplerSettings(
                base_model=engine.base_model,
                targets=tuple(targets),
                slots=engine.sampler_slots,
                r_max=engine.max_lora_rank,
                dtype=engine.dtype,
                max_rows=engine.max_sample_rows,
                device=config.device,
                torch_threads=config.torch_threads,
            ),
            config.sampler_replicas,
            trainer=trainer,
        )
    except BaseException:
        trainer.close()
        raise
    return DistStack(trainer=trainer, sampler=pool, versions=pool)
