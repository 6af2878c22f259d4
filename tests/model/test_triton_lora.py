"""The fused Triton LoRA kernel against the torch reference (`loop`), on the CPU through
Triton's interpreter: values and gradients, ragged and empty segments, heterogeneous ranks,
base rows, and a whole adapted model with `kernel="triton"`.

The interpreter is chosen when a kernel is decorated, i.e. when triton_lora is imported, so
the `fused` fixture imports a private copy of the module under `TRITON_INTERPRET=1` and takes
it out again afterwards: a later CUDA test in the same session gets the compiled kernels.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

import lorafleet.model as model_pkg
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.kernels import _fused_applies, apply_lora, triton_available
from lorafleet.model.routing import build_routing
from lorafleet.model.targets import resolve_tinker_targets
from tests._models import tiny_qwen3

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

MODULE = "lorafleet.model.triton_lora"


@pytest.fixture(scope="module")
def fused() -> Iterator[ModuleType]:
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    previous = sys.modules.pop(MODULE, None)
    module = importlib.import_module(MODULE)
    try:
        yield module
    finally:
        sys.modules.pop(MODULE, None)
        if hasattr(model_pkg, "triton_lora"):
            delattr(model_pkg, "triton_lora")
        if previous is not None:
            sys.modules[MODULE] = previous
            model_pkg.triton_lora = previous  # type: ignore[attr-defined]
        mp.undo()


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _bank(num_slots: int, rank: int, d_in: int, d_out: int, ranks: list[int] | None = None):
    """A and B laid out as banks.py does: B is a transposed view of rank-major storage;
    slot s's A rows and B columns past ranks[s] are zero."""
    A = _randn(num_slots, rank, d_in, seed=2, scale=0.1)
    B = _randn(num_slots, rank, d_out, seed=3, scale=0.1).transpose(1, 2)
    if ranks is not None:
        for slot, r in enumerate(ranks):
            A[slot, r:] = 0
            B[slot, :, r:] = 0
    return A, B


def _run(fused_mod, kernel, slots, scales, x_dtype, A0, B0, d_out, *, grads=True):
    x = _randn(len(slots), A0.shape[2], seed=1).to(x_dtype).requires_grad_(grads)
    A = A0.clone().requires_grad_(grads)
    B = B0.clone().requires_grad_(grads)
    base = _randn(len(slots), d_out, seed=5).to(x_dtype)
    routing = build_routing(torch.tensor(slots), torch.tensor(scales), bank="t")
    if kernel == "triton":
        out = fused_mod.add_routed_lora(base.clone(), x, A, B, routing)
    else:
        out = apply_lora(base.clone(), x, A, B, routing, "loop")
    if not grads:
        return [out]
    (out.float() * _randn(*out.shape, seed=4)).sum().backward()
    return [out.detach(), x.grad, A.grad, B.grad]


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "slots",
    [
        [3, 1, 0, 2, 3, 1, 1, 0, 2, 2, 3] + [2] * 20,  # ragged, unsorted, base rows, > 16 rows
        [1, 2, 3] * 4,  # uniform segments (decode-like)
        [0, 0, 2, 2, 2],  # slots 1 and 3 empty, sorted (routing slices instead of gathers)
    ],
)
def test_values_and_gradients_equal_the_loop_reference(fused, x_dtype, slots):
    A, B = _bank(4, 8, 40, 72)
    scales = [0.0, 0.5, 2.0, 1.0]
    want = _run(fused, "loop", slots, scales, x_dtype, A, B, 72)
    got = _run(fused, "triton", slots, scales, x_dtype, A, B, 72)
    tol = 1e-4 if x_dtype == torch.float32 else 2e-2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), atol=tol, rtol=tol)
    assert got[0].dtype == x_dtype
    # The LoRA did something, and base rows were left exactly as the base layer made them.
    base = _randn(len(slots), 72, seed=5).to(x_dtype)
    rows = torch.tensor(slots)
    assert not torch.equal(got[0][rows > 0], base[rows > 0])
    assert torch.equal(got[0][rows == 0], base[rows == 0])
    assert torch.equal(got[1][rows == 0], torch.zeros_like(got[1][rows == 0]))


def test_heterogeneous_ranks_and_ranks_bound(fused):
    """Slots of rank 2, 8 and 5 in an r_max-8 bank agree with the reference; given `ranks`,
    the kernel reads nothing past a slot's rank (garbage there changes nothing)."""
    ranks = [0, 2, 8, 5]
    A, B = _bank(4, 8, 24, 32, ranks)
    slots = [1, 2, 3, 3, 1, 2, 0, 3]
    scales = [0.0, 1.0, 0.25, 2.0]
    want = _run(fused, "loop", slots, scales, torch.float32, A, B, 32)
    got = _run(fused, "triton", slots, scales, torch.float32, A, B, 32)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    # The zero tail stays zero in the gradients (the bank relies on it).
    for slot, r in enumerate(ranks):
        assert torch.equal(got[2][slot, r:], torch.zeros_like(got[2][slot, r:]))
        assert torch.equal(got[3][slot, :, r:], torch.zeros_like(got[3][slot, :, r:]))

    noisy_A, noisy_B = A.clone(), B.clone()
    for slot, r in enumerate(ranks):
        noisy_A[slot, r:] = 7.0
        noisy_B[slot, :, r:] = 7.0
    routing = build_routing(torch.tensor(slots), torch.tensor(scales), bank="t")
    x = _randn(len(slots), 24, seed=1)
    out = fused.fused_lora_add(
        _randn(len(slots), 32, seed=5),
        x,
        noisy_A,
        noisy_B,
        routing.order,
        routing.segments,
        routing.token_scale,
        max_rows=max(routing.counts),
        ranks=torch.tensor(ranks),
    )
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)


def test_a_padded_segment_table_with_empty_rows_and_fixed_programs(fused):
    """The form a captured decode graph uses: a table with a row per slot, empty segments
    (start == end) included, and a fixed number of programs per segment."""
    A, B = _bank(4, 8, 16, 16)
    x = _randn(6, 16, seed=1)
    base = _randn(6, 16, seed=5)
    slots = torch.tensor([2, 2, 0, 3, 0, 0])
    scales = torch.tensor([0.0, 1.0, 0.5, 3.0])
    routing = build_routing(slots, scales, bank="t")
    want = apply_lora(base.clone(), x, A, B, routing, "loop")
    # order: rows 0, 1 (slot 2) and 3 (slot 3); slot 1 has an empty segment, and a spare row.
    table = torch.tensor([[1, 0, 0], [2, 0, 2], [3, 2, 3], [1, 3, 3]])
    out = fused.fused_lora_add(
        base.clone(),
        x,
        A,
        B,
        torch.tensor([0, 1, 3]),
        table,
        torch.tensor([0.5, 0.5, 3.0]),
        max_rows=6,
        row_programs=2,
    )
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    nothing = fused.fused_lora_add(
        base.clone(),
        x,
        A,
        B,
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, 3, dtype=torch.int64),
        torch.zeros(0),
        max_rows=0,
    )
    assert torch.equal(nothing, base)


def test_bad_shapes_and_devices_are_refused(fused, monkeypatch):
    A, B = _bank(2, 8, 16, 16)
    x = _randn(3, 16, seed=1)
    table = torch.tensor([[1, 0, 3]])
    order, scale = torch.arange(3), torch.ones(3)
    with pytest.raises(ValueError, match="do not fit"):
        fused.fused_lora_add(_randn(3, 8, seed=0), x, A, B, order, table, scale, max_rows=3)
    with pytest.raises(ValueError, match=r"segments must be \[S, 3\]"):
        fused.fused_lora_add(
            _randn(3, 16, seed=0), x, A, B, order, torch.zeros(3), scale, max_rows=3
        )
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="runs on CUDA"):
        fused.fused_lora_add(_randn(3, 16, seed=0), x, A, B, order, table, scale, max_rows=3)


def test_auto_never_picks_it_on_the_cpu():
    x, A = torch.zeros(2, 4), torch.zeros(2, 8, 4)
    assert not _fused_applies("auto", x, A)
    assert _fused_applies("triton", x, A)
    assert not _fused_applies("grouped", x, A)


def _adapted(kernel: str) -> AdaptedModel:
    model = tiny_qwen3(seed=0, layers=1)  # one layer: the interpreter runs every program
    adapted = AdaptedModel(model, resolve_tinker_targets(model), kernel=kernel)  # type: ignore[arg-type]
    bank = adapted.add_bank("train", num_slots=4, r_max=8)
    for seed, rank in ((1, 4), (2, 8)):
        slot = bank.allocate(AdapterSpec(rank=rank, alpha=8.0, seed=seed))
        weights = {
            path: (A, 0.3 * _randn(*B.shape, seed=seed + 10))
            for path, (A, B) in bank.slot_weights(slot).items()
        }
        bank.load_slot_weights(slot, weights)
    return adapted


def test_an_adapted_model_trains_the_same_with_the_fused_kernel(fused):
    """A mixed forward/backward of a whole model (two adapters and a base row) with
    kernel="triton" matches kernel="loop": logits and every bank gradient."""
    ids = torch.randint(0, 96, (3, 7), generator=torch.Generator().manual_seed(0))
    slot_ids = torch.tensor([[1], [0], [2]]).expand(3, 7)
    results = {}
    for kernel in ("loop", "triton"):
        adapted = _adapted(kernel)
        with adapted.routing("train", slot_ids):
            logits = adapted.model(input_ids=ids).logits
        (logits * _randn(*logits.shape, seed=9)).sum().backward()
        grads = adapted.bank("train").grads
        assert grads is not None
        results[kernel] = (logits.detach(), grads.clone())
    torch.testing.assert_close(results["triton"][0], results["loop"][0], atol=1e-4, rtol=1e-4)
    # fp32 sums over the batch in another order: compared relative to the largest gradient.
    want = results["loop"][1]
    scale = float(want.abs().max())
    torch.testing.assert_close(results["triton"][1], want, atol=2e-5 * scale, rtol=1e-3)
    assert results["triton"][1][1:3].abs().sum() > 0


def test_a_static_routing_refilled_each_step_matches_a_fresh_one(fused):
    """The CUDA-graph form (sample/cuda_graphs.py): one bucket's static buffers, refilled for
    steps with different routings (padding rows on the base), give what a routing built for
    each step gives."""
    from lorafleet.sample.cuda_graphs import StaticStep, pad_step

    A, B = _bank(4, 8, 16, 24)
    scales = [0.0, 0.5, 2.0, 1.0]
    step = StaticStep(8, num_slots=4, bank="t", device=torch.device("cpu"))
    for seed, slots in enumerate(([3, 1, 1, 0, 2], [2, 2, 2, 2, 2, 2, 2], [0, 0], [1, 3, 2, 1])):
        n = len(slots)
        x = _randn(8, 16, seed=seed)  # padded rows' inputs are whatever the step holds
        base = _randn(8, 24, seed=seed + 100)
        step.fill(pad_step([0] * n, [0] * n, slots, scales, 8))
        got = fused.add_routed_lora(base.clone(), x, A, B, step.routing)
        routing = build_routing(torch.tensor(slots + [0] * (8 - n)), torch.tensor(scales), bank="t")
        want = apply_lora(base.clone(), x, A, B, routing, "loop")
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got[n:], base[n:])


@pytest.mark.parametrize(
    ("rank", "d_in", "d_out", "slots"),
    [
        (1, 20, 30, [1, 2, 1, 0, 2]),  # rank 1
        (24, 65, 129, [2, 1, 1, 0, 2, 3, 3]),  # rank not a power of 2, widths past a block
        (4, 16, 16, [3]),  # a single token
        (8, 33, 17, [40, 5, 5]),  # many slots, nearly all without tokens
    ],
)
def test_shapes_off_the_block_grid_and_a_strided_input(fused, rank, d_in, d_out, slots):
    """Reviewer's shapes: tails in every dimension, one token, 63 idle slots and x a strided
    view (every other column), values and gradients against the loop reference."""
    num_slots = max(slots) + 1 if max(slots) >= 4 else 4
    scales = [0.0] + [0.25 * (1 + s % 3) for s in range(1, num_slots)]
    A, B = _bank(num_slots, rank, d_in, d_out)
    wide = _randn(len(slots), 2 * d_in, seed=7)
    results = {}
    for kernel in ("triton", "loop"):
        x = wide.clone().requires_grad_()
        A1, B1 = A.clone().requires_grad_(), B.clone().requires_grad_()
        base = _randn(len(slots), d_out, seed=8)
        routing = build_routing(torch.tensor(slots), torch.tensor(scales), bank="t")
        if kernel == "triton":
            out = fused.add_routed_lora(base, x[:, ::2], A1, B1, routing)
        else:
            out = apply_lora(base, x[:, ::2], A1, B1, routing, "loop")
        (out * _randn(*out.shape, seed=9)).sum().backward()
        results[kernel] = [out.detach(), x.grad, A1.grad, B1.grad]
    for got, want in zip(results["triton"], results["loop"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_gradcheck_in_float64(fused):
    """The kernel accumulates in fp32 whatever the inputs, so float64 gradcheck passes at
    fp32-level tolerances: a check of the backward's formulas, not of its precision."""
    slots = [2, 1, 0]
    routing = build_routing(torch.tensor(slots), torch.tensor([0.0, 1.0, 0.5]), bank="t")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    A = (0.3 * torch.randn(3, 2, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    B = (0.3 * torch.randn(3, 3, 2, generator=gen, dtype=torch.float64)).requires_grad_()
    base = torch.randn(3, 3, generator=gen, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda x, A, B: fused.add_routed_lora(base.clone(), x, A, B, routing),
        (x, A, B),
        eps=1e-3,
        atol=1e-3,
        rtol=1e-3,
    )
