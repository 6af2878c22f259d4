"""Device memory: how the engines' sizes follow from it, and an out-of-memory that fails one
operation instead of the engine.

The plan. On a GPU the memory left after the base is loaded decides how much work fits; fixed
defaults are either wasteful on an H200 or fatal on a small card. `plan_memory` takes the
free bytes, keeps `HEADROOM` of them for what no estimate covers (the allocator's
fragmentation, cuBLAS workspaces, CUDA-graph pools, the optimizer's temporaries, a step's
logits), and splits the rest between the four consumers by `SHARES`:
- trainer slots: each resident run costs its fp32 bank row five times (weights, gradient,
  AdamW's two moments, Dimuon's momentum, which the bank allocates for every slot once one
  run asks for it), capped at `MAX_PLANNED_SLOTS` (more runs page out, they are never refused);
- the trainer's micro-batch token budget: the share over the bytes a training token keeps for
  its backward (train/token_budget.py estimates them);
- sampler rows: the share over a row's KV at `PLANNED_ROW_TOKENS` positions (the row cache
  grows with the longest sequence, so a row longer than that takes more; should that not fit,
  the one request that needed it fails, see below);
- the sampler's prefix cache: the share, in bytes.
A value given explicitly (a flag) is taken as it is and its cost comes off the top; the
remaining shares are scaled up over the planned values. On the CPU nothing is planned: its
memory is the operating system's to share, and the fixed defaults stay.

Out of memory. `is_out_of_memory` recognises torch's OutOfMemoryError and the CUDA runtime's
"out of memory" errors; the engines catch it around one operation, undo what that operation
changed, drop their references to its tensors, return the cached blocks to the device
(`release_cached`) and raise `DeviceOutOfMemory`, a ValueError naming the operation and its
size, so that a server fails that request alone and goes on serving.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

HEADROOM = 0.80
SHARES: Mapping[str, float] = {
    "max_adapters": 0.20,
    "token_budget": 0.40,
    "max_sample_rows": 0.30,
    "prefix_cache_bytes": 0.10,
}
PLANNED = frozenset(SHARES)
SLOT_ROWS = 5  # fp32 rows per trainer slot: weights, gradient, 2 AdamW moments, Dimuon momentum
MAX_PLANNED_SLOTS = 64
MIN_PLANNED_SLOTS = 1
PLANNED_ROW_TOKENS = 2048
MIN_ROWS, MAX_ROWS = 8, 256
MIN_TOKEN_BUDGET, MAX_TOKEN_BUDGET = 256, 65536


@dataclass(frozen=True)
class MemoryInputs:
    """What the plan is computed from (measured after the base is loaded)."""

    free_bytes: int  # device memory free now
    total_bytes: int
    row_bytes: int  # one adapter slot's fp32 row in the banks
    sampler_slots: int  # versions the sampler holds (a bank row each; not planned)
    kv_bytes_per_token: int  # the sampler's KV per position (every layer, K and V)
    train_bytes_per_token: int  # what a training token keeps alive for its backward

    def validate(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"memory plan input {name} must be an integer >= 0, got {value!r}")
        for name in ("row_bytes", "kv_bytes_per_token", "train_bytes_per_token"):
            if getattr(self, name) == 0:
                raise ValueError(f"memory plan input {name} must be > 0")


@dataclass(frozen=True)
class MemoryPlan:
    """The sizes the engines were built with and where each came from."""

    device: str
    planned: bool  # False: nothing planned here (the CPU), the values are as given
    headroom: float
    free_bytes: int | None
    total_bytes: int | None
    usable_bytes: int | None  # free x headroom
    values: dict[str, int | None]  # max_adapters, token_budget, max_sample_rows, prefix_cache_bytes
    sources: dict[str, str]  # each value's source: "planned" or "given"
    costs: dict[str, int] = field(default_factory=dict)  # bytes each consumer is planned to take
    note: str = ""

    def record(self) -> dict[str, Any]:
        return asdict(self)


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def consumer_bytes(name: str, value: int, inputs: MemoryInputs) -> int:
    """What `value` of consumer `name` takes on the device."""
    if name == "max_adapters":
        return (value + 1) * SLOT_ROWS * inputs.row_bytes  # slot 0 is the base's
    if name == "token_budget":
        return value * inputs.train_bytes_per_token
    if name == "max_sample_rows":
        return value * PLANNED_ROW_TOKENS * inputs.kv_bytes_per_token
    if name == "prefix_cache_bytes":
        return value
    raise ValueError(f"no memory rule for {name!r}; planned: {sorted(PLANNED)}")


def plan_memory(
    device: str,
    inputs: MemoryInputs,
    given: Mapping[str, int],
    *,
    headroom: float = HEADROOM,
) -> MemoryPlan:
    """Sizes the consumers of `PLANNED` absent from `given` from the free memory; the given
    ones stay as they are (their cost comes off the top). Raises ValueError, naming what it
    found, when the sampler bank and the given values alone leave nothing for the planned
    ones."""
    inputs.validate()
    unknown = sorted(set(given) - PLANNED)
    if unknown:
        raise ValueError(f"cannot plan {unknown}; planned: {sorted(PLANNED)}")
    if not 0.0 < headroom <= 1.0:
        raise ValueError(f"headroom must be in (0, 1], got {headroom}")
    usable = int(inputs.free_bytes * headroom)
    fixed = (inputs.sampler_slots + 1) * inputs.row_bytes  # the sampler bank
    values: dict[str, int | None] = {}
    sources: dict[str, str] = {}
    costs: dict[str, int] = {"sampler_bank": fixed}
    for name, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        values[name], sources[name] = value, "given"
        costs[name] = consumer_bytes(name, value, inputs)
    planned = [name for name in SHARES if name not in values]
    left = usable - sum(costs.values())
    if planned and left <= 0:
        raise ValueError(
            f"{device}: {inputs.free_bytes / 2**30:.2f} GiB free after the base was loaded "
            f"(x {headroom} headroom) does not even hold the sampler bank and the given sizes "
            f"({sum(costs.values()) / 2**30:.2f} GiB); give smaller sizes or a larger device"
        )
    total_share = sum(SHARES[name] for name in planned)
    for name in planned:
        share = int(left * SHARES[name] / total_share)
        if name == "max_adapters":
            slots = share // (SLOT_ROWS * inputs.row_bytes) - 1
            value = _clamp(slots, MIN_PLANNED_SLOTS, MAX_PLANNED_SLOTS)
        elif name == "token_budget":
            value = _clamp(
                share // inputs.train_bytes_per_token, MIN_TOKEN_BUDGET, MAX_TOKEN_BUDGET
            )
        elif name == "max_sample_rows":
            rows = share // (PLANNED_ROW_TOKENS * inputs.kv_bytes_per_token)
            value = _clamp(rows, MIN_ROWS, MAX_ROWS)
        else:
            value = share
        values[name], sources[name] = value, "planned"
        costs[name] = consumer_bytes(name, value, inputs)
    return MemoryPlan(
        device=device,
        planned=bool(planned),
        headroom=headroom,
        free_bytes=inputs.free_bytes,
        total_bytes=inputs.total_bytes,
        usable_bytes=usable,
        values={name: values[name] for name in SHARES},
        sources={name: sources[name] for name in SHARES},
        costs=costs,
        note=(
            f"{headroom:.0%} of the memory free after the base was loaded, split "
            + ", ".join(f"{name} {share:.0%}" for name, share in SHARES.items())
            + f" (sampler rows at {PLANNED_ROW_TOKENS} tokens each)"
        ),
    )


def unplanned(device: str, values: Mapping[str, int | None], note: str) -> MemoryPlan:
    """The record of a device where nothing is planned (the CPU): the values as given."""
    return MemoryPlan(
        device=device,
        planned=False,
        headroom=HEADROOM,
        free_bytes=None,
        total_bytes=None,
        usable_bytes=None,
        values=dict(values),
        sources=dict.fromkeys(values, "given"),
        note=note,
    )


def kv_bytes_per_token(model_config: Any, dtype: torch.dtype) -> int:
    """The sampler's KV cache per position: K and V of every layer (a transformers config,
    its text config for multimodal ones)."""
    text = (
        model_config.get_text_config(decoder=True)
        if hasattr(model_config, "get_text_config")
        else model_config
    )
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or int(text.hidden_size) // heads)
    return 2 * int(text.num_hidden_layers) * kv_heads * head_dim * dtype.itemsize


def bank_row_bytes(model: torch.nn.Module, targets: Sequence[str], r_max: int) -> int:
    """One adapter slot's fp32 row over `targets` (module paths of linears, or fused expert
    parameter paths) at rank `r_max`, as banks.py lays it out (rank padded to the alignment;
    within a few elements: the plan's estimate, computed before the banks exist)."""
    from lorafleet.model.banks import ALIGN_ELEMENTS
    from lorafleet.model.experts import fused_expert_params

    r_store = -(-r_max // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
    experts: dict[str, Any] | None = None
    floats = 0
    for path in targets:
        module = _submodule(model, path)
        if isinstance(module, torch.nn.Linear):
            floats += r_store * (module.in_features + module.out_features)
            continue
        if experts is None:
            experts = fused_expert_params(model)[0]
        info = experts.get(path)
        if info is None:
            raise ValueError(
                f"target {path!r} is neither a linear layer nor a fused expert projection"
            )
        floats += r_store * info.num_experts * (info.in_features + info.out_features)
    return 4 * floats


def _submodule(model: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device now."""
    if device.type != "cuda":
        raise ValueError(f"device_memory reads CUDA memory; got device {device}")
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


# --------------------------------------------------------------------------- out of memory


class DeviceOutOfMemory(ValueError):
    """One operation did not fit the device's memory; nothing it would have changed was
    applied, and the engine goes on serving. A ValueError: like a request that is too large,
    it is that request's failure (a server runs the others of its batch without it)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError (the caching allocator, on any device), or a CUDA runtime or
    cuBLAS error that says it ran out of memory."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return "out of memory" in text.lower() or "CUBLAS_STATUS_ALLOC_FAILED" in text
    return False


def release_cached(device: torch.device) -> None:
    """Returns the allocator's cached, unused blocks to a CUDA device (after an operation that
    ran out of memory dropped its tensors); nothing to do elsewhere."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def out_of_memory_message(device: torch.device, doing: str, exc: BaseException, advice: str) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"out of memory on {device} while {doing}; nothing was applied and the engine goes on "
        f"serving. {advice} ({type(exc).__name__}: {first[:300]})"
    )
