"""Mixed-adapter MoE training cost: does routing (expert, adapter) pairs cost extra?

`mixed_over_single`: TrainEngine.forward_backward over a batch whose rows belong to 4 adapters
(each with LoRA on attention, every expert's gate/up and down projections, and the
unembedding) divided by the same batch all on 1 adapter (target <= 1.15). Same tokens, same
router choices, same base GEMMs; the mixed side runs 4x as many LoRA groups (expert x adapter)
and copies 4 adapters' expert banks into expert-major order. The model is the tiny-qwen3-moe
preset scaled up (random weights): hidden 512, 8 experts, top-2. Base dtype `--dtype` (default
auto: bf16 only where the CPU multiplies it natively).

Both wall-clock and process CPU time are reported per side (min and median, sides interleaved).
On a shared machine run with `--threads 1`: the CPU-time ratio then does not see the time this
process spends waiting for a core, which the wall-clock ratio does.

    .venv/bin/python -m bench.moe --json bench/results/moe.json
"""

from __future__ import annotations

import time

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from bench.common import (
    bench_device,
    bench_dtype,
    interleaved,
    parse_args,
    report,
    torch_dtype,
)
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.train.engine import TrainEngine, TrainItem

ADAPTERS = 4
VOCAB = 4096


def scaled_moe_config(hidden: int, experts: int, layers: int) -> Qwen3MoeConfig:
    """tiny-qwen3-moe's architecture, scaled up: timing needs the shapes, not the values."""
    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=hidden // 8,
        num_experts=experts,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


def main() -> None:
    args = parse_args(
        __doc__,
        hidden=(int, 512, "hidden size"),
        experts=(int, 8, "routed experts per layer"),
        layers=(int, 4, "decoder layers"),
        rows=(int, 8, "sequences per batch (split evenly over the adapters on the mixed side)"),
        seq_len=(int, 128, "tokens per sequence"),
        rank=(int, 16, "LoRA rank"),
        threads=(
            int,
            0,
            "torch threads (0 keeps torch's default; 1 is steadier on a shared machine)",
        ),
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    device = bench_device(args.device).device
    choice = bench_dtype(args.dtype, device)
    dtype = torch_dtype(choice)
    torch.manual_seed(0)
    model = (
        Qwen3MoeForCausalLM(scaled_moe_config(args.hidden, args.experts, args.layers))
        .to(device=device, dtype=dtype)
        .eval()
    )
    # A sharper router than the random init's near-uniform one, so tokens spread unevenly over
    # experts as in a trained model.
    for layer in model.model.layers:
        layer.mlp.gate.weight.data.normal_(0, 0.5)
    targets = resolve_tinker_targets(model)
    adapted = AdaptedModel(model, targets)
    adapted.add_bank("train", num_slots=ADAPTERS + 2, r_max=args.rank)
    engine = TrainEngine(
        adapted, base_model_id="qwen3-moe-scaled", token_budget=args.rows * args.seq_len
    )
    slots = [
        engine.create_adapter(AdapterSpec(rank=args.rank, alpha=2.0 * args.rank, seed=i))
        for i in range(ADAPTERS)
    ]
    with torch.no_grad():  # non-zero B, so every LoRA product is real work
        engine.bank.params[1:].normal_(0, 0.01)

    gen = torch.Generator().manual_seed(1)
    sequences = [
        torch.randint(0, VOCAB, (args.seq_len + 1,), generator=gen) for _ in range(args.rows)
    ]

    def items(row_slots: list[int]) -> list[TrainItem]:
        return [
            TrainItem(
                slot,
                seq[:-1],
                "cross_entropy",
                {"target_tokens": seq[1:], "weights": torch.ones(args.seq_len)},
            )
            for slot, seq in zip(row_slots, sequences, strict=True)
        ]

    mixed = engine.prepare(items([slots[i * ADAPTERS // args.rows] for i in range(args.rows)]))
    single = engine.prepare(items([slots[0]] * args.rows))
    mixed_name, single_name = f"fwd+bwd, {ADAPTERS} adapters mixed", "fwd+bwd, 1 adapter"
    cpu: dict[str, list[float]] = {mixed_name: [], single_name: []}

    def timed(name, batch):
        def run() -> None:
            start = time.process_time()
            engine.forward_backward(batch)
            cpu[name].append(time.process_time() - start)

        return run

    timings = interleaved(
        {mixed_name: timed(mixed_name, mixed), single_name: timed(single_name, single)},
        repeats=args.repeats,
    )
    for name, values in cpu.items():
        ordered = sorted(values[-args.repeats :])  # the timed rounds, not the warm-up
        timings[f"{name} (CPU time)"] = {
            "min_s": ordered[0],
            "median_s": ordered[len(ordered) // 2],
            "runs": len(ordered),
        }
    a, b = timings[mixed_name], timings[single_name]
    a_cpu, b_cpu = timings[f"{mixed_name} (CPU time)"], timings[f"{single_name} (CPU time)"]
    experts_targets = sum(".experts." in t for t in targets)
    report(
        f"MoE expert LoRA: {ADAPTERS} adapters mixed vs 1 ({args.layers} layers, hidden {args.hidden}, "
        f"{args.experts} experts top-2, {choice.dtype}, {args.rows}x{args.seq_len} tokens, rank {args.rank})",
        timings,
        {
            "mixed_over_single": (a["min_s"] / b["min_s"], "<= 1.15"),
            "mixed_over_single_median": (a["median_s"] / b["median_s"], "<= 1.15"),
            "mixed_over_single_cpu": (a_cpu["min_s"] / b_cpu["min_s"], "<= 1.15"),
            "mixed_over_single_cpu_median": (a_cpu["median_s"] / b_cpu["median_s"], "<= 1.15"),
        },
        args.json,
        extra={
            "config": {
                k: getattr(args, k)
                for k in (
                    "hidden",
                    "experts",
                    "layers",
                    "rows",
                    "seq_len",
                    "rank",
                    "threads",
                )
            }
            | {"dtype": choice.dtype},
            "adapted_layers": len(targets),
            "expert_projections": experts_targets,
            "tokens": args.rows * args.seq_len,
        },
        dtype=choice,
    )


if __name__ == "__main__":
    main()
