"""Fused multi-adapter LoRA in Triton (SGMV-style), the CUDA kernel behind `kernel="triton"`.

One launch per layer does the whole LoRA of a routed batch: for each (slot segment, block of
rows) a program gathers its rows of x by the routing's `order`, shrinks them through the
slot's A (`h = scale * A[s] @ x`, fp32), expands through B (`B[s] @ h`) and adds the result
into the base output rows in place. A segment's B is read once per block of rows (a decode
segment is one block) and its A once per block and column split (`column_splits`: when there
are too few segments to fill the GPU, as at decode, the expand is split over output columns
and each split redoes the small shrink), and nothing of size [tokens, rank] or [tokens, out]
is written to memory in between. On CUDA the torch path (kernels.py) costs two grouped matmuls, a gather,
a scale, a cast and a scatter-add per layer: at decode that is launch overhead, which is what
this kernel removes.

The segment table is the routing's `segments` (slot, start, end) rows, on the device. Programs
loop over their segment's rows with bounds read from that table, so the launch grid is fixed
by the number of table rows and `row_programs`: a row with start == end (an empty segment)
costs nothing, which lets a captured CUDA graph take a fresh table every step (see
sample/cuda_graphs.py). Slot 0 (the base) never appears in the table: base tokens are not in
`order`. Heterogeneous ranks need no mask: a slot's A rows and B columns past its rank are
zero (banks.py); `ranks` may still be passed to skip that work.

Backward (training): with g the gradient of the output,
    dh = scale * B[s]^T g,  dx = A[s]^T dh,  dA[s] = sum dh x^T,  dB[s] = sum g h^T
dx is the same fused kernel with B^T and A^T as its two matrices (strides swapped, no copy);
dA and dB are per-segment sums of outer products, one program per (segment, column tile), so
every gradient element is written by exactly one program (no atomics). The forward keeps h
(fp32 [routed, rank]) only when B needs a gradient.

Precision follows torch: fp32 products are exact fp32 unless
`torch.backends.cuda.matmul.allow_tf32` is on. Each token's result depends on its own row only
(fixed reduction order), so a token's delta does not depend on the batch it shares.

Triton is imported with this module; kernels.py imports it only when the fused path applies.
On CPU it runs only under Triton's interpreter (`TRITON_INTERPRET=1`, set before triton is
first imported), which is how tests/model/test_triton_lora.py checks it in CI.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from lorafleet.model.routing import Routing

INTERPRET_ENV = "TRITON_INTERPRET"

# Rows per program: decode segments are a few rows, training segments hundreds.
_SMALL_BLOCK_M = 16
_LARGE_BLOCK_M = 64
_BLOCK_K = 64
_BLOCK_N = 64
# Programs a launch should offer the GPU at least (a few per SM of a large one).
_TARGET_PROGRAMS = 256


def can_run_on(device: torch.device) -> bool:
    """CUDA always; the CPU only under the interpreter (tests)."""
    return device.type == "cuda" or (
        device.type == "cpu" and os.environ.get(INTERPRET_ENV, "0") == "1"
    )


def _precision(device: torch.device) -> str:
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


# Only builtins of triton.language in the kernels (tl.full, not the @jit tl.zeros): the
# interpreter cannot run a library @jit function decorated before it was turned on, as
# happens when something imported triton before the CPU tests set TRITON_INTERPRET.
# Triton reads these signatures: a parameter is a pointer or scalar unless annotated
# tl.constexpr, so the others cannot carry Python type hints.
@triton.jit
def _fused_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    out_ptr,
    w1_ptr,
    w2_ptr,
    order_ptr,
    seg_ptr,
    scale_ptr,
    rank_ptr,
    h_ptr,
    K,
    N,
    R,
    stride_xt,
    stride_xk,
    stride_ot,
    stride_on,
    stride_w1s,
    stride_w1r,
    stride_w1k,
    stride_w2s,
    stride_w2n,
    stride_w2r,
    stride_h,
    row_programs,
    n_per_split,
    HAS_RANKS: tl.constexpr,
    STORE_H: tl.constexpr,
    WRITE_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[order[m]] += W2[s] @ (scale[m] * W1[s] @ x[order[m]]) for the rows m of segment s."""
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    slot = tl.load(seg_ptr + seg * 3)
    start = tl.load(seg_ptr + seg * 3 + 1)
    end = tl.load(seg_ptr + seg * 3 + 2)
    n_start = pid_n * n_per_split
    n_end = tl.minimum(N, n_start + n_per_split)
    rank = R
    if HAS_RANKS:
        rank = tl.load(rank_ptr + slot)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    w1 = w1_ptr + slot * stride_w1s
    w2 = w2_ptr + slot * stride_w2s
    for m0 in range(start + pid_m * BLOCK_M, end, row_programs * BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < end
        tok = tl.load(order_ptr + m, mask=m_ok, other=0)
        scale = tl.load(scale_ptr + m, mask=m_ok, other=0.0)
        acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            xs = tl.load(
                x_ptr + tok[:, None] * stride_xt + k[None, :] * stride_xk,
                mask=m_ok[:, None] & k_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            wt = tl.load(
                w1 + r[None, :] * stride_w1r + k[:, None] * stride_w1k,
                mask=k_ok[:, None] & r_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.dot(xs, wt, input_precision=PRECISION)
        h = acc * scale[:, None]
        # (Two ifs: STORE_H is decided at compile time, pid_n at run time.)
        if STORE_H:  # noqa: SIM102
            if pid_n == 0:
                tl.store(h_ptr + m[:, None] * stride_h + r[None, :], h, mask=m_ok[:, None])
        if WRITE_OUT:
            for n0 in range(n_start, n_end, BLOCK_N):
                n = n0 + tl.arange(0, BLOCK_N)
                n_ok = n < n_end
                w = tl.load(
                    w2 + r[:, None] * stride_w2r + n[None, :] * stride_w2n,
                    mask=r_ok[:, None] & n_ok[None, :],
                    other=0.0,
                ).to(tl.float32)
                delta = tl.dot(h, w, input_precision=PRECISION)
                o_ptrs = out_ptr + tok[:, None] * stride_ot + n[None, :] * stride_on
                o_mask = m_ok[:, None] & n_ok[None, :]
                current = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
                tl.store(o_ptrs, (current + delta).to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _segment_outer_kernel(  # type: ignore[no-untyped-def]  # (as _fused_kernel)
    p_ptr,
    q_ptr,
    grad_ptr,
    order_ptr,
    seg_ptr,
    D,
    R,
    stride_p,
    stride_qt,
    stride_qd,
    stride_gs,
    stride_gr,
    stride_gd,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """grad[s] = sum over segment s's rows m of p[m] (x) q[order[m]]: [R, D], one program per
    (segment, column tile)."""
    seg = tl.program_id(0)
    pid_d = tl.program_id(1)
    slot = tl.load(seg_ptr + seg * 3)
    start = tl.load(seg_ptr + seg * 3 + 1)
    end = tl.load(seg_ptr + seg * 3 + 2)
    r = tl.arange(0, BLOCK_R)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    acc = tl.full((BLOCK_R, BLOCK_D), 0.0, tl.float32)
    for m0 in range(start, end, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < end
        tok = tl.load(order_ptr + m, mask=m_ok, other=0)
        p = tl.load(p_ptr + m[:, None] * stride_p + r[None, :], mask=m_ok[:, None], other=0.0)
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + d[None, :] * stride_qd,
            mask=m_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.dot(tl.trans(p), q, input_precision=PRECISION)
    g_ptrs = grad_ptr + slot * stride_gs + r[:, None] * stride_gr + d[None, :] * stride_gd
    tl.store(g_ptrs, acc, mask=(r[:, None] < R) & d_ok[None, :])


def _launch_fused(
    out: torch.Tensor,
    x: torch.Tensor,
    w1: tuple[torch.Tensor, tuple[int, int, int]],
    w2: tuple[torch.Tensor, tuple[int, int, int]],
    rank: int,
    order: torch.Tensor,
    segments: torch.Tensor,
    scale: torch.Tensor,
    ranks: torch.Tensor | None,
    *,
    row_programs: int,
    block_m: int,
    store_h: bool,
    write_out: bool,
) -> torch.Tensor | None:
    """One fused launch. `w1` = (tensor, strides of W1[s] as [s, r, k]) and `w2` = (tensor,
    strides of W2[s] as [s, n, r]): the forward passes A and B, the backward B^T and A^T."""
    block_r = _block_r(rank)
    h = (
        torch.empty(order.shape[0], block_r, dtype=torch.float32, device=x.device)
        if store_h
        else None
    )
    if segments.shape[0] == 0:
        return h
    (w1_t, (s1s, s1r, s1k)), (w2_t, (s2s, s2n, s2r)) = w1, w2
    if write_out:
        n_per_split, splits = column_splits(out.shape[1], segments.shape[0] * row_programs)
    else:  # only h is wanted, which split 0 stores: no split would have work
        n_per_split, splits = out.shape[1], 1
    grid = (segments.shape[0], row_programs, splits)
    _fused_kernel[grid](
        x,
        out,
        w1_t,
        w2_t,
        order,
        segments,
        scale,
        ranks if ranks is not None else segments,
        h if h is not None else scale,
        x.shape[1],
        out.shape[1],
        rank,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        s1s,
        s1r,
        s1k,
        s2s,
        s2n,
        s2r,
        block_r,
        row_programs,
        n_per_split,
        HAS_RANKS=ranks is not None,
        STORE_H=store_h,
        WRITE_OUT=write_out,
        BLOCK_M=block_m,
        BLOCK_K=_BLOCK_K,
        BLOCK_N=_BLOCK_N,
        BLOCK_R=block_r,
        PRECISION=_precision(x.device),
    )
    return h


def _segment_outer(
    p: torch.Tensor,
    q: torch.Tensor,
    grad: torch.Tensor,
    strides: tuple[int, int, int],
    rank: int,
    order: torch.Tensor,
    segments: torch.Tensor,
) -> None:
    if segments.shape[0] == 0:
        return
    width = q.shape[1]
    grid = (segments.shape[0], triton.cdiv(width, _BLOCK_N))
    _segment_outer_kernel[grid](
        p,
        q,
        grad,
        order,
        segments,
        width,
        rank,
        p.stride(0),
        q.stride(0),
        q.stride(1),
        *strides,
        BLOCK_M=_LARGE_BLOCK_M,
        BLOCK_D=_BLOCK_N,
        BLOCK_R=p.shape[1],
        PRECISION=_precision(q.device),
    )


def _strides(t: torch.Tensor, *dims: int) -> tuple[int, int, int]:
    return (t.stride(dims[0]), t.stride(dims[1]), t.stride(dims[2]))


class _FusedLoRA(torch.autograd.Function):
    """out += LoRA(x) in place, differentiable in out, x, A and B."""

    @staticmethod
    def forward(
        ctx: Any,
        out: torch.Tensor,
        x: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        order: torch.Tensor,
        segments: torch.Tensor,
        scale: torch.Tensor,
        ranks: torch.Tensor | None,
        row_programs: int,
        block_m: int,
    ) -> torch.Tensor:
        rank = A.shape[1]
        h = _launch_fused(
            out,
            x,
            (A, _strides(A, 0, 1, 2)),
            (B, _strides(B, 0, 1, 2)),
            rank,
            order,
            segments,
            scale,
            ranks,
            row_programs=row_programs,
            block_m=block_m,
            store_h=ctx.needs_input_grad[3],
            write_out=True,
        )
        ctx.mark_dirty(out)
        ctx.save_for_backward(x, A, B, order, segments, scale, h)
        ctx.ranks = ranks
        ctx.launch = (row_programs, block_m)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, A, B, order, segments, scale, h = ctx.saved_tensors
        need_x, need_a, need_b = ctx.needs_input_grad[1:4]
        rank = A.shape[1]
        row_programs, block_m = ctx.launch
        dx = dA = dB = None
        if need_x or need_a:
            dx = torch.zeros_like(x)
            # W1 = B^T ([s, r, n] over B's [s, n, r]), W2 = A^T ([s, k, r] over A's [s, r, k]).
            dh = _launch_fused(
                dx,
                grad,
                (B, _strides(B, 0, 2, 1)),
                (A, _strides(A, 0, 2, 1)),
                rank,
                order,
                segments,
                scale,
                ctx.ranks,
                row_programs=row_programs,
                block_m=block_m,
                store_h=need_a,
                write_out=need_x,
            )
            if need_a:
                assert dh is not None
                dA = torch.zeros_like(A)
                _segment_outer(dh, x, dA, _strides(dA, 0, 1, 2), rank, order, segments)
        if need_b:
            assert h is not None
            dB = torch.zeros_like(B)
            _segment_outer(h, grad, dB, _strides(dB, 0, 2, 1), rank, order, segments)
        return grad, dx if need_x else None, dA, dB, None, None, None, None, None, None


def column_splits(width: int, programs: int) -> tuple[int, int]:
    """(columns per program, programs per row block) for the expand over `width` output
    columns, when `programs` (segments x row programs) would leave the GPU idle: at decode a
    segment is one block of rows, so a layer would run as many programs as it has adapters.
    B is still read once in all; each split re-reads the segment's A (rank x in, from L2)."""
    blocks = triton.cdiv(width, _BLOCK_N)
    splits = max(1, min(blocks, _TARGET_PROGRAMS // max(programs, 1)))
    per_split = triton.cdiv(blocks, splits) * _BLOCK_N
    return per_split, triton.cdiv(width, per_split)


def row_programs_for(max_rows: int, block_m: int) -> int:
    """Programs per segment: enough that each takes one block of the longest segment."""
    return max(1, triton.cdiv(max_rows, block_m))


def block_m_for(max_rows: int) -> int:
    return _SMALL_BLOCK_M if max_rows <= _SMALL_BLOCK_M else _LARGE_BLOCK_M


def fused_lora_add(
    out: torch.Tensor,
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    order: torch.Tensor,
    segments: torch.Tensor,
    scale: torch.Tensor,
    *,
    max_rows: int,
    ranks: torch.Tensor | None = None,
    row_programs: int | None = None,
) -> torch.Tensor:
    """out (flat [tokens, out_features]) += the LoRA of x ([tokens, in]) in place; returns out
    (under autograd: the same storage, carrying the LoRA's history).

    A: [slots, r, in], B: [slots, out, r] (any strides, fp32); `order`: the routed tokens'
    flat indices, slot-sorted; `segments`: int64 [S, 3] (slot, start, end) into `order`, on
    the device; `scale`: fp32 [routed] (or [routed, 1]) per routed token; `max_rows`: a bound
    on the longest segment (it sizes the launch; rows past it would be skipped, so it must
    hold); `ranks`: optional int [slots] bound on each slot's rank. `row_programs` overrides
    the programs per segment (a captured graph fixes it for every step)."""
    if x.dim() != 2 or out.dim() != 2 or x.shape[0] != out.shape[0]:
        raise ValueError(
            f"x and out must be [tokens, features] with equal tokens, got {tuple(x.shape)} "
            f"and {tuple(out.shape)}"
        )
    if A.shape[2] != x.shape[1] or B.shape[1] != out.shape[1] or A.shape[1] != B.shape[2]:
        raise ValueError(
            f"A {tuple(A.shape)} and B {tuple(B.shape)} do not fit x {tuple(x.shape)} and "
            f"out {tuple(out.shape)}"
        )
    if segments.dim() != 2 or segments.shape[1] != 3:
        raise ValueError(f"segments must be [S, 3] (slot, start, end), got {tuple(segments.shape)}")
    if not can_run_on(x.device):
        raise ValueError(
            f"the Triton LoRA kernel runs on CUDA (or on the CPU under {INTERPRET_ENV}=1), "
            f"not on {x.device}"
        )
    block_m = block_m_for(max_rows)
    programs = row_programs_for(max_rows, block_m) if row_programs is None else row_programs
    scale = scale.reshape(-1)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (out, x, A, B))
    if not grad:
        _launch_fused(
            out,
            x,
            (A, _strides(A, 0, 1, 2)),
            (B, _strides(B, 0, 1, 2)),
            A.shape[1],
            order,
            segments,
            scale,
            ranks,
            row_programs=programs,
            block_m=block_m,
            store_h=False,
            write_out=True,
        )
        return out
    result: torch.Tensor = _FusedLoRA.apply(
        out, x, A, B, order, segments, scale, ranks, programs, block_m
    )
    return result


def add_routed_lora(
    out: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, routing: Routing
) -> torch.Tensor:
    """`fused_lora_add` with the plan of a `Routing` (the segment table moves to the device
    once per forward, see `Routing.device_segments`)."""
    return fused_lora_add(
        out,
        x,
        A,
        B,
        routing.order,
        routing.device_segments,
        routing.token_scale,
        max_rows=max(routing.counts, default=0),
    )
