"""The GPU paths: LoRA kernels (the fused Triton one included), training steps, sampling and
decode replayed from CUDA graphs, with the base and banks on CUDA.

CI has no GPU, so these are skipped there; on a machine with one, `pytest tests/test_cuda.py`
runs them. `LORAFLEET_TEST_DEVICE=cpu` runs the same checks on the CPU, which is how the
checks themselves are kept honest where no GPU is at hand (but for the Triton kernel and CUDA
graphs, whose CPU counterparts run through Triton's interpreter in
tests/model/test_triton_lora.py and tests/sample/test_cuda_graph_plan.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from lorafleet.engines import Colocated, colocate
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.kernels import lora_delta
from lorafleet.model.routing import build_routing
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample import SampleRequest, SamplingParams
from lorafleet.train.engine import TrainItem
from lorafleet.train.optim import AdamHParams
from lorafleet.verification import publish_verified
from tests._models import tiny_qwen3

VOCAB = 96
DEVICE = os.environ.get("LORAFLEET_TEST_DEVICE", "cuda")

pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA device"
)


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [[3, 1, 0, 2, 3, 1, 1, 0, 2, 2, 3], [1, 2, 3] * 4])
def test_grouped_and_loop_kernels_agree_in_values_and_gradients(x_dtype, slots):
    """Ragged segments (grouped_mm) and uniform ones (bmm), unsorted rows, base rows mixed in."""
    num_slots, rank, d_in, d_out = 4, 8, 64, 48
    slot_ids = torch.tensor(slots, device=DEVICE)
    scales = torch.tensor([0.0, 0.5, 2.0, 1.0], device=DEVICE)
    results = {}
    for kernel in ("grouped", "loop"):
        x = _randn(len(slots), d_in, seed=1).to(DEVICE, x_dtype).requires_grad_()
        A = _randn(num_slots, rank, d_in, seed=2, scale=0.1).to(DEVICE).requires_grad_()
        B = _randn(num_slots, d_out, rank, seed=3, scale=0.1).to(DEVICE).requires_grad_()
        routing = build_routing(slot_ids, scales, bank="t")
        delta = lora_delta(x, A, B, routing, kernel)
        assert delta is not None and delta.device.type == torch.device(DEVICE).type
        (delta * _randn(*delta.shape, seed=4).to(DEVICE)).sum().backward()
        results[kernel] = [delta.detach(), x.grad, A.grad, B.grad]
    for got, want in zip(results["grouped"], results["loop"], strict=True):
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=1e-4, rtol=1e-4)


def _stack(dtype: torch.dtype, device: str) -> Colocated:
    model = tiny_qwen3().to(device=device, dtype=dtype)
    return colocate(
        model, resolve_tinker_targets(model), base_model_id="tiny", r_max=8, sample_slots=4
    )


def _adapter(stack: Colocated, seed: int, rank: int = 4) -> int:
    slot = stack.trainer.create_adapter(AdapterSpec(rank=rank, alpha=8.0, seed=seed))
    gen = torch.Generator().manual_seed(seed)
    weights = {
        path: (A, 0.3 * torch.randn(B.shape, generator=gen))
        for path, (A, B) in stack.trainer.bank.slot_weights(slot).items()
    }
    stack.trainer.bank.load_slot_weights(slot, weights)
    return slot


def _sft(slot: int, seed: int, length: int) -> TrainItem:
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (length + 1,), generator=gen)
    return TrainItem(
        slot, seq[:-1], "cross_entropy", {"target_tokens": seq[1:], "weights": torch.ones(length)}
    )


def _rl(slot: int, seed: int, length: int) -> TrainItem:
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (length + 1,), generator=gen)
    inputs = {
        "target_tokens": seq[1:],
        "logprobs": -torch.rand(length, generator=gen) * 3,
        "advantages": torch.randn(length, generator=gen),
    }
    return TrainItem(slot, seq[:-1], "ppo", inputs)


def test_mixed_training_steps_on_the_device_match_the_cpu():
    """Two adapters (SFT and PPO) trained in one batch for three steps: logprobs, losses and
    the trained weights equal those of the same run on the CPU."""
    runs = {}
    for device in (DEVICE, "cpu"):
        stack = _stack(torch.float32, device)
        slots = [_adapter(stack, 1), _adapter(stack, 2, rank=8)]
        hparams = {
            slots[0]: AdamHParams(learning_rate=1e-2),
            slots[1]: AdamHParams(learning_rate=3e-3, weight_decay=0.1),
        }
        logprobs = []
        for step in range(3):
            out = stack.trainer.forward_backward(
                [
                    _sft(slots[0], 10 + step, 7),
                    _rl(slots[1], 20 + step, 5),
                    _sft(slots[1], 30 + step, 9),
                ]
            )
            logprobs.append(torch.cat([item.logprobs.cpu() for item in out.items]))
            stack.trainer.optim_step(hparams)
        weights = [
            w.cpu()
            for slot in slots
            for pair in stack.trainer.bank.slot_weights(slot).values()
            for w in pair
        ]
        runs[device] = (logprobs, weights)
    (dev_lp, dev_w), (cpu_lp, cpu_w) = runs[DEVICE], runs["cpu"]
    for got, want in zip(dev_lp, cpu_lp, strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    for got, want in zip(dev_w, cpu_w, strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-3)
    assert any(not torch.equal(w, torch.zeros_like(w)) for w in dev_w)


@pytest.fixture(scope="module")
def bf16_stack():
    stack = _stack(torch.bfloat16, DEVICE)
    keys = []
    for i in range(3):
        slot = _adapter(stack, 40 + i, rank=2 + 2 * i)
        key, result = publish_verified(stack.sampler, stack.trainer, slot, f"a{i}")
        assert result.differs_check == "passed", result
        keys.append((slot, key))
    return stack, keys


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(
        0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def test_bf16_mixed_batch_equals_each_request_alone(bf16_stack):
    stack, keys = bf16_stack
    greedy = SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    requests = [
        SampleRequest(_prompt(i, 3 + 2 * i), greedy, adapter=a)
        for i, a in enumerate([k for _, k in keys] + [None])
    ]
    mixed = stack.sampler.generate(requests)
    for request, result in zip(requests, mixed, strict=True):
        (alone,) = stack.sampler.generate([request])
        assert result.ok and alone.ok
        assert result.sequences[0].tokens == alone.sequences[0].tokens
        assert result.sequences[0].adapter == request.adapter
        torch.testing.assert_close(
            torch.tensor(result.sequences[0].logprobs),
            torch.tensor(alone.sequences[0].logprobs),
            atol=2e-2,
            rtol=0,
        )
    same = stack.sampler.generate(
        [SampleRequest(_prompt(0, 6), greedy, adapter=r.adapter) for r in requests]
    )
    assert len({tuple(r.sequences[0].tokens) for r in same}) == len(requests)


def test_bf16_sampled_logprobs_equal_the_trainers_and_seeds_reproduce(bf16_stack):
    stack, keys = bf16_stack
    slot, key = keys[1]
    text = _prompt(11, 6)
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=5, stop=[])
    request = SampleRequest(text, params, adapter=key, num_samples=2)
    (first,) = stack.sampler.generate([request])
    (again,) = stack.sampler.generate([request])
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    for seq in first.sequences:
        full = torch.tensor(text + seq.tokens)
        item = TrainItem(
            slot,
            full[:-1],
            "cross_entropy",
            {"target_tokens": full[1:], "weights": torch.ones(len(full) - 1)},
        )
        trained = stack.trainer.forward([item]).items[0].logprobs.cpu()
        # bf16 base: the sampler (KV cache, decode one token at a time) and the trainer (one
        # full forward) round differently, by about one bf16 step of the logits.
        torch.testing.assert_close(
            torch.tensor(seq.logprobs), trained[len(text) - 1 :], atol=5e-2, rtol=0
        )


# ----------------------------------------------------------------- issue 25: the GPU path

cuda_only = pytest.mark.skipif(
    DEVICE != "cuda", reason="the Triton kernel and CUDA graphs run on CUDA only"
)


@cuda_only
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_fused_triton_kernel_matches_the_loop_kernel(x_dtype):
    """Ragged segments (one past 64 rows), a base row, heterogeneous ranks (zero tails), an
    absent slot: values and every gradient."""
    from lorafleet.model.triton_lora import add_routed_lora

    num_slots, rank, d_in, d_out = 5, 16, 96, 80
    slots = [3, 1, 0, 2, 3, 1, 1, 0, 2] + [2] * 70 + [1, 3]
    ranks = [0, 4, 16, 9, 0]
    scales = torch.tensor([0.0, 0.5, 2.0, 1.0, 3.0], device=DEVICE)
    A0 = _randn(num_slots, rank, d_in, seed=2, scale=0.1)
    B0 = _randn(num_slots, d_out, rank, seed=3, scale=0.1)
    for slot, r in enumerate(ranks):
        A0[slot, r:] = 0
        B0[slot, :, r:] = 0
    results = {}
    for kernel in ("triton", "loop"):
        x = _randn(len(slots), d_in, seed=1).to(DEVICE, x_dtype).requires_grad_()
        A = A0.to(DEVICE).requires_grad_()
        B = B0.to(DEVICE).requires_grad_()
        base = _randn(len(slots), d_out, seed=5).to(DEVICE, x_dtype)
        routing = build_routing(torch.tensor(slots, device=DEVICE), scales, bank="t")
        if kernel == "triton":
            out = add_routed_lora(base.clone(), x, A, B, routing)
        else:
            delta = lora_delta(x, A, B, routing, "loop")
            assert delta is not None
            out = base.clone().index_add(0, routing.order, delta.to(x_dtype))
        (out.float() * _randn(*out.shape, seed=4).to(DEVICE)).sum().backward()
        results[kernel] = [out.detach(), x.grad, A.grad, B.grad]
    tol = 2e-4 if x_dtype == torch.float32 else 3e-2
    for got, want in zip(results["triton"], results["loop"], strict=True):
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)


@cuda_only
def test_a_mixed_training_step_with_the_fused_kernel_matches_the_loop_kernel():
    """kernel auto on CUDA runs the fused Triton kernel (bf16 base): two adapters, SFT and
    PPO, one forward_backward + optim_step, against kernel loop on the same device."""
    from lorafleet.model.kernels import _fused_applies

    runs = {}
    for kernel in ("auto", "loop"):
        stack = _stack(torch.bfloat16, DEVICE)
        stack.trainer.adapted.set_kernel(kernel)  # type: ignore[arg-type]
        layer = next(iter(stack.trainer.adapted.layers.values()))
        probe = torch.zeros(1, 4, device=DEVICE, dtype=torch.bfloat16)
        assert _fused_applies(layer.kernel, probe, stack.trainer.bank.params) is (kernel == "auto")
        slots = [_adapter(stack, 1), _adapter(stack, 2, rank=8)]
        out = stack.trainer.forward_backward(
            [_sft(slots[0], 10, 7), _rl(slots[1], 20, 5), _sft(slots[1], 30, 9)]
        )
        grads = stack.trainer.bank.grads
        assert grads is not None
        grads = grads.clone()
        stack.trainer.optim_step({s: AdamHParams(learning_rate=1e-2) for s in slots})
        runs[kernel] = (
            torch.cat([item.logprobs.cpu() for item in out.items]),
            grads.cpu(),
            stack.trainer.bank.params.detach().cpu(),
        )
    (lp, g, p), (lp_ref, g_ref, p_ref) = runs["auto"], runs["loop"]
    torch.testing.assert_close(lp, lp_ref, atol=5e-2, rtol=0)
    scale = float(g_ref.abs().max())
    torch.testing.assert_close(g, g_ref, atol=2e-2 * scale, rtol=5e-2)
    torch.testing.assert_close(p, p_ref, atol=2e-3, rtol=1e-2)
    assert g[1:3].abs().sum() > 0


@cuda_only
def test_decode_replayed_from_cuda_graphs_equals_eager(bf16_stack):
    """Greedy and seeded sampling with rows joining and leaving (different lengths and
    max_tokens, more requests over time than one bucket): graph replay gives the eager
    path's tokens, and the graphs were really captured and replayed."""
    from lorafleet.sample import cuda_graphs

    stack, keys = bf16_stack
    adapters = [k for _, k in keys] + [None]
    requests = []
    for i in range(11):
        params = SamplingParams(
            max_tokens=3 + (5 * i) % 9, temperature=0.0 if i % 2 else 0.9, seed=i, stop=[]
        )
        requests.append(
            SampleRequest(_prompt(100 + i, 2 + i % 6), params, adapter=adapters[i % len(adapters)])
        )
    proven = stack.sampler.decode_graphs  # on by default: colocate checked it at start-up
    assert proven is not None, stack.sampler.graph_state
    stack.sampler.decode_graphs = None
    eager = stack.sampler.generate(requests)
    graphs = cuda_graphs.enable(stack.sampler)
    try:
        replayed = stack.sampler.generate(requests)
    finally:
        stack.sampler.decode_graphs = proven
    assert graphs.fused and graphs.captures >= 2 and graphs.replays > 0, graphs.eager_steps
    for a, b in zip(eager, replayed, strict=True):
        assert a.ok and b.ok
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        torch.testing.assert_close(
            torch.tensor(b.sequences[0].logprobs),
            torch.tensor(a.sequences[0].logprobs),
            atol=2e-2,
            rtol=0,
        )


# ----------------------------------------------------------------- issue 33: the whole stack


@cuda_only
def test_the_engines_prove_the_fused_kernel_and_graph_decode_at_start_up(bf16_stack):
    """colocate on CUDA: the fused kernel passed its check against the torch path on every
    layer shape, and decode replays graphs after capture and replay-equals-eager."""
    stack, _ = bf16_stack
    verdict = stack.adapted.kernel_verdict
    assert verdict is not None and verdict.checked and verdict.fused, verdict
    assert max(verdict.max_errors.values()) <= 3e-2
    state = stack.sampler.graph_state
    assert state.enabled and state.checked and state.fallbacks == 0, state
    assert stack.sampler.decode_graphs is not None and stack.sampler.decode_graphs.captures >= 1


@cuda_only
def test_a_failing_fused_kernel_on_the_device_falls_back_to_grouped_mm():
    from lorafleet.model.kernel_check import prove_fused_kernel

    def wrong(out, x, A, B, routing):
        from lorafleet.model.triton_lora import add_routed_lora

        return add_routed_lora(out, x, A * 1.1, B, routing)

    model = tiny_qwen3().to(device=DEVICE, dtype=torch.bfloat16)
    from lorafleet.model.adapted import AdaptedModel

    adapted = AdaptedModel(model, resolve_tinker_targets(model))
    adapted.add_bank("train", num_slots=3, r_max=8)
    verdict = prove_fused_kernel(adapted, 8, fused=wrong)
    assert verdict.kernel == "torch" and not verdict.fused and "differs" in verdict.reason
    layer = next(iter(adapted.layers.values()))
    probe = torch.zeros(1, 4, device=DEVICE, dtype=torch.bfloat16)
    from lorafleet.model.kernels import _fused_applies

    assert not _fused_applies(layer.kernel, probe, adapted.bank("train").params)


def _cap_device_memory(headroom: int) -> int:
    """Caps this process's CUDA allocator at what it holds now plus `headroom` bytes (cached
    blocks given back first, so new work needs new device memory); returns the bytes in use.
    The caller lifts the cap (set_per_process_memory_fraction(1.0))."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated()
    _free, total = torch.cuda.mem_get_info()
    torch.cuda.set_per_process_memory_fraction(
        min(1.0, (torch.cuda.memory_reserved() + headroom) / total)
    )
    return held


@cuda_only
def test_a_real_device_oom_fails_the_call_frees_what_it_took_and_training_goes_on():
    """The allocator capped a little above what the stack holds: a large call runs out of
    device memory for real. It fails alone (DeviceOutOfMemory), the gradient is as before,
    the memory is back, and with the cap lifted the same engine trains on."""
    from lorafleet.model.memory import DeviceOutOfMemory

    stack = _stack(torch.float32, DEVICE)
    slot = _adapter(stack, 1)
    stack.trainer.forward_backward([_sft(slot, 1, 9)])
    grads = stack.trainer.bank.grads
    assert grads is not None
    before = grads.clone()
    held = _cap_device_memory(headroom=8 << 20)
    big = [_sft(slot, 100 + i, 250) for i in range(64)]  # 16k tokens, several micro-batches
    try:
        with pytest.raises(DeviceOutOfMemory, match="out of memory on cuda"):
            stack.trainer.forward_backward(big)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert torch.equal(grads, before)
    assert torch.cuda.memory_allocated() - held < (4 << 20)
    out = stack.trainer.forward_backward([_sft(slot, 2, 9)])
    assert out.items[0].logprobs.isfinite().all()


@cuda_only
def test_a_real_device_oom_in_a_prefill_fails_that_request_and_sampling_goes_on(bf16_stack):
    stack, keys = bf16_stack
    sampler = stack.sampler
    greedy = SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    small = SampleRequest(_prompt(1, 5), greedy, adapter=keys[0][1])
    (alone,) = sampler.generate([small])
    huge = SampleRequest(_prompt(2, 250), greedy, adapter=keys[1][1], num_samples=32)
    _cap_device_memory(headroom=0)  # its KV for 250 columns needs new device memory
    try:
        futures = sampler.submit([huge])
        while not all(f.done() for f in futures):
            sampler.step()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    failed = futures[0].result()
    assert failed.error is not None and failed.error.code == "out_of_memory", failed.error
    (again,) = sampler.generate([small])
    assert again.ok and again.sequences[0].tokens == alone.sequences[0].tokens


@cuda_only
def test_sizes_planned_from_the_device_build_and_run():
    from lorafleet.engines import EngineConfig, build_engines, plan_engine_config
    from lorafleet.model.loader import load_base
    from lorafleet.model.memory import PLANNED

    base = load_base("tiny-qwen3", dtype="bfloat16", device=DEVICE)
    targets = resolve_tinker_targets(base.model)
    config = EngineConfig(
        base_model="tiny-qwen3", device=DEVICE, max_lora_rank=8, memory_planned=PLANNED
    )
    planned = plan_engine_config(config, base, targets)
    plan = planned.memory_plan
    assert plan is not None and plan.planned and plan.free_bytes is not None
    assert set(plan.sources.values()) == {"planned"}
    assert sum(plan.costs.values()) <= plan.usable_bytes
    engines = build_engines(planned, base, targets)
    assert engines.trainer.bank.num_slots == planned.max_adapters + 1
    assert engines.sampler.max_rows == planned.max_sample_rows
