"""The native CPU LoRA kernels (model/lora_cpu.c via model/native.py): values against torch,
bf16 rounding as torch rounds, a token's result independent of the rest of the batch, the
dispatch rules (never under autograd), and the build cache and switches."""

from __future__ import annotations

import shutil
import stat

import pytest
import torch

from lorafleet.model import kernels, native
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.routing import build_routing
from lorafleet.model.targets import resolve_tinker_targets
from tests._models import tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler here: the native kernels cannot be built"
)


# Every instruction-set path this CPU can run (avx512, avx2, generic on an AVX-512 machine):
# the value and bit-identity tests below run on each one, not only on the one chosen here.
RUNNABLE_PATHS = native.runnable_paths() if shutil.which("cc") else []


@pytest.fixture(params=RUNNABLE_PATHS)
def nk(request) -> native.NativeKernels:
    return native.kernels_for(request.param)


def _routing(slot_ids: list[int], slots: int) -> tuple:
    scales = torch.tensor([0.0] + [0.5 + s for s in range(1, slots)])
    return build_routing(torch.tensor(slot_ids), scales, bank="test"), scales


def _reference_hidden(x, A, routing, scales, slot_ids):
    slot_of = torch.tensor(slot_ids)[routing.order]
    rows = x[routing.order].double()
    return torch.einsum("ti,tri->tr", rows, A[slot_of].double()) * scales[slot_of, None].double()


# --------------------------------------------------------------------------- values


@needs_compiler
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features,R", [(40, 8), (64, 48), (100, 12), (576, 16)])
def test_shrink_matches_torch(nk, x_dtype, in_features, R):
    gen = torch.Generator().manual_seed(in_features + R)
    # 0 is the base slot; slot 2 has 7 tokens (a 4-token tile plus 3), slot 3 one, slot 1 none
    slot_ids = [2, 0, 3, 2, 2, 0, 2, 2, 2, 2]
    routing, scales = _routing(slot_ids, 4)
    A = torch.randn(4, R, in_features, generator=gen)
    x = torch.randn(len(slot_ids), in_features, generator=gen).to(x_dtype)
    hidden = native.shrink(nk, x, routing.order, routing.segments, A, routing.token_scale)
    want = _reference_hidden(x.float(), A, routing, scales, slot_ids)
    torch.testing.assert_close(hidden.double(), want, rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out,R", [(24, 8), (40, 6), (200, 16), (1536, 16)])
def test_expand_add_matches_torch(nk, y_dtype, out, R):
    gen = torch.Generator().manual_seed(out + R)
    slot_ids = [1, 3, 0, 1, 1, 3, 1, 1, 2]
    routing, _ = _routing(slot_ids, 4)
    # rank-major storage viewed as [slots, out, R], as banks.py lays B out
    B = torch.randn(4, R, out, generator=gen).transpose(1, 2)
    # a column slice of a wider hidden (one member of an input group)
    wide = torch.randn(routing.num_active, R + 8, generator=gen)
    hidden = wide[:, 8:]
    y = torch.randn(len(slot_ids), out, generator=gen).to(y_dtype)
    want = y.clone()
    native.expand_add(nk, hidden, B, routing.order, routing.segments, y)
    slot_of = torch.tensor(slot_ids)[routing.order]
    delta = torch.einsum("tr,tor->to", hidden.double(), B[slot_of].double()).float()
    want.index_add_(0, routing.order, delta.to(y_dtype))
    if y_dtype == torch.float32:
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    else:  # a different fp32 rounding of delta may move a bf16 result by one step
        torch.testing.assert_close(y.float(), want.float(), rtol=1e-2, atol=1e-2)
        assert (y != want).float().mean() < 0.05
    untouched = [i for i, s in enumerate(slot_ids) if s == 0]
    assert torch.equal(y[untouched], want[untouched])


@needs_compiler
def test_expand_rounds_into_bf16_as_torch_add_does(nk):
    """With R = 1 and hidden = 1 the delta is exactly B, so the only rounding left is the one
    into bf16, which must be torch's `y.add_(delta.to(bf16))` bit for bit (ties included)."""
    gen = torch.Generator().manual_seed(3)
    out = 4096
    B = (torch.randn(2, 1, out, generator=gen) * torch.logspace(-6, 3, out)).transpose(1, 2)
    routing, _ = _routing([1, 1], 2)
    hidden = torch.ones(2, 1)
    y = (torch.randn(2, out, generator=gen) * torch.logspace(-4, 4, out)).to(torch.bfloat16)
    want = y.clone().add_(B[1, :, 0].to(torch.bfloat16))
    native.expand_add(nk, hidden, B, routing.order, routing.segments, y)
    assert torch.equal(y, want)


@needs_compiler
def test_a_tokens_result_does_not_depend_on_the_batch(nk):
    """Alone, with more tokens of its slot (other tile sizes), or among other slots: the same
    bits. This is what lets a request's output match the same request run alone."""
    gen = torch.Generator().manual_seed(11)
    in_features, R, out = 72, 16, 88
    A = torch.randn(4, R, in_features, generator=gen)
    B = torch.randn(4, R, out, generator=gen).transpose(1, 2)
    x = torch.randn(12, in_features, generator=gen).to(torch.bfloat16)
    # y in fp32, so a one-ulp difference in the delta is not rounded away
    y_dtype = torch.float32

    def run(slot_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        routing, _ = _routing(slot_ids, 4)
        rows = x[: len(slot_ids)]
        hidden = native.shrink(nk, rows, routing.order, routing.segments, A, routing.token_scale)
        y = torch.zeros(len(slot_ids), out, dtype=y_dtype)
        native.expand_add(nk, hidden, B, routing.order, routing.segments, y)
        position = int((routing.order == 0).nonzero())
        return hidden[position], y[0]

    alone = run([2])
    # every tile size has its own unrolled code (1..8 tokens, then a 9th in a second tile):
    # left to the compiler, one of them once fused its multiply-adds differently
    same_slot = [[2] * count for count in range(2, 10)]
    for batch in (*same_slot, [2, 1, 3, 0, 2, 2, 2, 2, 2, 1, 3, 2]):
        hidden, y = run(batch)
        assert torch.equal(hidden, alone[0]), batch
        assert torch.equal(y, alone[1]), batch


@needs_compiler
@pytest.mark.parametrize("slot_ids", [[2, 0, 1], [3, 1, 2, 0, 1, 3, 3, 2, 1, 1, 1, 2, 3, 3, 2]])
def test_results_do_not_depend_on_the_thread_count(nk, slot_ids):
    """Few tiles and many threads split each tile's rank rows (shrink) and output columns
    (expand, 13 blocks of 16 here, the last partial) unevenly: the bits stay those of one
    thread."""
    if native._torch_uses_libgomp():
        assert nk.openmp, "torch runs on libgomp, so the OpenMP build should have been used"
    gen = torch.Generator().manual_seed(5)
    in_features, R, out = 100, 12, 200
    A = torch.randn(4, R, in_features, generator=gen)
    B = torch.randn(4, R, out, generator=gen).transpose(1, 2)
    x = torch.randn(len(slot_ids), in_features, generator=gen).to(torch.bfloat16)
    y0 = torch.randn(len(slot_ids), out, generator=gen).to(torch.bfloat16)
    routing, _ = _routing(slot_ids, 4)
    results = {}
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3, 7):
            torch.set_num_threads(count)
            hidden = native.shrink(nk, x, routing.order, routing.segments, A, routing.token_scale)
            y = y0.clone()
            native.expand_add(nk, hidden, B, routing.order, routing.segments, y)
            results[count] = (hidden, y)
    finally:
        torch.set_num_threads(threads)
    for count, (hidden, y) in results.items():
        assert torch.equal(hidden, results[1][0]), count
        assert torch.equal(y, results[1][1]), count
    assert not torch.equal(results[1][1], y0)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features,R,out", [(40, 8, 24), (100, 12, 200), (576, 16, 1536)])
@pytest.mark.parametrize("threads", [1, 3])
def test_lora_add_is_shrink_then_expand_bit_for_bit(nk, dtype, in_features, R, out, threads):
    """The one-call path a layer takes is the two halves above, not a third implementation."""
    gen = torch.Generator().manual_seed(in_features * R + out)
    slot_ids = [2, 0, 3, 2, 2, 0, 2, 2, 2, 2, 1, 3, 1, 2, 2, 2, 2, 2, 2, 2, 2]
    routing, _ = _routing(slot_ids, 4)
    A = torch.randn(4, R, in_features, generator=gen)
    B = torch.randn(4, R, out, generator=gen).transpose(1, 2)
    # rows of x and y wider than the layer: row strides are passed through, not assumed
    x = torch.randn(len(slot_ids), in_features + 3, generator=gen).to(dtype)[:, :in_features]
    y0 = torch.randn(len(slot_ids), out + 5, generator=gen).to(dtype)[:, :out]
    plan = native.layer_plan(A, B)
    assert plan is not None
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = y0.clone()
        hidden = native.shrink(nk, x, routing.order, routing.segments, A, routing.token_scale)
        native.expand_add(nk, hidden, B, routing.order, routing.segments, want)
        got = y0.clone()
        native.lora_add(nk, plan, routing.native_plan, x, got)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(got, want)
    assert not torch.equal(got, y0)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_instruction_set_path_gives_the_same_bits(dtype):
    """avx512, avx2 and generic builds of one source: the same hidden and output bits, so a
    result never depends on which machine of a fleet computed it."""
    if len(RUNNABLE_PATHS) < 2:
        pytest.skip(f"only {RUNNABLE_PATHS} can run here")
    gen = torch.Generator().manual_seed(23)
    slot_ids = [2, 0, 3, 2, 2, 0, 2, 2, 2, 2, 1, 3, 1, 2, 2, 2, 2, 2, 2, 2, 2, 1]
    routing, _ = _routing(slot_ids, 4)
    results = {}
    for in_features, R, out in [(40, 8, 24), (100, 12, 200), (576, 16, 1536), (72, 3, 19)]:
        A = torch.randn(4, R, in_features, generator=gen)
        B = torch.randn(4, R, out, generator=gen).transpose(1, 2)
        x = torch.randn(len(slot_ids), in_features, generator=gen).to(dtype)
        y0 = torch.randn(len(slot_ids), out, generator=gen).to(dtype)
        plan = native.layer_plan(A, B)
        assert plan is not None
        for path in RUNNABLE_PATHS:
            nk = native.kernels_for(path)
            hidden = native.shrink(nk, x, routing.order, routing.segments, A, routing.token_scale)
            y = y0.clone()
            native.expand_add(nk, hidden, B, routing.order, routing.segments, y)
            fused = y0.clone()
            native.lora_add(nk, plan, routing.native_plan, x, fused)
            results.setdefault((in_features, R, out), {})[path] = (hidden, y, fused)
    for shape, by_path in results.items():
        first = RUNNABLE_PATHS[0]
        for path, (hidden, y, fused) in by_path.items():
            assert torch.equal(hidden, by_path[first][0]), (shape, path)
            assert torch.equal(y, by_path[first][1]), (shape, path)
            assert torch.equal(fused, by_path[first][2]), (shape, path)


def test_the_chosen_path_follows_the_cpu_and_the_override(monkeypatch):
    runnable = native.runnable_paths()
    assert native.chosen_path() == runnable[0]
    monkeypatch.setenv(native.ENV_ISA, runnable[-1])
    assert native.chosen_path() == runnable[-1]
    monkeypatch.setenv(native.ENV_ISA, "no-such-path")
    with pytest.raises(native.NativeKernelError, match="LORAFLEET_NATIVE_ISA='no-such-path'"):
        native.chosen_path()


def test_an_unrunnable_forced_path_turns_the_kernels_off_with_the_reason(monkeypatch, fresh_load):
    monkeypatch.setenv(native.ENV_ISA, "no-such-path")
    assert native.kernels() is None
    assert "is not a path this CPU can run" in native.status()
    assert native.path_name() == "torch"


def test_layer_plan_only_for_the_layout_the_kernels_read():
    A = torch.zeros(3, 8, 16)
    B = torch.zeros(3, 8, 24).transpose(1, 2)  # rank-major, as banks.py stores it
    plan = native.layer_plan(A, B)
    assert plan is not None
    assert (plan.R, plan.in_features, plan.out_features) == (8, 16, 24)
    assert (plan.a_slot_stride, plan.b_slot_stride, plan.b_rank_stride) == (128, 192, 24)
    assert plan.b_row_rest == 192  # B's own block unless told what follows it
    assert native.layer_plan(A, B, row_rest=500).b_row_rest == 500
    with pytest.raises(ValueError, match="row_rest 100"):
        native.layer_plan(A, B, row_rest=100)
    assert native.layer_plan(A, torch.zeros(3, 24, 8)) is None  # out-major B
    assert native.layer_plan(A.to(torch.bfloat16), B) is None
    assert native.layer_plan(A.transpose(1, 2).contiguous().transpose(1, 2), B) is None
    assert native.layer_plan(A[:, :4], B) is None  # ranks of A and B disagree


def test_routing_plan_refuses_tensors_the_kernels_cannot_read():
    routing, _ = _routing([1, 2, 0, 1], 3)
    plan = routing.native_plan
    assert plan is routing.native_plan  # built once per forward
    assert (plan.count, plan.num_segments) == (3, 2)
    with pytest.raises(native.NativeKernelError, match="order"):
        native.routing_plan(routing.order.to(torch.int32), routing.segments, routing.token_scale)
    with pytest.raises(native.NativeKernelError, match="token_scale"):
        native.routing_plan(routing.order, routing.segments, routing.token_scale.double())


# --------------------------------------------------------------------------- dispatch


def _adapted():
    torch.manual_seed(0)
    model = tiny_llama()
    adapted = AdaptedModel(model, resolve_tinker_targets(model))
    bank = adapted.add_bank("train", num_slots=4, r_max=8)
    gen = torch.Generator().manual_seed(7)
    for spec in (AdapterSpec(rank=4, alpha=8.0, seed=1), AdapterSpec(rank=8, alpha=8.0, seed=2)):
        slot = bank.allocate(spec)
        weights = {
            p: (
                torch.randn(A.shape, generator=gen) * 0.3,
                torch.randn(B.shape, generator=gen) * 0.3,
            )
            for p, (A, B) in bank.slot_weights(slot).items()
        }
        bank.load_slot_weights(slot, weights)
    return adapted, bank


def _set_kernel(adapted: AdaptedModel, kernel: str) -> None:
    for module in adapted.model.modules():
        if hasattr(module, "kernel") and hasattr(module, "base_layer"):
            module.kernel = kernel


@needs_compiler
def test_no_grad_forward_runs_native_and_matches_torch(monkeypatch):
    """One native call per adapted layer and forward (input groups included), and the same
    logits as the torch kernels."""
    adapted, bank = _adapted()
    slot_ids = torch.tensor([[1] * 5, [0] * 5, [2] * 5, [1] * 5])
    input_ids = torch.randint(0, 90, (4, 5), generator=torch.Generator().manual_seed(1))
    calls: list[native.LayerPlan] = []
    native.require()  # built and self-checked now: the first load's self-check calls lora_add too
    real_lora_add = native.lora_add

    def counting_lora_add(nk, layer, *args):
        calls.append(layer)
        return real_lora_add(nk, layer, *args)

    monkeypatch.setattr(native, "lora_add", counting_lora_add)
    with torch.no_grad(), adapted.routing("train", slot_ids):
        fast = adapted.model(input_ids).logits
    assert len(calls) == len(bank.layers)
    for path, layer_bank in bank.layer_banks.items():  # prefetch reaches the end of the row
        assert layer_bank.native_plan.b_row_rest == bank.row_size - layer_bank.b_span[0], path
    assert {id(plan) for plan in calls} == {id(lb.native_plan) for lb in bank.layer_banks.values()}
    _set_kernel(adapted, "loop")
    calls.clear()
    with torch.no_grad(), adapted.routing("train", slot_ids):
        reference = adapted.model(input_ids).logits
    assert calls == []  # a torch kernel never runs native
    torch.testing.assert_close(fast, reference, rtol=1e-4, atol=1e-4)


@needs_compiler
def test_training_forward_never_runs_native(monkeypatch):
    """Autograd needs the torch path: a forward whose bank wants gradients must not go
    native even with kernel='native'."""
    adapted, bank = _adapted()
    _set_kernel(adapted, "native")

    def refuse(*args):
        raise AssertionError("native kernel ran under autograd")

    for name in ("shrink", "expand_add", "lora_add"):
        monkeypatch.setattr(native, name, refuse)
    slot_ids = torch.tensor([[1] * 4, [2] * 4])
    input_ids = torch.randint(0, 90, (2, 4), generator=torch.Generator().manual_seed(2))
    with adapted.routing("train", slot_ids):
        adapted.model(input_ids).logits.sum().backward()
    assert bank.grads.abs().sum() > 0


def test_native_for_rules():
    A = torch.zeros(3, 8, 16)
    x = torch.zeros(4, 16)
    assert kernels._native_for("grouped", x, A) is None
    assert kernels._native_for("loop", x, A) is None
    assert kernels._native_for("auto", x.double(), A) is None
    assert kernels._native_for("auto", x, A.to(torch.bfloat16)) is None
    assert kernels._native_for("auto", x.t(), torch.zeros(3, 8, 4)) is None  # strided columns
    trainable = A.clone().requires_grad_(True)
    assert kernels._native_for("native", x, trainable) is None
    with torch.no_grad():
        assert kernels._native_for("native", x, trainable) is native.kernels()


# --------------------------------------------------------------------------- build and switches


@pytest.fixture
def fresh_load(monkeypatch, tmp_path):
    """A clean `_load` cache and a private lorafleet cache; restored afterwards."""
    monkeypatch.setenv("LORAFLEET_CACHE", str(tmp_path / "cache"))
    native._load.cache_clear()
    native._load_path.cache_clear()
    yield tmp_path
    native._load.cache_clear()
    native._load_path.cache_clear()


def test_switch_turns_the_kernels_off(monkeypatch, fresh_load):
    monkeypatch.setenv("LORAFLEET_NATIVE_KERNELS", "0")
    assert native.kernels() is None
    assert "turned off by LORAFLEET_NATIVE_KERNELS=0" in native.status()
    with pytest.raises(native.NativeKernelError, match="turned off"):
        kernels._native_for("native", torch.zeros(2, 8), torch.zeros(2, 4, 8))
    # auto quietly keeps to torch
    assert kernels._native_for("auto", torch.zeros(2, 8), torch.zeros(2, 4, 8)) is None


def test_a_failing_compiler_is_reported_not_hidden(monkeypatch, fresh_load):
    monkeypatch.setenv("CC", shutil.which("false") or "false")
    assert native.kernels() is None
    assert "failed on lora_cpu.c" in native.status()


def test_missing_compiler_is_reported(monkeypatch, fresh_load):
    monkeypatch.setenv("CC", "no-such-compiler-anywhere")
    assert native.kernels() is None
    assert "no C compiler" in native.status()


@needs_compiler
def test_build_is_private_cached_and_keyed_by_source(monkeypatch, fresh_load):
    loaded = native.kernels()
    assert loaded is not None, native.status()
    library = loaded.path
    assert library.parent == fresh_load / "cache" / "native"
    assert stat.S_IMODE(library.stat().st_mode) & 0o077 == 0
    assert stat.S_IMODE(library.parent.stat().st_mode) == 0o700
    assert [p.name for p in library.parent.iterdir()] == [library.name]  # no temp left behind
    # a changed source gets its own library; the old one is never reused for it
    changed = fresh_load / "lora_cpu.c"
    changed.write_text(native.SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(native, "SOURCE", changed)
    native._load.cache_clear()
    native._load_path.cache_clear()
    rebuilt = native.kernels()
    assert rebuilt is not None and rebuilt.path != library


def test_bank_storage_is_zeroed_float32_of_any_size():
    from lorafleet.model import hugepages

    for shape in ((3, 5), (9, 1 << 20)):  # below and above one huge page
        tensor = hugepages.zeros(*shape)
        assert tensor.shape == shape and tensor.dtype == torch.float32
        assert not tensor.any()
