"""Which adapter slot each token uses, computed once per forward and shared by every layer.

HF models do not pass extra arguments down to their linears, so the routing travels through a
`RoutingScope` owned by the adapted model (thread-local, so a trainer thread and a sampler thread
can run forwards on the same base at once). There is no module-global state: a forward without an
active routing raises instead of silently running the base model.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from lorafleet.model import native

BASE_SLOT = 0
"""Slot 0 carries no adapter: its rows see the frozen base model only (reference logprobs)."""


class RoutingError(ValueError):
    """A routing that cannot be applied to the batch it was given."""


@dataclass(frozen=True)
class Routing:
    """Tokens of one forward sorted into contiguous per-slot segments.

    `order` lists the flat indices of tokens that use an adapter (slot > 0), stably sorted by
    slot; `offsets[g]` is the int32 end of the segment of slot g + 1 in that order (the layout
    `torch._grouped_mm` wants). `token_scale` is each sorted token's LoRA scale, so layers need
    no per-slot metadata of their own.
    """

    bank: str
    num_tokens: int
    num_slots: int
    order: torch.Tensor  # int64 [M]
    offsets: torch.Tensor  # int32 [num_slots - 1]
    counts: tuple[int, ...]  # tokens per slot 1..num_slots-1 (host copy, for the loop kernel)
    token_scale: torch.Tensor  # float32 [M, 1]
    # When the flat tokens are already sorted by slot (base tokens first), the routed tokens
    # are exactly the suffix starting here, so layers slice instead of gather/scatter.
    sorted_from: int | None = None
    # The span of slots [first, last] that own tokens (1 and 0 when none do): kernels run only
    # those groups (a view of the bank), so a pool of mostly idle slots costs nothing.
    first_active: int = 1
    last_active: int = 0
    # Per-token view for layers that regroup tokens themselves (MoE experts sort (token,
    # expert) pairs by (expert, slot)): each flat token's slot, and each slot's LoRA scale.
    slot_ids: torch.Tensor | None = None  # int64 [num_tokens]
    slot_scales: torch.Tensor | None = None  # float32 [num_slots]

    # Precomputed once per forward, read by every layer (a decode step is dominated by
    # per-layer overhead): the routed token count, the offsets of the active span, and the
    # tokens per slot when every slot of that span has the same count (then the kernels run
    # one batched matmul instead of a grouped one).
    num_active: int = 0
    span_offsets: torch.Tensor | None = None  # int32, offsets[first_active - 1 : last_active]
    uniform_count: int | None = None
    # (slot, start, end) of each active slot's tokens in `order`, int64 [active slots, 3]:
    # the plan of the native CPU kernels (kernels.py), which gather and scatter by `order`.
    segments: torch.Tensor | None = None

    @functools.cached_property
    def native_plan(self) -> native.RoutingPlan:
        """This routing as the native CPU kernels read it, built on first use and then shared
        by every layer of the forward (it points into `order`, `segments` and `token_scale`,
        which this object keeps alive)."""
        assert self.segments is not None
        return native.routing_plan(self.order, self.segments, self.token_scale)

    @functools.cached_property
    def device_segments(self) -> torch.Tensor:
        """`segments` on the device of the routed tokens, moved once per forward and shared by
        every layer (the Triton kernel reads its plan from device memory, triton_lora.py)."""
        assert self.segments is not None
        return self.segments.to(self.order.device)

    def active_slots(self) -> list[int]:
        """Slots that own at least one token in this forward."""
        return [slot for slot, count in enumerate(self.counts, start=1) if count > 0]


def build_routing(slot_ids: torch.Tensor, slot_scales: torch.Tensor, *, bank: str) -> Routing:
    """Sorts tokens by slot once; every adapted layer of the forward reuses the result.

    `slot_ids` holds one slot per token (any shape, flattened in row-major order, matching the
    flattened activations); `slot_scales[s]` is slot s's LoRA scale (0 for free slots).
    """
    if not isinstance(slot_ids, torch.Tensor):
        raise RoutingError(f"slot_ids must be a torch.Tensor, got {type(slot_ids).__name__}")
    if slot_ids.dtype not in (torch.int64, torch.int32):
        raise RoutingError(f"slot_ids must be int64 or int32, got dtype {slot_ids.dtype}")
    if slot_ids.device != slot_scales.device:
        raise RoutingError(
            f"slot_ids are on device {slot_ids.device} but the adapter bank is on {slot_scales.device}"
        )
    num_slots = int(slot_scales.numel())
    flat = slot_ids.reshape(-1).to(torch.int64)
    if flat.numel() > 0:
        low, high = int(flat.min()), int(flat.max())
        if low < 0 or high >= num_slots:
            bad = low if low < 0 else high
            raise RoutingError(f"slot id {bad} is outside the bank's slots [0, {num_slots})")
    counts = torch.bincount(flat, minlength=num_slots)
    # A trainer or sampler that lays rows out slot by slot gets tokens already in segment
    # order (base rows first); then layers skip the gather/scatter and add deltas in place.
    sorted_from = None
    if flat.numel() > 0 and bool((flat[1:] >= flat[:-1]).all()):
        sorted_from = int(counts[BASE_SLOT])
        order = torch.arange(sorted_from, flat.numel(), device=flat.device)
    else:
        active_idx = torch.nonzero(flat > BASE_SLOT, as_tuple=False).reshape(-1)
        order = active_idx[torch.argsort(flat[active_idx], stable=True)]
    offsets = torch.cumsum(counts[1:], dim=0).to(torch.int32)
    count_list = counts.tolist()
    active = [slot for slot, count in enumerate(count_list) if slot > BASE_SLOT and count > 0]
    first, last = (active[0], active[-1]) if active else (1, 0)
    span_counts = set(count_list[first : last + 1])
    ends = [int(end) - count_list[BASE_SLOT] for end in torch.cumsum(counts, dim=0).tolist()]
    segments = torch.tensor(
        [(slot, ends[slot - 1], ends[slot]) for slot in active], dtype=torch.int64
    ).reshape(-1, 3)
    token_scale = slot_scales.to(torch.float32)[flat[order]].unsqueeze(1)
    return Routing(
        bank=bank,
        num_tokens=int(flat.numel()),
        num_slots=num_slots,
        order=order,
        offsets=offsets,
        counts=tuple(int(c) for c in counts[1:].tolist()),
        token_scale=token_scale,
        sorted_from=sorted_from,
        first_active=first,
        last_active=last,
        num_active=int(order.numel()),
        span_offsets=offsets[first - 1 : last],
        uniform_count=span_counts.pop() if len(span_counts) == 1 and active else None,
        segments=segments,
        slot_ids=flat,
        slot_scales=slot_scales.to(torch.float32).clone(),
    )


class RoutingScope:
    """The routing in force for the current thread's forward on one adapted model."""

    def __init__(self) -> None:
        self._local = threading.local()

    @contextmanager
    def use(self, routing: Routing) -> Iterator[Routing]:
        previous = getattr(self._local, "routing", None)
        self._local.routing = routing
        try:
            yield routing
        finally:
            self._local.routing = previous

    def current(self, module_name: str) -> Routing:
        routing = getattr(self._local, "routing", None)
        if routing is None:
            raise RoutingError(
                f"adapted layer {module_name!r} ran without a routing; wrap the forward in "
                "`with model.routing(...)` (use slot 0 for base-model rows)"
            )
        return routing
