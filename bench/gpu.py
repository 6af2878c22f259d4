"""The GPU path in one command: issue 25's figures on `qwen3-1.7b-shape` (bf16, one CUDA device).

    python -m bench.gpu --json bench/results/gpu_h200.json           # the issue's sizes
    python -m bench.gpu --smoke --device cpu --json /tmp/gpu.json     # tiny-qwen3, seconds

The base is the preset's architecture with random weights built on the device (throughput
does not depend on the values). Adapters are rank 16 on attention + MLP with random non-zero
B. Every side runs interleaved with the others (A B C A B C ...), each reported by its minimum;
the JSON records the device, torch, CUDA and triton versions, the sizes and every side's times.

Figures (targets from the issue):
- `matmul_peak_tflops`: the best bf16 matmul rate measured in this run (the MFU denominator);
- `train_mfu` (>= 0.35): model FLOPs of one mixed forward_backward + optim_step over
  ADAPTERS adapters x 4 sequences x 512 tokens, divided by its time and the peak. Model FLOPs
  of LoRA training on a frozen base: 4 x (matmul parameters) x tokens (forward, and the
  backward's input gradients; no base weight gradients) + the causal attention matmuls
  (forward and twice that for the backward) + the LoRA matmuls (6 x one adapter's LoRA
  parameters x tokens);
- `train_mixed_over_peft` (>= 3): the same items through PEFT, one adapter at a time
  (set_adapter, forward, backward, its own AdamW step), over ours;
- `sample_mixed_over_base` (>= 0.85): 128 sequences x 128 new tokens, ADAPTERS adapters mixed
  in one continuous batch, over the same sequences on the base alone;
- `sample_over_peft_generate` (>= 10): HF generate on a PeftModel, one set_adapter + batched
  generate per adapter, over ours;
- `graphs_over_eager_8_rows` (>= 1.5): 8 mixed sequences (one per adapter) decoded with steps
  replayed from CUDA graphs (sample/cuda_graphs.py) over eager, where launches dominate;
  `graphs_over_eager` the same at the full sample side. Graph decode runs only if it passed its
  start-up check on this device (the JSON's `cuda_graphs.start_up` says why not);
- `tenants4_engine_throughput_over_1`: RL-shaped rounds (per tenant 8 prompts x 4 samples,
  then one forward_backward + optim_step on the rollouts) for 4 adapters in mixed batches
  over 1 adapter alone, in rollouts/s, through the colocated engines (a reference: the issue's
  `tenants4_throughput_over_1` is bench/rl.py's, through the HTTP server, `--device cuda`;
  scripts/gpu_check.sh runs both).

`--smoke` runs every side at toy sizes on tiny-qwen3 (CPU or GPU): a check that the script
works, not a measurement.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    bench_device,
    bench_dtype,
    interleaved,
    make_prompts,
    peft_generate_per_adapter,
    publish_random_adapters,
    report,
    torch_dtype,
)
from lorafleet.engines import Colocated, colocate
from lorafleet.model.loader import build_random_weights
from lorafleet.model.presets import materialize
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample import SampleRequest, SamplingParams
from lorafleet.train.engine import TrainItem
from lorafleet.train.optim import AdamHParams
from lorafleet.train.token_budget import (
    DecoderShape,
    activation_bytes_per_token,
    device_token_budget,
)

PRESET = "qwen3-1.7b-shape"
SMOKE_PRESET = "tiny-qwen3"
ADAPTERS = 8
RANK = 16


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument(
        "--device", default="cuda", help="cuda or cuda:N; cpu (or auto) only with --smoke"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny-qwen3 at toy sizes")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per side")
    parser.add_argument("--dtype", default="bfloat16", help="base dtype (default bfloat16)")
    parser.add_argument("--sample-seqs", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--train-seqs-per-adapter", type=int, default=4)
    parser.add_argument("--train-len", type=int, default=512)
    parser.add_argument(
        "--recompute",
        action="store_true",
        help="train with activation recompute (only pays when the call does not fit memory)",
    )
    parser.add_argument("--no-peft", action="store_true", help="skip both PEFT sides")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sample_seqs, args.new_tokens, args.prompt_len = ADAPTERS, 4, 12
        args.train_seqs_per_adapter, args.train_len, args.repeats = 1, 16, 1
    elif not args.device.startswith("cuda"):
        parser.error("the full run needs --device cuda; use --smoke to try the script elsewhere")
    return args


def random_model(preset: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    model = build_random_weights(materialize(preset), dtype, device, seed=0)
    return model.eval().requires_grad_(False)


def synced(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    def run() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


def matmul_peak_tflops(device: torch.device, dtype: torch.dtype, smoke: bool) -> float:
    """The best dense matmul rate of this device in `dtype`, measured now (square products
    large enough to saturate it; the best of several runs)."""
    n = 256 if smoke else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    reps = 2 if smoke else 20
    best = math.inf
    for _ in range(3 if smoke else 5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - start) / reps)
    return 2 * n**3 / best / 1e12


def train_flops(model: torch.nn.Module, tokens: int, seq_len: int, lora_params: int) -> float:
    """Model FLOPs of one LoRA forward_backward on a frozen base (see the module docstring)."""
    hf: Any = model
    shape = DecoderShape.from_config(hf.config)
    # Every projection and the head (a tied head is still a matmul).
    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # Causal attention, per layer and sequence: QK^T and PV, 2 * S^2 * H * hd each, halved.
    attention_fwd = shape.layers * 2 * seq_len * tokens * shape.heads * shape.head_dim
    return 4 * matmul_params * tokens + 3 * attention_fwd + 6 * lora_params * tokens


def build_stack(model: torch.nn.Module, max_rows: int, args: argparse.Namespace) -> Colocated:
    """The colocated engines; on a GPU the trainer's micro-batch budget is what free memory
    holds (train/token_budget.py), at most the whole training call."""
    budget = args.train_seqs_per_adapter * args.train_len * ADAPTERS
    device = next(model.parameters()).device
    if device.type == "cuda":
        budget = min(budget, device_token_budget(model, device, recompute=args.recompute))
    stack = colocate(
        model,
        resolve_tinker_targets(model, train_unembed=False),
        base_model_id=PRESET,
        train_slots=ADAPTERS,
        sample_slots=ADAPTERS,
        r_max=RANK,
        max_rows=max_rows,
        token_budget=budget,
    )
    if args.recompute:
        from lorafleet.train.recompute import set_recompute

        set_recompute(model, stack.trainer.adapted.scope, True)
        stack.trainer.recompute = True
        stack.trainer.share_prefixes = False
    return stack


def sft_items(
    slots: list[int], per_slot: int, length: int, vocab: int
) -> dict[int, list[TrainItem]]:
    gen = torch.Generator().manual_seed(7)
    return {
        slot: [
            TrainItem(
                slot,
                seq[:-1],
                "cross_entropy",
                {"target_tokens": seq[1:], "weights": torch.ones(length)},
            )
            for seq in torch.randint(100, vocab, (per_slot, length + 1), generator=gen)
        ]
        for slot in slots
    }


def peft_trainer(
    peft_model: Any, items: dict[int, list[TrainItem]], names: dict[int, str], device: torch.device
) -> Callable[[], None]:
    """PEFT one adapter at a time: set_adapter, one forward/backward over its items (the same
    summed token cross-entropy), an AdamW step over its own parameters."""
    optimizers = {}
    batches = {}
    for slot, slot_items in items.items():
        peft_model.set_adapter(names[slot])
        params = [p for n, p in peft_model.named_parameters() if f".{names[slot]}." in n]
        for p in params:
            p.requires_grad_(True)
        optimizers[slot] = (torch.optim.AdamW(params, lr=1e-5), params)
        ids = torch.stack([torch.as_tensor(item.tokens) for item in slot_items]).to(device)
        targets = torch.stack([item.loss_inputs["target_tokens"] for item in slot_items])
        batches[slot] = (ids, targets.to(device))

    def run() -> None:
        for slot, (ids, targets) in batches.items():
            peft_model.set_adapter(names[slot])
            optimizer, params = optimizers[slot]
            for p in params:
                p.requires_grad_(True)
            logits = peft_model(input_ids=ids).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), reduction="sum"
            )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return run


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_cli(argv)
    device = torch.device(bench_device(args.device).device)  # refuses a missing CUDA device
    on_gpu = device.type == "cuda"
    preset = SMOKE_PRESET if args.smoke else PRESET
    choice = bench_dtype(args.dtype, device)
    dtype = torch_dtype(choice)
    started = time.perf_counter()
    peak = matmul_peak_tflops(device, dtype, args.smoke)
    print(f"matmul peak ({dtype}): {peak:.1f} TFLOP/s", flush=True)

    model = random_model(preset, device, dtype)
    count = args.sample_seqs
    stack = build_stack(model, max_rows=count, args=args)
    keys, slots = publish_random_adapters(stack, ADAPTERS, RANK)
    sampler, trainer = stack.sampler, stack.trainer
    vocab = min(sampler.limits.vocab_size, 512) if args.smoke else sampler.limits.vocab_size
    prompts = make_prompts(count, args.prompt_len, vocab)
    owner = [i % ADAPTERS for i in range(count)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, stop=[])
    mixed = [SampleRequest(p, params, adapter=keys[owner[i]]) for i, p in enumerate(prompts)]
    base = [SampleRequest(p, params, adapter=None) for p in prompts]
    outputs: dict[str, list[list[int]]] = {}

    replay: list[Any] = []  # the CUDA-graph runner, on a GPU; only its side uses it

    def generate(
        requests: list[SampleRequest], name: str, graphs: bool = False
    ) -> Callable[[], None]:
        def run() -> None:
            sampler.decode_graphs = replay[0] if graphs else None
            try:
                results = sampler.generate(requests)
            finally:
                sampler.decode_graphs = None
            bad = [r.error for r in results if not r.ok]
            if bad:
                raise RuntimeError(f"{name}: {bad[0]}")
            outputs[name] = [r.sequences[0].tokens for r in results]

        return run

    sides: dict[str, Callable[[], None]] = {
        "sample mixed": generate(mixed, "mixed"),
        "sample base only": generate(base, "base"),
    }
    few = mixed[:ADAPTERS]  # 8 rows: one sequence per adapter
    graphs_info: dict[str, object] = {}
    graphs = None
    # colocate proved the kernels on this device (engines.prove_kernels): graph decode is on
    # only if capture and replay-equals-eager passed there; the other sides run eagerly
    graphs = sampler.decode_graphs
    graphs_info["start_up"] = sampler.decode_graph_stats()
    if graphs is not None:
        sampler.decode_graphs = None
        replay.append(graphs)
        sides["sample mixed, CUDA graphs"] = generate(mixed, "mixed_graphs", graphs=True)
        sides["sample 8 rows"] = generate(few, "few")
        sides["sample 8 rows, CUDA graphs"] = generate(few, "few_graphs", graphs=True)
        graphs_info["fused_kernel_everywhere"] = graphs.fused
    elif on_gpu:
        print(f"CUDA-graph side skipped: {sampler.graph_state.reason}", flush=True)

    train_items = sft_items(slots, args.train_seqs_per_adapter, args.train_len, vocab)
    hparams = {slot: AdamHParams(learning_rate=1e-5) for slot in slots}

    microbatches: list[int] = []

    def train_mixed() -> None:
        out = trainer.forward_backward([item for items in train_items.values() for item in items])
        trainer.optim_step(hparams)
        microbatches.append(out.num_microbatches)

    sides["train mixed"] = train_mixed

    # RL-shaped rounds: sample 8 prompts x 4, train on the rollouts, step (per tenant).
    rl_group = 2 if args.smoke else 4
    rl_prompts = make_prompts(2 if args.smoke else 8, args.prompt_len, vocab)
    rl_params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=3, stop=[])

    def rl_round(tenants: int) -> Callable[[], None]:
        def run() -> None:
            requests = [
                SampleRequest(p, rl_params, adapter=keys[t], num_samples=rl_group)
                for t in range(tenants)
                for p in rl_prompts
            ]
            results = sampler.generate(requests)
            items = []
            for index, result in enumerate(results):
                slot = slots[index // len(rl_prompts)]
                prompt = rl_prompts[index % len(rl_prompts)]
                for seq in result.sequences:
                    full = torch.tensor(prompt + seq.tokens)
                    n = len(full) - 1
                    items.append(
                        TrainItem(
                            slot,
                            full[:-1],
                            "importance_sampling",
                            {
                                "target_tokens": full[1:],
                                "logprobs": torch.zeros(n),
                                "advantages": torch.randn(n),
                            },
                        )
                    )
            trainer.forward_backward(items)
            trainer.optim_step({slots[t]: hparams[slots[t]] for t in range(tenants)})

        return run

    sides["rl round, 1 tenant"] = rl_round(1)
    sides["rl round, 4 tenants"] = rl_round(4)

    peft_info: dict[str, object] = {}
    if not args.no_peft:
        try:
            from peft import PeftModel
        except ImportError as err:
            peft_info["skipped"] = f"peft not importable: {err}"
        else:
            # The same seed on the same device type: the same weights as the base of ours.
            peft_base = random_model(preset, device, dtype)
            workdir = Path(tempfile.mkdtemp(prefix="lorafleet-bench-gpu-"))
            dirs = [trainer.export_peft(slot, workdir / f"a{i}") for i, slot in enumerate(slots)]
            peft_model = PeftModel.from_pretrained(
                peft_base, dirs[0], adapter_name="a0", is_trainable=True
            )
            for i, path in enumerate(dirs[1:], start=1):
                peft_model.load_adapter(path, adapter_name=f"a{i}", is_trainable=True)
            peft_model.eval()
            config: Any = model.config
            pad_id = int(config.pad_token_id if config.pad_token_id is not None else 0)

            def peft_generate() -> None:
                with torch.no_grad():
                    outputs["peft"] = peft_generate_per_adapter(
                        peft_model, prompts, owner, args.new_tokens, pad_id, device
                    )

            sides["peft generate"] = peft_generate
            names = {slot: f"a{i}" for i, slot in enumerate(slots)}
            sides["peft train, one adapter at a time"] = peft_trainer(
                peft_model, train_items, names, device
            )

    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    timings = interleaved({n: synced(f, device) for n, f in sides.items()}, repeats=args.repeats)
    t = {name: timing["min_s"] for name, timing in timings.items()}

    train_tokens = ADAPTERS * args.train_seqs_per_adapter * args.train_len
    # One adapter's LoRA parameters: each token goes through its own adapter only.
    lora_params = sum(
        bank.A[1].numel() + bank.B[1].numel() for bank in trainer.bank.layer_banks.values()
    )
    flops = train_flops(model, train_tokens, args.train_len, lora_params)
    mfu = flops / t["train mixed"] / (peak * 1e12)
    rollouts = len(rl_prompts) * rl_group
    ratios: dict[str, tuple[float, str]] = {
        "train_mfu": (mfu, ">= 0.35"),
        "sample_mixed_over_base": (t["sample base only"] / t["sample mixed"], ">= 0.85"),
        "tenants4_engine_throughput_over_1": (
            (4 * rollouts / t["rl round, 4 tenants"]) / (rollouts / t["rl round, 1 tenant"]),
            "reference (the issue's >= 2.0 is bench/rl.py's, through the server)",
        ),
    }
    if "peft generate" in t:
        ratios["sample_over_peft_generate"] = (t["peft generate"] / t["sample mixed"], ">= 10")
        ratios["train_mixed_over_peft"] = (
            t["peft train, one adapter at a time"] / t["train mixed"],
            ">= 3",
        )
    if "sample mixed, CUDA graphs" in t:
        ratios["graphs_over_eager_8_rows"] = (
            t["sample 8 rows"] / t["sample 8 rows, CUDA graphs"],
            ">= 1.5",
        )
        ratios["graphs_over_eager"] = (
            t["sample mixed"] / t["sample mixed, CUDA graphs"],
            "reference",
        )
    total = count * args.new_tokens

    def agreement(reference: list[list[int]], other: list[list[int]]) -> float:
        pairs = [
            (x, y) for a, b in zip(reference, other, strict=True) for x, y in zip(a, b, strict=True)
        ]
        return sum(x == y for x, y in pairs) / max(len(pairs), 1)

    agree = {
        name: agreement(outputs["mixed"], other)
        for name, other in outputs.items()
        if name not in ("mixed", "few", "few_graphs")
    }
    if "few_graphs" in outputs:
        agree["few_graphs"] = agreement(outputs["few"], outputs["few_graphs"])
    if graphs is not None:
        graphs_info.update(
            captures=graphs.captures, replays=graphs.replays, eager_steps=dict(graphs.eager_steps)
        )
        # a replay that raised while timed fell back to eager: its side's time is not replay's
        graphs_info["fallbacks_while_timed"] = sampler.graph_state.fallbacks
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    hf: Any = model
    result = report(
        f"gpu: {preset} architecture, random {choice.dtype} weights on {device}; sample {count} "
        f"seqs x {args.new_tokens} tokens over {ADAPTERS} adapters of rank {RANK}; train "
        f"{ADAPTERS} x {args.train_seqs_per_adapter} x {args.train_len} tokens",
        timings,
        ratios,
        None,
        extra={
            "smoke": args.smoke,
            "preset": preset,
            "matmul_peak_tflops": peak,
            "train_model_tflops": flops / 1e12,
            "train_tokens": train_tokens,
            "train_token_budget": trainer.token_budget,
            "train_microbatches": microbatches[-1],
            "train_recompute": args.recompute,
            "activation_mib_per_token": activation_bytes_per_token(
                DecoderShape.from_config(hf.config), dtype.itemsize, recompute=args.recompute
            )
            / 2**20,
            "tok_per_s": {
                "sample_mixed": total / t["sample mixed"],
                "sample_base": total / t["sample base only"],
                "train_mixed": train_tokens / t["train mixed"],
            },
            "greedy_token_agreement_with_mixed": agree,
            "cuda_graphs": graphs_info,
            "lora_kernel": None
            if trainer.adapted.kernel_verdict is None
            else trainer.adapted.kernel_verdict.record(),
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else None,
            "versions": {
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "triton": triton_version,
                "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
            },
            "peft": peft_info,
            "wall_s": time.perf_counter() - started,
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        },
        dtype=choice,
    )
    print("greedy token agreement with the mixed side:", {k: round(v, 3) for k, v in agree.items()})
    if args.json is not None:
        from lorafleet.fsio import atomic_write_json

        atomic_write_json(args.json, result)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"bench.gpu done in {time.perf_counter() - start:.1f} s")
