"""One GRPO training step's forward_backward, plain vs shared prompts and a partial head.

The RL main job's batch: 8 prompts x 4 samples on SmolLM2-135M (real weights; base dtype
`--dtype`, default auto: bf16 only where the CPU multiplies it natively), 59-token
prompts, 16 sampled tokens, importance_sampling in the cookbook's layout (input = prompt +
sampled[:-1], advantage 0 on the prompt's target slots). Groups whose 4 rewards were equal have
advantage 0 everywhere and the RL loop drops their rows: `--dropped-groups` of the 8 (default 2,
so 24 of 32 rows are trained, 25% dropped). One adapter (rank 8, every Tinker target, the head
included), as one tenant's step.

Sides, interleaved A B C D per round, 1 torch thread by default:
- plain: every row runs its prompt, head + fp32 log-softmax with autograd at every position
  (the engine before this change: share_prefixes=False, head_grad_where_needed=False);
- head only: the head's autograd only where the loss has a gradient;
- prefix only: each group's prompt runs once, its KV cache serves the 4 samples;
- shared + head: both (the engine's default).

All sides compute the same thing; in fp32 they agree to ~1e-5 (tests/train/test_prefix.py). In
bf16 the layouts round differently (the max log-prob difference printed at the end is ~0.4):
against an fp32 run, the plain and shared sides are equally far off (measured on 2 groups: mean
|d logprob| 0.069 vs 0.068 on sampled tokens, gradient relative error 17% vs 18%).

    .venv/bin/python -m bench.train_prefix --json bench/results/train_prefix.json
"""

from __future__ import annotations

import torch

from bench.common import bench_device, bench_dtype, interleaved, parse_args, report
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.kernel_check import prove_fused_kernel
from lorafleet.model.loader import load_base
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.train.engine import TrainEngine, TrainItem

PRESET = "smollm2-135m"
GROUPS, GROUP_SIZE, PROMPT, SAMPLED = 8, 4, 59, 16
SIDES = {
    "plain": {"share_prefixes": False, "head_grad_where_needed": False},
    "head only": {"share_prefixes": False, "head_grad_where_needed": True},
    "prefix only": {"share_prefixes": True, "head_grad_where_needed": False},
    "shared + head": {"share_prefixes": True, "head_grad_where_needed": True},
}


def rl_batch(slot: int, vocab: int, groups: int, seed: int = 0) -> list[TrainItem]:
    gen = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(groups):
        prompt = torch.randint(0, vocab, (PROMPT,), generator=gen)
        for _ in range(GROUP_SIZE):
            sampled = torch.randint(0, vocab, (SAMPLED,), generator=gen)
            pad = PROMPT - 1
            inputs = {
                "target_tokens": torch.cat([torch.zeros(pad, dtype=torch.int64), sampled]),
                "logprobs": torch.cat([torch.zeros(pad), -torch.rand(SAMPLED, generator=gen) * 3]),
                "advantages": torch.cat(
                    [
                        torch.zeros(pad),
                        torch.full((SAMPLED,), float(torch.randn((), generator=gen))),
                    ]
                ),
            }
            tokens = torch.cat([prompt, sampled[:-1]])
            items.append(TrainItem(slot, tokens, "importance_sampling", inputs))
    return items


def main() -> None:
    args = parse_args(
        __doc__,
        threads=(int, 1, "torch threads"),
        dropped_groups=(int, 2, "groups of the 8 dropped for zero advantage"),
        rank=(int, 8, "LoRA rank"),
    )
    torch.set_num_threads(args.threads)
    device = bench_device(args.device).device
    choice = bench_dtype(args.dtype, device)
    model = load_base(PRESET, dtype=choice.dtype, device=device).model
    adapted = AdaptedModel(model, resolve_tinker_targets(model))
    adapted.add_bank("train", num_slots=2, r_max=args.rank)
    adapted.kernel_verdict = prove_fused_kernel(adapted, args.rank)  # as the engines do on CUDA
    engines = {
        name: TrainEngine(adapted, base_model_id=PRESET, **flags) for name, flags in SIDES.items()
    }
    first = next(iter(engines.values()))
    slot = first.create_adapter(AdapterSpec(rank=args.rank, alpha=2.0 * args.rank, seed=0))
    with torch.no_grad():  # a trained-looking adapter, so B is not zero
        first.bank.params[slot].normal_(
            0, 0.02, generator=torch.Generator(first.device).manual_seed(1)
        )
    items = rl_batch(slot, first.vocab_size, GROUPS - args.dropped_groups)
    prepared = first.prepare(items)

    runs: dict[str, object] = {}

    def side(name: str, engine: TrainEngine):
        def run() -> None:
            runs[name] = engine.forward_backward(prepared)
            first.bank.grads.zero_()

        return run

    timings = interleaved(
        {name: side(name, e) for name, e in engines.items()}, repeats=args.repeats
    )
    # Same numbers on every side (a bf16 base rounds differently per layout, hence the bound).
    reference = runs["plain"]
    worst = max(
        float((a.logprobs - b.logprobs).abs().max())
        for out in runs.values()
        for a, b in zip(out.items, reference.items, strict=True)
    )
    plain = timings["plain"]["min_s"]
    report(
        f"train_prefix: {PRESET} {choice.dtype}, {len(items)} rows ({GROUPS - args.dropped_groups} groups x "
        f"{GROUP_SIZE}), {PROMPT}-token prompts + {SAMPLED} sampled, importance_sampling, "
        f"rank {args.rank}, {args.threads} thread(s)",
        timings,
        {
            f"{name} / plain": (timings[name]["min_s"] / plain, "< 1")
            for name in SIDES
            if name != "plain"
        },
        args.json,
        extra={
            "rows": len(items),
            "tokens": sum(p.length for p in prepared),
            "tokens_run": {name: out.tokens_run for name, out in runs.items()},
            "max_logprob_diff_vs_plain": worst,
            "median_ratio_shared_head_over_plain": timings["shared + head"]["median_s"]
            / timings["plain"]["median_s"],
        },
        dtype=choice,
    )
    print(f"tokens run: {', '.join(f'{n} {o.tokens_run}' for n, o in runs.items())}")
    print(f"max |logprob - plain's| over every position: {worst:.3g}")


if __name__ == "__main__":
    main()
