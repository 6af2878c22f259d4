"""Where the trainer ranks and sampler replicas run (`lorafleet serve` placement flags).

Plain data, so that the CLI and the engine config can name it without importing the
distributed machinery; `lorafleet.engines.build_engines` acts on it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DistConfig:
    """`--trainer-ranks N` alone: N local ranks under torchrun, the sampler in the server process;
    with `--ray ADDRESS`: N trainer-rank actors and M sampler-replica actors."""

    trainer_ranks: int = 1
    ray: str | None = None  # Ray address, "auto" or "local"; None = torchrun on this machine
    sampler_replicas: int = 1  # Ray only
    device: str = "cpu"  # trainer ranks (and Ray samplers): "cpu" (gloo) or "cuda" (NCCL)
    torch_threads: int | None = None  # per rank / replica
    ray_num_cpus: int | None = None  # only for ray="local"
    collective_timeout_s: float = 600.0
    # Ray custom resources that mark the nodes trainer ranks / sampler replicas should run on
    # (`ray start --resources '{"NAME": 1}'`): a preference, not a requirement, so a replica
    # whose node died is replaced on a live node (distributed/ray_cluster.py)
    trainer_resource: str | None = None
    sampler_resource: str | None = None

    def validate(self) -> None:
        for name, value in (
            ("trainer_ranks", self.trainer_ranks),
            ("sampler_replicas", self.sampler_replicas),
        ):
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
        for name in ("trainer_resource", "sampler_resource"):
            value = getattr(self, name)
            if value is not None:
                if self.ray is None:
                    raise ValueError(f"{name} places Ray actors; it needs Ray placement (--ray)")
                if not isinstance(value, str) or not value.strip():
                    raise ValueError(f"{name} must be a Ray resource name, got {value!r}")
