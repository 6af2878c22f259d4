"""The fused Triton LoRA kernel earns its place at start-up, on the device it will run on.

`kernel="auto"` picks the fused kernel (triton_lora.py) for every plain adapted linear on
CUDA. It was written and tested through Triton's interpreter on a CPU; a compiler, driver or
GPU generation it has not met could miscompile it, or fail to compile it (shared memory at a
large rank), and either would corrupt or fail every request. So before the engines serve,
`prove_fused_kernel` runs it once per distinct layer shape of the model on a real mixed batch
(ragged segments, one longer than a row block, unsorted slots, base rows, an absent slot,
heterogeneous ranks with zero tails) against the torch path (`loop`) in the base dtype, values
and the gradients of x, A and B, and keeps it only if every relative error is within the
dtype's tolerance. Otherwise every layer runs `torch` (grouped_mm where it fits, else the
loop), and one log line says why. The verdict goes into the server's stats.

The check is a seam: `fused` may be any function with `add_routed_lora`'s signature, so a
failing or wrong kernel can be injected on the CPU (tests/model/test_kernel_check.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lorafleet.model.banks import LoRALinear
from lorafleet.model.kernels import lora_delta, triton_available
from lorafleet.model.routing import Routing, build_routing

if TYPE_CHECKING:
    from lorafleet.model.adapted import AdaptedModel

log = logging.getLogger(__name__)

FusedKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Routing], torch.Tensor
]
"""out (flat [tokens, out]), x [tokens, in], A [slots, r, in], B [slots, out, r], routing ->
out + LoRA(x), in place (triton_lora.add_routed_lora)."""

# max |fused - torch| / max |torch| per checked tensor. bf16: the output and dx are rounded to
# bf16 (one step is 2**-8 of the value); fp32: the two paths only sum in different orders
# (TF32, when torch allows it for matmuls, costs about 10 mantissa bits more).
TOLERANCES = {torch.float32: 2e-4, torch.bfloat16: 3e-2}
TF32_TOLERANCE = 5e-3

# The mixed batch: slot per token. Slot 2 holds 70 consecutive tokens (past one 64-row block
# of the training kernel), slot 0 rows are the base (not routed), slot 4 is absent.
_SLOTS = [3, 1, 0, 2, 3, 1, 1, 0, 2] + [2] * 70 + [1, 3, 0]
_NUM_SLOTS = 5
_GAP = 8  # floats between a slot's A and B in its row (banks.py aligns each block)


@dataclass(frozen=True)
class KernelVerdict:
    """Which LoRA kernel the adapted layers run, and why."""

    kernel: str  # the layers' kernel name after the check: "auto" (fused on CUDA) or "torch"
    fused: bool  # whether the fused Triton kernel runs
    checked: bool  # whether the start-up check ran
    reason: str
    max_errors: dict[str, float] = field(default_factory=dict)  # "<in>x<out> <tensor>" -> error

    def record(self) -> dict[str, Any]:
        return asdict(self)


class KernelCheckFailed(RuntimeError):
    """The fused kernel's results or gradients are off (or it raised)."""


def _tolerance(x_dtype: torch.dtype, device: torch.device) -> float:
    if x_dtype == torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return TF32_TOLERANCE
    return TOLERANCES[x_dtype]


def _relative_error(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    if got is None or want is None:
        return math.inf if (got is None) != (want is None) else 0.0
    got, want = got.detach().float(), want.detach().float()
    if got.shape != want.shape or not bool(torch.isfinite(got).all()):
        return math.inf
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = float((got - want).abs().max()) if want.numel() else 0.0
    return diff / max(scale, 1e-12)


def _batch(
    in_features: int,
    out_features: int,
    rank: int,
    x_dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> dict[str, torch.Tensor]:
    """One layer's mixed batch, made on the CPU from a seed (the same values on any device).
    A and B live in one flat [slots, P] row per slot as banks.py lays them out: A row-major
    at the row's start, B rank-major after it (so B [slots, out, rank] is a transposed view)
    and slot strides of the whole row."""
    gen = torch.Generator().manual_seed(seed)
    tokens = len(_SLOTS)
    A = torch.randn(_NUM_SLOTS, rank, in_features, generator=gen) / math.sqrt(in_features)
    B = torch.randn(_NUM_SLOTS, rank, out_features, generator=gen) / math.sqrt(rank)
    ranks = [0, rank, max(1, rank // 2), 1, rank]  # slot 0 is the base; tails past a rank are 0
    for slot, r in enumerate(ranks):
        A[slot, r:] = 0
        B[slot, r:] = 0
    a_len, b_len = rank * in_features, rank * out_features
    flat = torch.zeros(_NUM_SLOTS, a_len + _GAP + b_len)
    flat[:, :a_len] = A.reshape(_NUM_SLOTS, -1)
    flat[:, a_len + _GAP :] = B.reshape(_NUM_SLOTS, -1)
    return {
        "x": torch.randn(tokens, in_features, generator=gen).to(device, x_dtype),
        "flat": flat.to(device),
        "base": torch.randn(tokens, out_features, generator=gen).to(device, x_dtype),
        "weights": torch.randn(tokens, out_features, generator=gen).to(device),
        "slots": torch.tensor(_SLOTS, device=device),
        "scales": torch.tensor([0.0, 0.5, 2.0, 1.0, 3.0], device=device),
    }


def _views(
    flat: torch.Tensor, rank: int, in_features: int, out_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    a_len = rank * in_features
    A = flat[:, :a_len].view(_NUM_SLOTS, rank, in_features)
    B = flat[:, a_len + _GAP :].view(_NUM_SLOTS, rank, out_features).transpose(1, 2)
    return A, B


def _run(
    fused: FusedKernel | None, batch: dict[str, torch.Tensor], rank: int
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """out and (dx, dA, dB) through the fused kernel, or through `loop` when `fused` is None."""
    x = batch["x"].clone().requires_grad_()
    flat = batch["flat"].clone().requires_grad_()
    in_features, out_features = x.shape[1], batch["base"].shape[1]
    A, B = _views(flat, rank, in_features, out_features)
    routing = build_routing(batch["slots"], batch["scales"], bank="kernel-check")
    with torch.enable_grad():
        if fused is None:
            delta = lora_delta(x, A, B, routing, "loop")
            assert delta is not None
            out = batch["base"].clone().index_add(0, routing.order, delta.to(x.dtype))
        else:
            out = fused(batch["base"].clone(), x, A, B, routing)
        (out.float() * batch["weights"]).sum().backward()
    if flat.grad is None:
        return out.detach(), [x.grad, None, None]
    dA, dB = _views(flat.grad, rank, in_features, out_features)
    return out.detach(), [x.grad, dA, dB]


def check_fused_kernel(
    shapes: Sequence[tuple[int, int]],
    rank: int,
    x_dtype: torch.dtype,
    device: torch.device,
    *,
    fused: FusedKernel,
    seed: int = 0,
) -> dict[str, float]:
    """Runs `fused` and the torch path on the mixed batch for each (in, out) shape; returns
    each relative error, or raises KernelCheckFailed naming the first one past tolerance."""
    if x_dtype not in TOLERANCES:
        raise ValueError(f"no kernel-check tolerance for {x_dtype}; expected float32 or bfloat16")
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    tolerance = _tolerance(x_dtype, device)
    errors: dict[str, float] = {}
    for index, (in_features, out_features) in enumerate(sorted(set(shapes))):
        batch = _batch(in_features, out_features, rank, x_dtype, device, seed + index)
        want, want_grads = _run(None, batch, rank)
        try:
            got, got_grads = _run(fused, batch, rank)
        except Exception as exc:
            raise KernelCheckFailed(
                f"{in_features}x{out_features}: the fused kernel raised {type(exc).__name__}: {exc}"
            ) from exc
        for name, g, w in zip(
            ("out", "dx", "dA", "dB"), [got, *got_grads], [want, *want_grads], strict=True
        ):
            error = _relative_error(g, w)
            errors[f"{in_features}x{out_features} {name}"] = error
            if not error <= tolerance:
                raise KernelCheckFailed(
                    f"{in_features}x{out_features}: {name} differs from the torch path by "
                    f"{error:.3g} of its scale ({x_dtype}, tolerance {tolerance:g})"
                )
    return errors


def _layer_shapes(adapted: AdaptedModel) -> list[tuple[int, int]]:
    return sorted(
        {
            (layer.in_features, layer.out_features)
            for layer in adapted.layers.values()
            if isinstance(layer, LoRALinear)
        }
    )


def _base_dtype(adapted: AdaptedModel) -> torch.dtype:
    return next(adapted.model.parameters()).dtype


def prove_fused_kernel(
    adapted: AdaptedModel, rank: int, *, fused: FusedKernel | None = None
) -> KernelVerdict:
    """Keeps the fused kernel for `adapted` only if it passes `check_fused_kernel` here;
    otherwise sets every layer to `torch` and logs why. Runs where `auto` would pick the
    fused kernel (CUDA, triton importable, fp32 banks) or when a `fused` function is injected
    (tests); elsewhere it changes nothing and says why."""
    kernels = {layer.kernel for layer in adapted.layers.values()}
    device = next(adapted.model.parameters()).device
    x_dtype = _base_dtype(adapted)
    shapes = _layer_shapes(adapted)
    # the rank the kernel really runs at: the banks' rows, r_max padded to their alignment
    stored = [lb.A.shape[1] for bank in adapted.banks.values() for lb in bank.layer_banks.values()]
    rank = max(stored, default=rank)
    if kernels != {"auto"}:
        return KernelVerdict(
            kernel=",".join(sorted(kernels)),
            fused="triton" in kernels,
            checked=False,
            reason=f"kernel {','.join(sorted(kernels))} was chosen explicitly",
        )
    if fused is None:
        if device.type != "cuda":
            return KernelVerdict(
                "auto", False, False, f"{device.type}: the fused kernel is CUDA-only"
            )
        if not triton_available():
            return KernelVerdict("auto", False, False, "triton is not installed")
        from lorafleet.model import triton_lora  # imports triton: only on CUDA

        fused = triton_lora.add_routed_lora
    banks = [bank.params.dtype for bank in adapted.banks.values()]
    if not shapes or x_dtype not in TOLERANCES or any(d != torch.float32 for d in banks):
        return KernelVerdict(
            "auto", False, False, "no plain linear with fp32 banks and an fp32/bf16 base to fuse"
        )
    try:
        errors = check_fused_kernel(shapes, rank, x_dtype, device, fused=fused)
    except KernelCheckFailed as exc:
        adapted.set_kernel("torch")
        log.warning(
            "LoRA kernel: torch (grouped_mm); the fused Triton kernel failed its start-up check: %s",
            exc,
        )
        return KernelVerdict("torch", False, True, f"fused kernel failed its start-up check: {exc}")
    worst = max(errors.values(), default=0.0)
    log.info(
        "LoRA kernel: fused Triton, checked on %d layer shape(s) against the torch path "
        "(largest relative error %.2g)",
        len(shapes),
        worst,
    )
    return KernelVerdict(
        "auto",
        device.type == "cuda",  # (where `auto` runs the fused kernel at all)
        True,
        f"fused Triton kernel passed its start-up check on {len(shapes)} layer shape(s) "
        f"(largest relative error {worst:.2g})",
        errors,
    )
