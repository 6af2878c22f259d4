"""The GPU paths on one CUDA device: multi-adapter sampling and training, SmolLM2-135M shape.

The base is SmolLM2-135M's architecture with random weights, in `--dtype` (default auto: bf16
on a CUDA device with native bf16, else fp32): throughput does not depend on the values, and a
GPU machine here has no copy of the real ones. Adapters are rank 16 on attention + MLP with
random non-zero B, as in bench/sample.py.

Sides, interleaved (A B A B ...), each reported by its minimum:
- sample mixed:        ADAPTERS adapters mixed in one continuous batch (kernel `auto`);
- sample mixed, loop:  the same with one pair of matmuls per adapter (kernel `loop`);
- sample base:         the same sequences with no adapter;
- peft_generate:       HF `generate` on a PeftModel with the same adapters, one
                       `set_adapter` + batched `generate` per adapter (skipped without peft);
- train mixed:         one forward_backward + optim_step over every adapter's items;
- train one at a time: the same items and steps, one adapter per call.
Ratios: mixed_over_base, speedup_vs_peft_generate, auto_over_loop, train_mixed_speedup.

    python -m bench.gpu --json bench/results/gpu.json [--config DIR_OR_CONFIG_JSON]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import (
    add_dtype_option,
    bench_dtype,
    interleaved,
    make_prompts,
    peft_generate_per_adapter,
    publish_random_adapters,
    report,
    torch_dtype,
)
from lorafleet.engines import Colocated, colocate
from lorafleet.fsio import atomic_write_json
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample import SampleRequest, SamplingParams
from lorafleet.train.engine import TrainItem
from lorafleet.train.optim import AdamHParams

PRESET = "smollm2-135m"
ADAPTERS = 8


def parse_cli() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"a HF config.json (or its folder); default: the {PRESET} preset's",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per side")
    parser.add_argument("--seqs-per-adapter", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--train-seqs-per-adapter", type=int, default=4)
    parser.add_argument("--train-len", type=int, default=256)
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to try the script out")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="write a torch.profiler table of one mixed generate here",
    )
    add_dtype_option(parser)
    return parser.parse_args()


def load_config(path: Path | None):
    from transformers import AutoConfig

    if path is None:
        from lorafleet.model.presets import materialize

        path = materialize(PRESET)
    return AutoConfig.from_pretrained(path.parent if path.name == "config.json" else path)


def random_base(config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def build_stack(
    model: torch.nn.Module, rank: int, max_rows: int
) -> tuple[Colocated, list, list[int]]:
    stack = colocate(
        model,
        resolve_tinker_targets(model, train_unembed=False),
        base_model_id=PRESET,
        train_slots=ADAPTERS,
        sample_slots=ADAPTERS,
        r_max=rank,
        max_rows=max_rows,
    )
    keys, slots = publish_random_adapters(stack, ADAPTERS, rank)
    return stack, keys, slots


def synced(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    def run() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


def main() -> None:
    args = parse_cli()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.gpu needs a CUDA device (torch.cuda.is_available() is False)")
    on_gpu = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    choice = bench_dtype(args.dtype, device)
    dtype = torch_dtype(choice)
    config = load_config(args.config)
    model = random_base(config, device, dtype)
    peft_base = random_base(config, device, dtype)
    peft_base.load_state_dict(model.state_dict())
    count = ADAPTERS * args.seqs_per_adapter
    stack, keys, slots = build_stack(model, args.rank, max_rows=count)
    vocab = stack.sampler.limits.vocab_size
    prompts = make_prompts(count, args.prompt_len, vocab)
    owner = [i % ADAPTERS for i in range(count)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, stop=[])
    mixed = [SampleRequest(p, params, adapter=keys[owner[i]]) for i, p in enumerate(prompts)]
    base = [SampleRequest(p, params, adapter=None) for p in prompts]
    adapted = stack.sampler.adapted
    outputs: dict[str, list[list[int]]] = {}

    def generate(requests, name: str, kernel: str = "auto") -> Callable[[], None]:
        def run() -> None:
            adapted.set_kernel(kernel)  # type: ignore[arg-type]
            try:
                results = stack.sampler.generate(requests)
            finally:
                adapted.set_kernel("auto")
            bad = [r.error for r in results if not r.ok]
            if bad:
                raise RuntimeError(f"{name}: {bad[0]}")
            outputs[name] = [r.sequences[0].tokens for r in results]

        return run

    sides: dict[str, Callable[[], None]] = {
        f"sample mixed ({ADAPTERS} adapters, {count} seqs)": generate(mixed, "mixed"),
        "sample mixed, loop kernel": generate(mixed, "mixed_loop", "loop"),
        f"sample base only ({count} seqs)": generate(base, "base"),
    }

    peft_info: dict[str, object] = {}
    try:
        from peft import PeftModel
    except ImportError as err:
        peft_info["skipped"] = f"peft not importable: {err}"
        PeftModel = None
    if PeftModel is not None:
        workdir = Path(tempfile.mkdtemp(prefix="lorafleet-bench-gpu-"))
        dirs = [stack.trainer.export_peft(slot, workdir / f"a{i}") for i, slot in enumerate(slots)]
        peft_model = PeftModel.from_pretrained(peft_base, dirs[0], adapter_name="a0")
        for i, path in enumerate(dirs[1:], start=1):
            peft_model.load_adapter(path, adapter_name=f"a{i}")
        peft_model.eval()
        pad_id = int(
            config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
        )

        def peft_generate() -> None:
            outputs["peft"] = peft_generate_per_adapter(
                peft_model, prompts, owner, args.new_tokens, pad_id, device
            )

        sides[f"peft_generate ({ADAPTERS} x set_adapter)"] = peft_generate

    gen = torch.Generator().manual_seed(7)
    train_items = {
        slot: [
            TrainItem(
                slot,
                seq[:-1],
                "cross_entropy",
                {"target_tokens": seq[1:], "weights": torch.ones(args.train_len)},
            )
            for seq in torch.randint(
                100, vocab, (args.train_seqs_per_adapter, args.train_len + 1), generator=gen
            )
        ]
        for slot in slots
    }
    hparams = {slot: AdamHParams(learning_rate=1e-5) for slot in slots}

    def train_mixed() -> None:
        stack.trainer.forward_backward([item for items in train_items.values() for item in items])
        stack.trainer.optim_step(hparams)

    def train_one_at_a_time() -> None:
        for slot, items in train_items.items():
            stack.trainer.forward_backward(items)
            stack.trainer.optim_step({slot: hparams[slot]})

    train_tokens = ADAPTERS * args.train_seqs_per_adapter * args.train_len
    sides[f"train mixed ({ADAPTERS} adapters, {train_tokens} tokens)"] = train_mixed
    sides["train one adapter at a time"] = train_one_at_a_time

    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    timings = interleaved({n: synced(f, device) for n, f in sides.items()}, repeats=args.repeats)
    names = list(timings)
    t = {n: timings[n]["min_s"] for n in names}
    total = count * args.new_tokens
    t_mixed, t_loop, t_base = t[names[0]], t[names[1]], t[names[2]]
    ratios = {
        "mixed_over_base": (t_base / t_mixed, ">= 0.85 (issue 4's CPU target, for reference)"),
        "auto_over_loop": (t_loop / t_mixed, "reference"),
        "train_mixed_speedup": (t[names[-1]] / t[names[-2]], "reference"),
    }
    tok_per_s = {"mixed": total / t_mixed, "mixed_loop": total / t_loop, "base": total / t_base}
    if "peft" in outputs:
        t_peft = t[names[3]]
        ratios["speedup_vs_peft_generate"] = (
            t_peft / t_mixed,
            ">= 3 (issue 4's CPU target, for reference)",
        )
        tok_per_s["peft_generate"] = total / t_peft
    agree = {
        name: sum(
            x == y
            for a, b in zip(outputs["mixed"], other, strict=True)
            for x, y in zip(a, b, strict=True)
        )
        / total
        for name, other in outputs.items()
        if name != "mixed"
    }
    result = report(
        f"gpu: {PRESET} architecture, random {choice.dtype} weights, {name}; "
        f"sample {count} seqs x {args.new_tokens} tokens, rank {args.rank}; train {train_tokens} tokens",
        timings,
        ratios,
        None,
        extra={
            "tok_per_s": tok_per_s,
            "train_tok_per_s": {
                "mixed": train_tokens / t[names[-2]],
                "one_at_a_time": train_tokens / t[names[-1]],
            },
            "greedy_token_agreement_with_mixed": agree,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else None,
            "device": name,
            "peft": peft_info,
            "config": vars(args)
            | {"json": str(args.json), "config": str(args.config), "profile": str(args.profile)},
        },
        dtype=choice,
    )
    print("greedy token agreement with the mixed side:", {k: round(v, 3) for k, v in agree.items()})
    if args.profile is not None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as prof:
            synced(generate(mixed, "mixed"), device)()
        sort_by = "cuda_time_total" if on_gpu else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=40)
        args.profile.write_text(table)
        print(f"wrote {args.profile}")
    if args.json is not None:
        atomic_write_json(args.json, result)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"bench.gpu done in {time.perf_counter() - start:.1f} s")
