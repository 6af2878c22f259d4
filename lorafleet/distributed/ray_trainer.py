"""Trainer ranks as Ray actors: one actor per rank, the same `call` interface as torchrun.

Rank 0's node hosts the rendezvous; the ranks form a gloo/NCCL group and shard the base with
FSDP2 (fsdp.py). The server calls every rank with each collective command (Ray runs an actor's
calls in order). Rank 0 also hands out an adapter's tensors as an object-store object, which
the sampler replicas (ray_samplers.py) read directly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
from typing import Any

from lorafleet.distributed.fsdp import DistError
from lorafleet.distributed.protocol import LOCAL_COMMANDS, RankSettings, Reply, command, dumps
from lorafleet.distributed.ray_cluster import placement_options, ray_module
from lorafleet.distributed.wire import WirePayload, to_wire

log = logging.getLogger(__name__)


class TrainerRankActor:
    """One trainer rank in a Ray actor (wrapped with `ray.remote` at placement time)."""

    def __init__(self, rank: int, world: int):
        self.rank = rank
        self.world = world
        self.worker: Any = None

    def node(self) -> dict[str, str]:
        from lorafleet.distributed.ray_cluster import current_node

        return current_node()

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it, for the group's rendezvous."""
        ip = ray_module().util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind(("", 0))
            return ip, int(sock.getsockname()[1])

    def setup(self, settings: RankSettings, master_addr: str, master_port: int) -> Reply:
        from lorafleet.distributed.trainer_worker import RankWorker, init_distributed

        try:
            os.environ["MASTER_ADDR"] = master_addr
            os.environ["MASTER_PORT"] = str(master_port)
            cpu_group = init_distributed(settings, self.rank, self.world)
            self.worker = RankWorker(settings, cpu_group=cpu_group)
            return Reply(ok=True, value=self.worker.info, rank=self.rank)
        except Exception as exc:  # reported to the server, which stops the group
            log.exception("trainer rank %d failed to start", self.rank)
            return Reply.failure(exc, self.rank)

    def call(self, name: str, message: bytes) -> bytes:
        """Commands and replies cross Ray as `protocol.dumps` bytes (fast tensor pickling)."""
        return dumps(self.worker.handle(name, pickle.loads(message)))

    def payload(self, slot: int) -> WirePayload:
        """The adapter's spec and per-layer arrays, returned as an object-store object that the
        samplers read directly (raises, into the object, if the slot is empty)."""
        return to_wire(*self.worker.trainer.slot_weights(slot))

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class RayRanks:
    """Trainer ranks as Ray actors; same `call` interface as the torchrun launcher."""

    def __init__(
        self,
        settings: RankSettings,
        nproc: int,
        *,
        actor_options: dict[str, Any] | None = None,
        node_resource: str | None = None,
    ):
        """`node_resource`: prefer the nodes offering this Ray resource (ray_cluster.py)."""
        settings.validate()
        if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
            raise ValueError(f"trainer ranks must be a positive integer, got {nproc!r}")
        ray = ray_module()
        options = dict(actor_options or {})
        if settings.device == "cuda":
            options.setdefault("num_gpus", 1)
        actor_class = ray.remote(TrainerRankActor)
        self.actors = [
            actor_class.options(
                max_restarts=0, **options, **placement_options(node_resource, rank)
            ).remote(rank, nproc)
            for rank in range(nproc)
        ]
        try:
            self.nodes: list[dict[str, str]] = ray.get([a.node.remote() for a in self.actors])
            addr, port = ray.get(self.actors[0].address.remote())
            replies = ray.get([actor.setup.remote(settings, addr, port) for actor in self.actors])
            failed = [r for r in replies if not r.ok]
            if failed:
                raise DistError(
                    "trainer ranks failed to start: "
                    + "; ".join(f"rank {r.rank}: {r.error}" for r in failed)
                )
        except BaseException:
            self._kill()
            raise
        self.info: dict[str, Any] = replies[0].value

    def call(self, name: str, **kwargs: Any) -> Any:
        ray = ray_module()
        message_name, message = command(name, **kwargs)
        try:
            if message_name in LOCAL_COMMANDS:
                return pickle.loads(
                    ray.get(self.actors[0].call.remote(message_name, dumps(message)))
                ).unwrap()
            shared = ray.put(dumps(message))  # one copy in the object store, read by every rank
            replies: list[Reply] = [
                pickle.loads(b)
                for b in ray.get([a.call.remote(message_name, shared) for a in self.actors])
            ]
        except ray.exceptions.RayActorError as exc:
            raise DistError(f"a trainer rank died: {exc}") from exc
        failed = [r for r in replies if not r.ok]
        if failed and len(failed) < len(replies):
            raise DistError(
                "ranks disagree: " + "; ".join(f"rank {r.rank}: {r.error}" for r in failed)
            )
        return replies[0].unwrap()

    def payload_ref(self, slot: int) -> Any:
        return self.actors[0].payload.remote(slot)

    def _kill(self) -> None:
        ray = ray_module()
        for actor in self.actors:
            with contextlib.suppress(Exception):  # best effort: the actor may be gone already
                ray.kill(actor, no_restart=True)

    def close(self) -> None:
        ray = ray_module()
        with contextlib.suppress(Exception):  # closing a group whose ranks may be dead
            ray.get([actor.shutdown.remote() for actor in self.actors], timeout=30)
        self._kill()
