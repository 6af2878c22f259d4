"""LoRA delta for a batch whose tokens use different adapter slots.

`lora_delta` computes, for every token t routed to slot s > 0,
    delta[t] = scale[s] * B[s] @ (A[s] @ x[t])
on tokens already sorted into contiguous per-slot segments (see `routing.Routing`). Two
implementations agree in values and gradients:

- `grouped`: `torch._grouped_mm` over the segments, two calls per layer whatever the number of
  adapters. Offsets must be int32, every stride a multiple of 16 bytes, and its backward fails
  on a stride-0 incoming gradient, hence `_contiguous_grad`.
- `loop`: one pair of matmuls per slot that has tokens; the reference in tests and the
  fallback when the shapes do not meet grouped_mm's alignment rules.

Never gather per-token weight matrices (`A[slot_ids]`): measured 60-230x slower.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

from lorafleet.model.routing import Routing

KernelName = Literal["auto", "grouped", "loop"]
KERNELS: tuple[str, ...] = ("auto", "grouped", "loop")

_GROUPED_DTYPES = (torch.float32, torch.bfloat16)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands grouped_mm a dense gradient (it rejects stride-0 ones)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.contiguous()


def _contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(x) if x.requires_grad else x


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


@functools.cache
def grouped_mm_fits(dtype: torch.dtype, *dims: int) -> bool:
    """grouped_mm needs every row stride to be a multiple of 16 bytes (cached: every layer of
    every forward asks)."""
    if not grouped_mm_available() or dtype not in _GROUPED_DTYPES:
        return False
    itemsize = dtype.itemsize
    return all((d * itemsize) % 16 == 0 for d in dims)


def pick_kernel(kernel: KernelName, dtype: torch.dtype, in_features: int, rank: int, out_features: int) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    fits = grouped_mm_fits(dtype, in_features, rank, out_features)
    if kernel == "grouped" and not fits:
        raise ValueError(
            f"kernel 'grouped' cannot run dtype {dtype} with in={in_features}, rank={rank}, "
            f"out={out_features}: every row must be a multiple of 16 bytes"
        )
    if kernel == "auto":
        return "grouped" if fits else "loop"
    return kernel


def _grouped_delta(xs: torch.Tensor, A: torch.Tensor, B: torch.Tensor, routing: Routing) -> torch.Tensor:
    # A: [G, r, in] -> [G, in, r]; B: [G, out, r] -> [G, r, out]; both transposed views, no copy.
    # Only the slots from first_active to last_active run (offsets are cumulative, so the
    # slice still starts at token 0).
    first, last = routing.first_active, routing.last_active
    offsets = routing.offsets[first - 1 : last]
    hidden = torch._grouped_mm(xs, A[first - 1 : last].transpose(1, 2), offs=offsets)
    hidden = _contiguous_grad(hidden * routing.token_scale.to(hidden.dtype))
    return _contiguous_grad(torch._grouped_mm(hidden, B[first - 1 : last].transpose(1, 2), offs=offsets))


def _loop_delta(xs: torch.Tensor, A: torch.Tensor, B: torch.Tensor, routing: Routing) -> torch.Tensor:
    pieces = []
    start = 0
    for group, count in enumerate(routing.counts):
        if count == 0:
            continue
        end = start + count
        hidden = (xs[start:end] @ A[group].T) * routing.token_scale[start:end].to(xs.dtype)
        pieces.append(hidden @ B[group].T)
        start = end
    if not pieces:
        return xs.new_zeros((0, B.shape[1]))
    return torch.cat(pieces, dim=0)


def lora_delta(
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    routing: Routing,
    kernel: KernelName = "auto",
) -> torch.Tensor | None:
    """LoRA deltas of the routed tokens, in `routing.order` (sorted by slot).

    x: [num_tokens, in] activations; A: [slots, r, in]; B: [slots, out, r] (slot 0 included and
    ignored). Returns [num_active, out] (in x's or the bank's dtype; the caller casts) or None
    when no token uses an adapter.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, features], got shape {tuple(x.shape)}")
    if x.shape[0] != routing.num_tokens:
        raise ValueError(
            f"routing covers {routing.num_tokens} tokens but the layer got {x.shape[0]}; "
            "build the routing from the same batch that is fed to the model"
        )
    if A.shape[0] != routing.num_slots or B.shape[0] != routing.num_slots:
        raise ValueError(
            f"routing was built for {routing.num_slots} slots but the bank has {A.shape[0]}"
        )
    if routing.num_active == 0:
        return None
    xs = x.contiguous() if routing.in_order else x.index_select(0, routing.order)
    # The LoRA path always runs in the bank's dtype (fp32 masters), as PEFT does for fp32
    # adapters on a bf16 base: the delta of a token then never depends on how many tokens
    # or slots share the forward, so a trainer forward and a sampler prefill of the same
    # tokens agree exactly, and gradients reach the fp32 bank without a bf16 round trip.
    # LoRA flops are ~r(in+out)/(in*out) of the base layer's, so fp32 costs little.
    compute_dtype = A.dtype
    xs = xs.to(compute_dtype)
    A_active = A[1:]
    B_active = B[1:]
    impl = pick_kernel(kernel, compute_dtype, A.shape[2], A.shape[1], B.shape[1])
    if impl == "grouped":
        return _grouped_delta(xs, A_active, B_active, routing)
    return _loop_delta(xs, A_active, B_active, routing)


def apply_lora(
    base_out: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, routing: Routing,
    kernel: KernelName = "auto",
) -> torch.Tensor:
    """base_out + LoRA deltas scattered back to their tokens' rows (flat [tokens, out])."""
    delta = lora_delta(x, A, B, routing, kernel)
    if delta is None:
        return base_out
    # In place: base_out is the base layer's fresh output, which its backward does not keep.
    if routing.in_order:
        return base_out.add_(delta.to(base_out.dtype))
    return base_out.index_add_(0, routing.order, delta.to(base_out.dtype))
