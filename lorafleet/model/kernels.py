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

The two halves are separate (`lora_hidden`, `lora_output`) because layers fed the same input
(q/k/v, gate/up) share one A-projection: their A's sit side by side in the bank, so one call
projects for all of them (see banks.InputGroup).

A forward that needs no autograd (sampling, scoring) on CPU runs each layer's whole LoRA as
one call to the native kernels of `lora_cpu.c` instead (`add_lora_native`, see native.py):
they stream each adapter's fp32 A and B faster than MKL's small batched matmuls at decode
sizes (docs/performance.md), and fold the token gather, the bf16 conversion, the scale and the
scatter-add into the same pass. They agree with the torch implementations to fp32 rounding, and a token's
result never depends on the rest of the batch. One call per layer matters as much as the
arithmetic: at decode the Python around two calls per layer (and a shared A-projection per
input group) cost about as much time as the kernels themselves.

On CUDA a layer's whole LoRA runs as one fused Triton launch instead (`add_lora_fused`, see
triton_lora.py): shrink, scale, expand and the add into the base output, with a backward for
training, where the two-call torch path costs several kernel launches per layer.

Kernel names: `auto` = native when it applies and is built, the fused Triton kernel on CUDA
when triton is importable, else grouped (loop when the shapes do not fit grouped_mm);
`native` = the same, but a missing native library is an error; `triton` = the fused kernel
for every plain linear (an error where it cannot run; MoE experts keep the torch path);
`torch` = grouped where the shapes fit, else loop, never native or fused (what `auto` becomes
on CUDA when the fused kernel fails its start-up check, kernel_check.py);
`grouped` / `loop` = torch only, that one.

Never gather per-token weight matrices (`A[slot_ids]`): far slower than segments (figure:
docs/performance.md).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Literal

import torch

from lorafleet.model import native
from lorafleet.model.routing import Routing

KernelName = Literal["auto", "grouped", "loop", "native", "torch", "triton"]
KERNELS: tuple[str, ...] = ("auto", "grouped", "loop", "native", "torch", "triton")

_GROUPED_DTYPES = (torch.float32, torch.bfloat16)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands grouped_mm a dense gradient (it rejects stride-0 ones)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
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


def pick_kernel(
    kernel: KernelName, dtype: torch.dtype, in_features: int, rank: int, out_features: int
) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    fits = grouped_mm_fits(dtype, in_features, rank, out_features)
    if kernel == "grouped" and not fits:
        raise ValueError(
            f"kernel 'grouped' cannot run dtype {dtype} with in={in_features}, rank={rank}, "
            f"out={out_features}: every row must be a multiple of 16 bytes"
        )
    if kernel in ("auto", "native", "torch", "triton"):
        # (`triton` fuses whole plain linears in add_lora_fused; what reaches the two-call
        # path with it, MoE experts, runs as `auto` does.)
        return "grouped" if fits else "loop"
    return kernel


@functools.cache
def triton_available() -> bool:
    """Whether triton can be imported here (found without importing it: the import is slow,
    and only a CUDA forward needs it)."""
    return importlib.util.find_spec("triton") is not None


_FUSED_X_DTYPES = (torch.float32, torch.bfloat16)


def _fused_applies(kernel: KernelName, x: torch.Tensor, A: torch.Tensor) -> bool:
    """`triton` always (a clear error where it cannot run); `auto` on CUDA with triton
    importable, fp32 banks and an fp32/bf16 input; never on the CPU for `auto`."""
    if kernel == "triton":
        if not triton_available():
            raise ValueError("kernel 'triton' needs the triton package, which is not installed")
        return True
    return (
        kernel == "auto"
        and x.is_cuda
        and A.dtype == torch.float32
        and x.dtype in _FUSED_X_DTYPES
        and triton_available()
    )


def add_lora_fused(
    base_out: torch.Tensor,
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    routing: Routing,
    kernel: KernelName = "auto",
) -> torch.Tensor | None:
    """base_out + the whole LoRA of x in one fused Triton launch (triton_lora.py), in place,
    when that kernel applies (`_fused_applies`); None, having done nothing, when it does not.

    x: [..., in] and base_out: [..., out], the layer's input and base output. Returns the
    result shaped as base_out (under autograd it carries the LoRA's history, so the caller
    must use it rather than base_out)."""
    if not _fused_applies(kernel, x, A):
        return None
    from lorafleet.model import triton_lora  # imports triton: only when the kernel runs

    _check(x.reshape(-1, A.shape[2]), A, routing)
    flat_out = base_out.view(-1, B.shape[1])
    result = triton_lora.add_routed_lora(flat_out, x.reshape(-1, A.shape[2]), A, B, routing)
    return result.view_as(base_out)


def _native_for(
    kernel: KernelName, x: torch.Tensor, W: torch.Tensor
) -> native.NativeKernels | None:
    """The native kernels when this call may run them: kernel auto/native, no autograd
    through it, CPU, fp32 weights, an fp32/bf16 input with unit column stride."""
    if kernel not in ("auto", "native"):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or W.requires_grad):
        return None
    if (
        not x.is_cpu
        or not W.is_cpu
        or W.dtype != torch.float32
        or x.dtype not in native.DTYPE_CODES
        or x.stride(-1) != 1
    ):
        return None
    return native.require() if kernel == "native" else native.kernels()


def _gather(x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The routed tokens of flat `x`, in slot order: a slice when the batch is slot-sorted."""
    if routing.sorted_from is not None:
        return x[routing.sorted_from :]
    return x.index_select(0, routing.order)


def _check(x: torch.Tensor, A: torch.Tensor, routing: Routing) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, features], got shape {tuple(x.shape)}")
    if x.shape[0] != routing.num_tokens:
        raise ValueError(
            f"routing covers {routing.num_tokens} tokens but the layer got {x.shape[0]}; "
            "build the routing from the same batch that is fed to the model"
        )
    if A.shape[0] != routing.num_slots:
        raise ValueError(
            f"routing was built for {routing.num_slots} slots but the bank has {A.shape[0]}"
        )


def lora_hidden(
    x: torch.Tensor, A: torch.Tensor, routing: Routing, kernel: KernelName = "auto"
) -> torch.Tensor | None:
    """First half of LoRA for the routed tokens: scale[slot] * (A[slot] @ x[t]), sorted by slot.

    x: [num_tokens, in]; A: [slots, rows, in] (slot 0 included and ignored; `rows` may stack
    the A's of several layers fed the same input). Returns fp32 [num_active, rows], or None
    when no token uses an adapter.

    The LoRA path always runs in the bank's dtype (fp32 masters), as PEFT does for fp32
    adapters on a bf16 base: a token's delta then never depends on how many tokens or slots
    share the forward, so a trainer forward and a sampler prefill of the same tokens agree
    exactly, and gradients reach the fp32 bank without a bf16 round trip. LoRA flops are
    ~r(in+out)/(in*out) of the base layer's, so fp32 costs little.
    """
    _check(x, A, routing)
    if routing.num_active == 0:
        return None
    xs = _gather(x, routing).to(A.dtype)
    hidden = _segment_matmul(
        xs, A, routing, pick_kernel(kernel, A.dtype, A.shape[2], A.shape[1], A.shape[1])
    )
    # In place: grouped_mm/bmm keep their inputs for backward, not their output.
    return _contiguous_grad(hidden.mul_(routing.token_scale))


def lora_output(
    hidden: torch.Tensor, B: torch.Tensor, routing: Routing, kernel: KernelName = "auto"
) -> torch.Tensor:
    """Second half: B[slot] @ hidden[t] for the sorted routed tokens ([num_active, out], fp32).

    `hidden` may be a column slice of a stacked hidden (one layer's share of `lora_hidden`
    over several A's); only its row stride has to meet grouped_mm's alignment."""
    impl = pick_kernel(kernel, B.dtype, hidden.stride(0), B.shape[2], B.shape[1])
    return _contiguous_grad(_segment_matmul(hidden, B, routing, impl))


def _segment_matmul(xs: torch.Tensor, W: torch.Tensor, routing: Routing, impl: str) -> torch.Tensor:
    """xs[t] @ W[slot(t)].T for slot-sorted rows xs: [num_active, k], W: [slots, n, k]."""
    first, last = routing.first_active, routing.last_active
    if impl == "loop":
        return torch.cat(
            [xs[start:end] @ W[slot].T for slot, start, end in _segments(routing)], dim=0
        )
    # Only the slots from first_active to last_active run (a view of the bank); W[s].T is a
    # transposed view, no copy.
    weights = W[first : last + 1].transpose(1, 2)
    count = routing.uniform_count
    if count is not None:
        # Every slot of the span has `count` rows: a plain batched matmul, which on CPU costs
        # about half of grouped_mm's per-group slicing for decode-sized segments.
        return torch.bmm(xs.view(-1, count, xs.shape[1]), weights).view(xs.shape[0], -1)
    return torch._grouped_mm(xs, weights, offs=routing.span_offsets)


def _segments(routing: Routing) -> list[tuple[int, int, int]]:
    """(slot, start, end) of each slot's tokens in the sorted order (the loop kernel's plan)."""
    segments = []
    start = 0
    for slot, count in enumerate(routing.counts, start=1):
        if count:
            segments.append((slot, start, start + count))
            start += count
    return segments


def add_deltas(base_out: torch.Tensor, delta: torch.Tensor, routing: Routing) -> torch.Tensor:
    """base_out (flat [tokens, out]) plus each routed token's delta, in place.

    In place is safe: base_out is the base layer's fresh output, which its backward does not
    keep (the delta is added in base_out's dtype)."""
    if routing.sorted_from is not None:
        base_out[routing.sorted_from :].add_(delta.to(base_out.dtype))
        return base_out
    return base_out.index_add_(0, routing.order, delta.to(base_out.dtype))


def add_lora_output(
    base_out: torch.Tensor,
    hidden: torch.Tensor,
    B: torch.Tensor,
    routing: Routing,
    kernel: KernelName = "auto",
) -> torch.Tensor:
    """base_out (flat [tokens, out]) plus B[slot] @ hidden[t] at each routed token's row, in
    place (lora_output + add_deltas)."""
    return add_deltas(base_out, lora_output(hidden, B, routing, kernel), routing)


def add_lora_native(
    base_out: torch.Tensor,
    x: torch.Tensor,
    A: torch.Tensor,
    plan: native.LayerPlan | None,
    routing: Routing,
    kernel: KernelName = "auto",
) -> bool:
    """base_out += the whole LoRA of x, in place, in one native call when the native kernels
    apply (`_native_for`, both tensors contiguous; `plan` is the bank's
    `native.layer_plan(A, B)`, None when its layout does not fit). Returns False, having done
    nothing, when they do not.

    x: [..., in] and base_out: [..., out], the layer's input and its base output, from the
    same forward as `routing`. A decode step runs this for every adapted layer, so whatever is
    fixed per layer or per forward (pointers, strides, segments) comes pre-packed in the
    plans, and nothing is reshaped."""
    if plan is None or base_out.requires_grad or base_out.dtype not in native.DTYPE_CODES:
        return False
    fast = _native_for(kernel, x, A)
    if fast is None or not (x.is_contiguous() and base_out.is_contiguous()):
        return False
    # The library indexes memory by the routing: sizes must be those it was built for.
    tokens = routing.num_tokens
    if (
        x.numel() != tokens * plan.in_features
        or base_out.numel() != tokens * plan.out_features
        or A.shape[0] != routing.num_slots
    ):
        raise ValueError(
            f"routing was built for {routing.num_slots} slots and {tokens} tokens, but the "
            f"bank has {A.shape[0]} slots, x is {tuple(x.shape)} and the output "
            f"{tuple(base_out.shape)} (layer: in {plan.in_features}, out {plan.out_features})"
        )
    native.lora_add(fast, plan, routing.native_plan, x, base_out)
    return True


def lora_delta(
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    routing: Routing,
    kernel: KernelName = "auto",
) -> torch.Tensor | None:
    """LoRA deltas of the routed tokens, in `routing.order` (sorted by slot).

    x: [num_tokens, in] activations; A: [slots, r, in]; B: [slots, out, r] (slot 0 included and
    ignored). Returns fp32 [num_active, out] or None when no token uses an adapter.
    """
    if B.shape[0] != routing.num_slots:
        raise ValueError(
            f"routing was built for {routing.num_slots} slots but the bank has {B.shape[0]}"
        )
    hidden = lora_hidden(x, A, routing, kernel)
    return None if hidden is None else lora_output(hidden, B, routing, kernel)


def apply_lora(
    base_out: torch.Tensor,
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    routing: Routing,
    kernel: KernelName = "auto",
) -> torch.Tensor:
    """base_out + LoRA deltas scattered back to their tokens' rows (flat [tokens, out])."""
    delta = lora_delta(x, A, B, routing, kernel)
    return base_out if delta is None else add_deltas(base_out, delta, routing)
