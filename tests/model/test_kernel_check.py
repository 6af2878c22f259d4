"""The fused LoRA kernel's start-up check (model/kernel_check.py), on the CPU: the seam takes
any kernel, so a right one passes, and a wrong, a wrong-gradient or a raising one is refused
and the model falls back to the torch path with one log line. Under Triton's interpreter the
real fused kernel passes the same check."""

from __future__ import annotations

import logging

import pytest
import torch

from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.kernel_check import (
    KernelCheckFailed,
    check_fused_kernel,
    prove_fused_kernel,
)
from lorafleet.model.kernels import lora_delta, triton_available
from lorafleet.model.routing import Routing
from lorafleet.model.targets import resolve_tinker_targets
from tests._models import tiny_qwen3
from tests.model.test_triton_lora import fused  # noqa: F401 - the interpreter fixture

SHAPES = [(64, 96), (96, 64), (64, 32)]


def torch_kernel(
    out: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, routing: Routing
) -> torch.Tensor:
    """A correct "fused" kernel: the grouped torch path, added out of place."""
    delta = lora_delta(x, A, B, routing, "grouped" if x.dtype == torch.float32 else "loop")
    assert delta is not None
    return out.index_add(0, routing.order, delta.to(out.dtype))


def off_by(factor: float):
    def kernel(out, x, A, B, routing):
        return torch_kernel(out, x, A * factor, B, routing)

    return kernel


class _WrongGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.5


def wrong_gradient(out, x, A, B, routing):
    return torch_kernel(out, _WrongGradient.apply(x), A, B, routing)


def raising(out, x, A, B, routing):
    raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 232448")


def nan_kernel(out, x, A, B, routing):
    return torch_kernel(out, x, A, B, routing) * float("nan")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_correct_kernel_passes_in_values_and_gradients(dtype):
    errors = check_fused_kernel(SHAPES, 8, dtype, torch.device("cpu"), fused=torch_kernel)
    assert set(errors) == {f"{i}x{o} {t}" for i, o in SHAPES for t in ("out", "dx", "dA", "dB")}
    assert max(errors.values()) < (2e-4 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize(
    "kernel,why",
    [
        (off_by(1.01), "out differs from the torch path"),
        (wrong_gradient, "dx differs from the torch path"),
        (raising, "the fused kernel raised RuntimeError: out of resource"),
        (nan_kernel, "out differs"),
    ],
    ids=["values", "gradient", "raises", "nan"],
)
def test_a_wrong_or_failing_kernel_is_refused_saying_why(kernel, why):
    with pytest.raises(KernelCheckFailed, match=why):
        check_fused_kernel(SHAPES, 8, torch.float32, torch.device("cpu"), fused=kernel)


def test_bad_check_arguments_are_refused():
    with pytest.raises(ValueError, match="no kernel-check tolerance"):
        check_fused_kernel(SHAPES, 8, torch.float16, torch.device("cpu"), fused=torch_kernel)
    with pytest.raises(ValueError, match="rank must be >= 1"):
        check_fused_kernel(SHAPES, 0, torch.float32, torch.device("cpu"), fused=torch_kernel)


def _adapted(kernel: str = "auto") -> AdaptedModel:
    model = tiny_qwen3(seed=0, layers=1)
    adapted = AdaptedModel(model, resolve_tinker_targets(model), kernel=kernel)  # type: ignore[arg-type]
    adapted.add_bank("train", num_slots=3, r_max=8)
    return adapted


def test_a_failing_kernel_leaves_the_model_on_the_torch_path_with_one_log_line(caplog):
    adapted = _adapted()
    with caplog.at_level(logging.WARNING, logger="lorafleet.model.kernel_check"):
        verdict = prove_fused_kernel(adapted, 8, fused=off_by(1.05))
    assert verdict.checked and not verdict.fused and verdict.kernel == "torch"
    assert "failed its start-up check" in verdict.reason and "differs" in verdict.reason
    assert {layer.kernel for layer in adapted.layers.values()} == {"torch"}
    lines = [r for r in caplog.records if r.name == "lorafleet.model.kernel_check"]
    assert len(lines) == 1 and "torch (grouped_mm)" in lines[0].getMessage()
    # the torch path still trains: a forward through every layer gives finite logits
    ids = torch.zeros(1, 4, dtype=torch.int64)
    with adapted.routing("train", ids):
        assert torch.isfinite(adapted.model(input_ids=ids).logits).all()


def test_a_passing_kernel_keeps_auto_and_the_check_does_not_run_where_it_cannot_apply():
    adapted = _adapted()
    verdict = prove_fused_kernel(adapted, 8, fused=torch_kernel)
    assert verdict.checked and verdict.kernel == "auto" and "passed" in verdict.reason
    assert not verdict.fused  # (on the CPU `auto` never runs the fused kernel)
    assert {layer.kernel for layer in adapted.layers.values()} == {"auto"}
    cpu = prove_fused_kernel(_adapted(), 8)  # nothing injected: the CPU has nothing to prove
    assert not cpu.checked and "CUDA-only" in cpu.reason
    explicit = prove_fused_kernel(_adapted("loop"), 8, fused=raising)
    assert not explicit.checked and "chosen explicitly" in explicit.reason


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_the_real_fused_kernel_passes_its_check_under_the_interpreter(fused):  # noqa: F811
    errors = check_fused_kernel(
        [(64, 48)], 8, torch.float32, torch.device("cpu"), fused=fused.add_routed_lora
    )
    assert max(errors.values()) < 2e-4
