"""What the server and the trainer ranks say to each other: settings, commands, replies.

The same commands travel over either transport (a socket to rank 0 of a `torchrun` group, or
Ray actor calls to every rank), so the rank code and the server-side engine adapter do not
depend on how the ranks were placed.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

# Commands rank 0 answers alone: they read its replicated bank and run no collective.
LOCAL_COMMANDS = frozenset({"info", "slot_weights", "slot_row"})
# Commands every rank runs, in the same order.
COLLECTIVE_COMMANDS = frozenset(
    {
        "set_token_budget",
        "create_adapter",
        "free_adapter",
        "import_weights",
        "forward",
        "forward_backward",
        "optim_step",
        "gather_state",
        "load_state",
        "shutdown",
    }
)


@dataclass(frozen=True)
class RankSettings:
    """Everything a rank needs to build its part of the trainer; identical on every rank."""

    base_model: str  # preset name or local HF dir (every machine needs it; see docs/deploy.md)
    targets: tuple[str, ...]  # module paths wrapped with banks (the server's full Tinker set)
    num_slots: int  # adapter slots + 1 (slot 0 is the base model)
    r_max: int
    dtype: str = "float32"  # compute dtype of the base (FSDP MixedPrecisionPolicy param_dtype)
    token_budget: int = 4096
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL, one GPU per rank)
    torch_threads: int | None = None
    collective_timeout_s: float = 600.0
    numerics: str = "fast"  # model/numerics.py: batch-invariant or fast (DEFAULT_NUMERICS)

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    def validate(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.num_slots < 2:
            raise ValueError(f"num_slots must be >= 2, got {self.num_slots}")
        if self.r_max < 1:
            raise ValueError(f"r_max must be >= 1, got {self.r_max}")
        if not self.targets:
            raise ValueError("targets is empty")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")


class RemoteRankError(RuntimeError):
    """An exception raised on a rank that could not be sent back as itself."""


@dataclass
class Reply:
    """One rank's answer: a value, or the exception it raised (user errors keep their type)."""

    ok: bool
    value: Any = None
    error: BaseException | None = None
    rank: int = 0
    others: list[str] = field(default_factory=list)  # errors reported by other ranks (rank 0 only)

    @classmethod
    def failure(cls, exc: BaseException, rank: int) -> Reply:
        try:
            pickle.loads(pickle.dumps(exc))
            sendable: BaseException = exc
        except Exception:  # noqa: BLE001 - any pickling failure: send the text instead
            sendable = RemoteRankError(f"rank {rank}: {type(exc).__name__}: {exc}")
        return cls(ok=False, error=sendable, rank=rank)

    def unwrap(self) -> Any:
        if self.ok:
            return self.value
        assert self.error is not None
        raise self.error


def command(name: str, **kwargs: Any) -> tuple[str, dict[str, Any]]:
    if name not in LOCAL_COMMANDS and name not in COLLECTIVE_COMMANDS:
        raise ValueError(f"unknown trainer command {name!r}")
    return (name, kwargs)


def _tensor_from_array(array: Any, dtype: str | None = None) -> torch.Tensor:
    tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def _reduce_tensor(tensor: torch.Tensor) -> Any:
    """CPU tensors travel as numpy arrays: one buffer copy, where torch's own pickling writes
    every storage through `torch.save` (far slower for an adapter's many small layers)."""
    if (
        tensor.device.type != "cpu"
        or tensor.requires_grad
        or tensor.layout != torch.strided
        or type(tensor) is not torch.Tensor
    ):
        return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    dense = tensor.detach().contiguous()
    if dense.dtype == torch.bfloat16:
        return (_tensor_from_array, (dense.view(torch.int16).numpy(), "bfloat16"))
    try:
        return (_tensor_from_array, (dense.numpy(),))
    except TypeError:  # a dtype numpy lacks
        return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}
    pickler.dump(obj)
    return buffer.getvalue()


def send(conn: Any, obj: Any) -> None:
    """Pickles by value. `Connection.send` would use multiprocessing's pickler, for which torch
    registers tensor reductions that pass shared-memory handles: meaningless (and refused)
    between processes that did not fork from each other."""
    conn.send_bytes(dumps(obj))


def recv(conn: Any) -> Any:
    return pickle.loads(conn.recv_bytes())
