"""One trainer rank: builds its shard of the model and runs the commands the server sends.

Two ways to drive the ranks, one rank code:
- `torchrun` (`python -m torch.distributed.run ... -m lorafleet.distributed.trainer_worker`): rank 0
  connects back to the server (an authenticated local socket, address and key in the
  environment), receives each command, shares it with the other ranks over a gloo group, runs
  its part, collects every rank's status and answers. `lorafleet serve --trainer-ranks N`
  starts it (launcher.py);
- Ray (ray_trainer.py): the server calls `RankWorker.handle` on every rank actor itself.

Commands are `(name, kwargs)`; see protocol.py for which ones are collective.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import sys
from dataclasses import asdict
from multiprocessing.connection import Client
from typing import Any

import torch
import torch.distributed as dist

from lorafleet.distributed.fsdp import ShardedTrainer, ShardingConfig, shard_base
from lorafleet.distributed.protocol import LOCAL_COMMANDS, RankSettings, Reply, dumps, recv, send
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import layer_experts
from lorafleet.model.kernel_check import prove_fused_kernel
from lorafleet.model.loader import load_base, parse_dtype
from lorafleet.model.numerics import apply_numerics, parse_numerics

log = logging.getLogger(__name__)

ENV_CONNECT = "LORAFLEET_DIST_CONNECT"  # host:port of the server's listener
ENV_AUTHKEY = "LORAFLEET_DIST_AUTHKEY"  # hex; never on the command line (visible in ps)
ENV_DEVICE = "LORAFLEET_DIST_DEVICE"  # cpu (gloo) or cuda (NCCL)
ENV_TIMEOUT = "LORAFLEET_DIST_TIMEOUT_S"  # collective timeout, seconds
# The command channel waits as long as the server is idle; collectives have their own timeout.
_IDLE_TIMEOUT = datetime.timedelta(days=30)


def init_distributed(settings: RankSettings, rank: int, world: int) -> Any:
    """Joins the default group (MASTER_ADDR/MASTER_PORT rendezvous, set by the caller) and
    returns a gloo group for Python objects and flags (None on CPU: the default group is gloo)."""
    timeout = datetime.timedelta(seconds=settings.collective_timeout_s)
    if settings.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(settings.backend, rank=rank, world_size=world, timeout=timeout)
    return dist.new_group(backend="gloo", timeout=timeout) if settings.backend != "gloo" else None


class RankWorker:
    """This rank's model shard and trainer, and the command dispatch."""

    def __init__(self, settings: RankSettings, *, cpu_group: Any = None):
        settings.validate()
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        self.settings = settings
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # Loaded on the CPU: fully_shard moves each layer to the mesh's device as it shards it.
        base = load_base(settings.base_model, dtype=settings.dtype)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(settings.device, (self.world,))
        apply_numerics(base.model, parse_numerics(settings.numerics))
        adapted = AdaptedModel(base.model, settings.targets)
        shard_base(base.model, mesh, ShardingConfig(param_dtype=parse_dtype(settings.dtype)))
        adapted.add_bank("train", num_slots=settings.num_slots, r_max=settings.r_max)
        # on CUDA the fused LoRA kernel runs only once it matched the torch path on this GPU
        adapted.kernel_verdict = prove_fused_kernel(adapted, settings.r_max)
        self.trainer = ShardedTrainer(
            adapted,
            base_model_id=base.model_id,
            token_budget=settings.token_budget,
            cpu_group=cpu_group,
        )
        bank = self.trainer.bank
        model: Any = base.model  # an HF causal LM; nn.Module types its accessors as Tensor
        self.info = {
            "base_model_id": base.model_id,
            "world": self.world,
            "device": str(bank.params.device),
            "lora_kernel": adapted.kernel_verdict.reason,
            "dtype": settings.dtype,
            "num_slots": bank.num_slots,
            "r_max": bank.r_max,
            "row_size": bank.row_size,
            "layout": bank.layout(),
            "layers": [
                (path, layer.in_features, layer.out_features, layer_experts(layer))
                for path, layer in bank.layers.items()
            ],
            "vocab_size": int(model.get_input_embeddings().num_embeddings),
            "max_length": int(getattr(model.config, "max_position_embeddings", 0) or 0) or None,
        }

    # ------------------------------------------------------------------ dispatch
    def handle(self, name: str, kwargs: dict[str, Any]) -> Reply:
        """Runs one command on this rank; never raises (the error travels in the reply)."""
        method = getattr(self, f"cmd_{name}", None)
        if method is None:
            return Reply.failure(ValueError(f"unknown trainer command {name!r}"), self.rank)
        try:
            return Reply(ok=True, value=method(**kwargs), rank=self.rank)
        except Exception as exc:  # every failure goes back to the server as a reply
            if not isinstance(exc, ValueError | LookupError):
                log.exception("rank %d: command %s failed", self.rank, name)
            return Reply.failure(exc, self.rank)

    def cmd_info(self) -> dict[str, Any]:
        return self.info

    def cmd_set_token_budget(self, token_budget: int) -> None:
        if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 1:
            raise ValueError(f"token_budget must be a positive integer, got {token_budget!r}")
        self.trainer.engine.token_budget = token_budget

    def cmd_create_adapter(self, spec, slot):
        return self.trainer.create_adapter(spec, slot)

    def cmd_free_adapter(self, slot):
        return self.trainer.free_adapter(slot)

    def cmd_import_weights(self, spec, weights, slot):
        return self.trainer.import_weights(spec, weights, slot)

    def cmd_forward(self, items):
        return self.trainer.run(items, backward=False)

    def cmd_forward_backward(self, items):
        return self.trainer.run(items, backward=True)

    def cmd_optim_step(self, hparams):
        return self.trainer.optim_step(hparams)

    def cmd_gather_state(self, slot):
        return self.trainer.gather_state(slot)

    def cmd_load_state(self, state, slot, with_optimizer, source):
        return self.trainer.load_state(state, slot, with_optimizer=with_optimizer, source=source)

    def cmd_slot_weights(self, slot):
        return self.trainer.slot_weights(slot)

    def cmd_slot_row(self, slot):
        return self.trainer.slot_row(slot)

    def cmd_shutdown(self) -> None:
        return None

    # ------------------------------------------------------------------ agreement
    def agree(self, reply: Reply, group: Any) -> Reply:
        """Collects every rank's status on rank 0, so that a command that failed on some ranks
        only is reported as the desynchronisation it is, not as rank 0's success."""
        if self.world == 1:
            return reply
        status = (
            None if reply.ok else f"rank {self.rank}: {type(reply.error).__name__}: {reply.error}"
        )
        statuses: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(status, statuses, dst=0, group=group)
        if self.rank != 0 or statuses is None:
            return reply
        failed = [s for s in statuses if s is not None]
        reply.others = failed
        if failed and reply.ok:
            from lorafleet.distributed.fsdp import DistError

            return Reply.failure(DistError(f"ranks disagree: {'; '.join(failed)}"), 0)
        return reply


def serve_torchrun() -> int:
    """The torchrun entry point (every rank runs it)."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{os.environ.get('RANK', '?')} %(levelname)s %(name)s: %(message)s",
    )
    rank = int(os.environ["RANK"])
    device = os.environ.get(ENV_DEVICE, "cpu")
    conn = None
    box: list[Any] = [None]
    if rank == 0:
        address = os.environ.get(ENV_CONNECT, "")
        authkey = os.environ.get(ENV_AUTHKEY, "")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not authkey:
            print(f"{ENV_CONNECT} and {ENV_AUTHKEY} must be set by the launcher", file=sys.stderr)
            return 2
        conn = Client((host, int(port)), authkey=bytes.fromhex(authkey))
        box = [RankSettings(**recv(conn))]
    # The default group carries FSDP and bank collectives, with the collective timeout (set by
    # the launcher in the environment, as the settings arrive only after the groups exist); the
    # command channel gets a group of its own that may wait as long as the server is idle.
    timeout = datetime.timedelta(seconds=float(os.environ.get(ENV_TIMEOUT, "600")))
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timeout)
    command_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if device == "cuda" else None
    dist.broadcast_object_list(box, src=0, group=command_group)
    settings: RankSettings = box[0]
    worker = _build(settings, cpu_group, conn)
    if worker is None:
        dist.destroy_process_group()
        return 1
    server_gone = False
    while True:
        if rank == 0:
            assert conn is not None
            name, kwargs = "shutdown", {}
            if not server_gone:
                try:
                    name, kwargs = recv(conn)
                except (EOFError, ConnectionResetError):
                    server_gone = True
            if name in LOCAL_COMMANDS:
                try:
                    send(conn, worker.handle(name, kwargs))
                except (BrokenPipeError, ConnectionResetError, EOFError):
                    server_gone = True
                continue
            message: list[Any] = [
                dumps((name, kwargs))
            ]  # bytes: torch's own tensor pickling is slow
        else:
            message = [None]
        dist.broadcast_object_list(message, src=0, group=command_group)
        name, kwargs = pickle.loads(message[0])
        reply = worker.agree(worker.handle(name, kwargs), cpu_group)
        if rank == 0 and not server_gone:
            assert conn is not None
            try:
                send(conn, reply)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                server_gone = True  # the next turn tells every rank to shut down
        if name == "shutdown":
            break
    if conn is not None:
        conn.close()
    dist.destroy_process_group()
    return 0


def _build(settings: RankSettings, cpu_group: Any, conn: Any) -> RankWorker | None:
    """Builds the rank; rank 0 reports the model info (or the failure) to the server."""
    error: BaseException | None = None
    worker = None
    try:
        worker = RankWorker(settings, cpu_group=cpu_group)
    except Exception as exc:  # reported to the server, then this rank exits
        log.exception("rank %d could not build its trainer", dist.get_rank())
        error = exc
    statuses: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(
        None if error is None else f"rank {dist.get_rank()}: {error}",
        statuses,
        dst=0,
        group=cpu_group,
    )
    if conn is not None:
        assert statuses is not None
        failed = [s for s in statuses if s is not None]
        if failed or worker is None:
            send(conn, Reply.failure(RuntimeError("; ".join(failed) or "rank 0 failed"), 0))
            return None
        send(conn, Reply(ok=True, value=worker.info))
        return worker
    return worker if error is None else None


def settings_dict(settings: RankSettings) -> dict[str, Any]:
    return asdict(settings)


if __name__ == "__main__":
    sys.exit(serve_torchrun())
