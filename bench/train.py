"""Training throughput on SmolLM2-135M shapes, and the batched optimizer.

- `mfu_vs_matmul`: achieved FLOP/s of TrainEngine.forward_backward over a mixed batch
  (8 adapters x 2 sequences x 128 tokens) divided by the FLOP/s of a large matmul in the base's
  dtype measured in the same run (target >= 0.40). FLOP convention: 4 x base parameters x tokens. A frozen
  base needs no weight gradient, so fwd (2 flops/param/token) + input-gradient bwd (2) = 4;
  attention score FLOPs and the LoRA matmuls are not counted (they only make us look slower).
- `bankadamw_over_torch_adamw`: one BankAdamW step over 8 adapters ÷ 8 torch.optim.AdamW steps
  (default foreach implementation) on equivalent per-layer tensors (target <= 0.5).

Base dtype `--dtype` (default auto: bf16 only where the CPU multiplies it natively); the
reference matmul uses the same dtype, so the ratio compares like with like.

    .venv/bin/python -m bench.train --json bench/results/train.json
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from bench.common import (
    bench_device,
    bench_dtype,
    interleaved,
    parse_args,
    report,
    smollm2_shaped_config,
    torch_dtype,
)
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.kernel_check import prove_fused_kernel
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.train.engine import TrainEngine, TrainItem
from lorafleet.train.optim import AdamHParams

ADAPTERS = 8


def matmul_flops_per_s(
    dtype: torch.dtype, size: int = 2048, repeats: int = 5, device: str = "cpu"
) -> float:
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    timing = interleaved({"matmul": lambda: a @ b}, repeats=repeats)
    return 2 * size**3 / timing["matmul"]["min_s"]


def main() -> None:
    args = parse_args(
        __doc__, seq_len=(int, 128, "tokens per sequence"), rank=(int, 16, "LoRA rank")
    )
    device = bench_device(args.device).device
    choice = bench_dtype(args.dtype, device)
    dtype = torch_dtype(choice)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        smollm2_shaped_config(), dtype=dtype, attn_implementation="sdpa"
    )
    model.to(device).eval().requires_grad_(False)
    base_params = sum(p.numel() for p in model.parameters())
    adapted = AdaptedModel(model, resolve_tinker_targets(model))
    adapted.add_bank("train", num_slots=ADAPTERS + 1, r_max=args.rank)
    adapted.kernel_verdict = prove_fused_kernel(adapted, args.rank)  # as the engines do on CUDA
    engine = TrainEngine(
        adapted, base_model_id="smollm2-shaped", token_budget=ADAPTERS * 2 * args.seq_len
    )
    slots = [
        engine.create_adapter(AdapterSpec(rank=args.rank, alpha=2.0 * args.rank, seed=i))
        for i in range(ADAPTERS)
    ]
    items = []
    for slot in slots:
        for _ in range(2):
            seq = torch.randint(0, 49152, (args.seq_len + 1,))
            items.append(
                TrainItem(
                    slot,
                    seq[:-1],
                    "cross_entropy",
                    {"target_tokens": seq[1:], "weights": torch.ones(args.seq_len)},
                )
            )
    prepared = engine.prepare(items)
    tokens = sum(p.length for p in prepared)
    hparams = {s: AdamHParams(learning_rate=1e-4) for s in slots}

    # torch.optim.AdamW on the same tensors, one optimizer per adapter, per-layer tensors.
    torch_params = []
    for slot in slots:
        rows = engine.bank.split_row(
            engine.bank.params[slot], args.rank, engine.bank.slots[slot].targets
        )
        tensors = [torch.nn.Parameter(t.clone()) for pair in rows.values() for t in pair]
        for t in tensors:
            t.grad = torch.randn_like(t) * 1e-3
        torch_params.append(tensors)
    torch_opts = [
        torch.optim.AdamW(ps, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        for ps in torch_params
    ]
    with torch.no_grad():
        engine.bank.grads.normal_(0, 1e-3)  # padding rows get noise too: a superset of the work

    def fwd_bwd():
        engine.forward_backward(prepared)
        engine.bank.grads.zero_()

    def bank_step():
        engine.optimizer.note_gradient(slots)
        engine.optimizer.step(hparams)

    def torch_steps():
        for opt in torch_opts:
            opt.step()

    matmul = matmul_flops_per_s(dtype, device=device)
    timings = interleaved({"forward_backward (8 adapters mixed)": fwd_bwd}, repeats=args.repeats)
    opt_timings = interleaved(
        {"BankAdamW (8 adapters, 1 call)": bank_step, "torch AdamW (8 optimizers)": torch_steps},
        repeats=max(args.repeats, 10),
    )
    timings.update(opt_timings)
    fb = timings["forward_backward (8 adapters mixed)"]["min_s"]
    achieved = 4 * base_params * tokens / fb
    bank_s = timings["BankAdamW (8 adapters, 1 call)"]["min_s"]
    torch_s = timings["torch AdamW (8 optimizers)"]["min_s"]
    report(
        f"train: SmolLM2-135M shapes, {choice.dtype}, {ADAPTERS} adapters x 2 x {args.seq_len} tokens, rank {args.rank}",
        timings,
        {
            "mfu_vs_matmul": (achieved / matmul, ">= 0.40"),
            "bankadamw_over_torch_adamw": (bank_s / torch_s, "<= 0.5"),
        },
        args.json,
        extra={
            "achieved_gflops": achieved / 1e9,
            "matmul_gflops": matmul / 1e9,
            "tokens": tokens,
            "base_params": base_params,
            "adapter_params_per_slot": engine.bank.row_size,
            "flop_convention": "4 x base params x tokens",
        },
        dtype=choice,
    )


if __name__ == "__main__":
    main()
