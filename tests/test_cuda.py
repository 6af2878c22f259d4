"""The GPU paths: LoRA kernels, a training step and sampling with the base and banks on CUDA.

CI has no GPU, so these are skipped there; on a machine with one, `pytest tests/test_cuda.py`
runs them. `LORAFLEET_TEST_DEVICE=cpu` runs the same checks on the CPU, which is how the
checks themselves are kept honest where no GPU is at hand.
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
