"""Adapter-bank overhead on SmolLM2-135M shapes, 8 adapters x (2 sequences x 128 tokens).

Same total tokens on every side, one forward+backward with a summed cross-entropy loss:
- mixed:            16 rows spread over 8 adapters, one pass (our banks);
- single:           16 rows all on 1 adapter, one pass (our banks);
- peft_sequential:  PEFT doing the same work as 8 `set_adapter` passes of 2 rows each.
Ratios: mixed_over_single (target <= 1.10), mixed_over_peft_sequential (target <= 0.8).
Base dtype `--dtype` (default auto: bf16 only where the CPU multiplies it natively), the
same on both sides.

    .venv/bin/python -m bench.banks --json bench/results/banks.json
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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

ADAPTERS = 8
ROWS_PER_ADAPTER = 2


def build_base(dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        smollm2_shaped_config(), dtype=dtype, attn_implementation="sdpa"
    )
    return model.to(device).eval().requires_grad_(False)


def ce_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
    )


def main() -> None:
    args = parse_args(
        __doc__, seq_len=(int, 128, "tokens per sequence"), rank=(int, 16, "LoRA rank")
    )
    device = bench_device(args.device).device
    choice = bench_dtype(args.dtype, device)
    dtype = torch_dtype(choice)
    torch.manual_seed(0)
    rows = ADAPTERS * ROWS_PER_ADAPTER
    input_ids = torch.randint(0, 49152, (rows, args.seq_len)).to(device)
    targets = torch.randint(0, 49152, (rows, args.seq_len)).to(device)

    model = build_base(dtype, device)
    paths = resolve_tinker_targets(model)
    adapted = AdaptedModel(model, paths)
    bank = adapted.add_bank("train", num_slots=ADAPTERS + 1, r_max=args.rank)
    adapted.kernel_verdict = prove_fused_kernel(adapted, args.rank)  # as the engines do on CUDA
    slots = [
        bank.allocate(AdapterSpec(rank=args.rank, alpha=2.0 * args.rank, seed=i))
        for i in range(ADAPTERS)
    ]
    with torch.no_grad():
        bank.params.normal_(0, 0.01)
    mixed_ids = bank.slot_ids_for_rows(
        [s for s in slots for _ in range(ROWS_PER_ADAPTER)], args.seq_len
    )
    single_ids = bank.slot_ids_for_rows([slots[0]] * rows, args.seq_len)

    def ours(slot_ids):
        def run():
            with adapted.routing("train", slot_ids):
                ce_loss(adapted.model(input_ids).logits, targets).backward()
            bank.grads.zero_()

        return run

    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        build_base(dtype, device),
        LoraConfig(
            r=args.rank, lora_alpha=2 * args.rank, target_modules=list(paths), lora_dropout=0.0
        ),
        adapter_name="a0",
    )
    for i in range(1, ADAPTERS):
        peft_model.add_adapter(
            f"a{i}",
            LoraConfig(
                r=args.rank, lora_alpha=2 * args.rank, target_modules=list(paths), lora_dropout=0.0
            ),
        )

    def peft_sequential():
        for i in range(ADAPTERS):
            peft_model.base_model.set_adapter(f"a{i}")
            sl = slice(i * ROWS_PER_ADAPTER, (i + 1) * ROWS_PER_ADAPTER)
            ce_loss(peft_model(input_ids[sl]).logits, targets[sl]).backward()
        peft_model.zero_grad(set_to_none=True)

    timings = interleaved(
        {
            "mixed (8 adapters, 1 pass)": ours(mixed_ids),
            "single (1 adapter, 1 pass)": ours(single_ids),
            "peft_sequential (8 passes)": peft_sequential,
        },
        repeats=args.repeats,
    )
    mixed, single, peft = (timings[k]["min_s"] for k in timings)
    report(
        f"banks: fwd+bwd, SmolLM2-135M shapes, {choice.dtype}, 8 adapters x 2 x {args.seq_len} tokens, "
        f"rank {args.rank}, kernel {adapted.kernel}",
        timings,
        {
            "mixed_over_single": (mixed / single, "<= 1.10"),
            "mixed_over_peft_sequential": (mixed / peft, "<= 0.8"),
        },
        args.json,
        extra={
            "seq_len": args.seq_len,
            "rank": args.rank,
            "adapters": ADAPTERS,
            "rows_per_adapter": ROWS_PER_ADAPTER,
        },
        dtype=choice,
    )


if __name__ == "__main__":
    main()
