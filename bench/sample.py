"""Sampling throughput on SmolLM2-135M (bf16): 8 adapters mixed vs base only vs PEFT generate.

Every side generates the same number of tokens for the same prompts (greedy, no early stop):
- mixed:            our SampleEngine, ADAPTERS x seqs_per_adapter sequences, adapters mixed in
                    one continuous batch;
- base:             the same sequences with no adapter (slot 0), same engine;
- peft_generate:    HF `generate` on a PeftModel holding the same adapters (exported from our
                    banks), one `set_adapter` + batched `generate` per adapter.
Ratios: mixed_over_base = tok/s mixed / tok/s base (target >= 0.85) and
speedup_vs_peft_generate = tok/s mixed / tok/s PEFT (target >= 3). The adapters target
attention + MLP (not the unembedding) on both sides, rank 16, random non-zero B.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.sample --json bench/results/sample.json

The vLLM side (speedup_vs_vllm_cpu) is not implemented.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from bench.common import interleaved, parse_args, report
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.loader import load_base
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample import SampleRequest, SamplingParams
from lorafleet.sample.colocate import Colocated, colocate

ADAPTERS = 8
PRESET = "smollm2-135m"


def make_prompts(count: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """Lengths spread around prompt_len (so rows really sit at different lengths)."""
    gen = torch.Generator().manual_seed(0)
    lengths = [max(4, prompt_len - 8 + (7 * i) % 17) for i in range(count)]
    return [torch.randint(100, vocab, (n,), generator=gen).tolist() for n in lengths]


def build_ours(rank: int, max_rows: int) -> tuple[Colocated, list]:
    base = load_base(PRESET, dtype="bfloat16")
    paths = resolve_tinker_targets(base.model, train_unembed=False)
    stack = colocate(base.model, paths, base_model_id=PRESET, tokenizer=base.tokenizer, train_slots=ADAPTERS,
                     sample_slots=ADAPTERS, r_max=rank, max_rows=max_rows)
    keys = []
    for i in range(ADAPTERS):
        slot = stack.trainer.create_adapter(AdapterSpec(rank=rank, alpha=2.0 * rank, seed=i))
        gen = torch.Generator().manual_seed(1000 + i)
        weights = {p: (A, 0.02 * torch.randn(B.shape, generator=gen)) for p, (A, B) in stack.trainer.bank.slot_weights(slot).items()}
        stack.trainer.bank.load_slot_weights(slot, weights)
        keys.append(stack.versions.publish(f"adapter-{i}", stack.trainer.bank, slot))
    return stack, keys


def build_peft(stack: Colocated, workdir: Path):
    from peft import PeftModel

    base = load_base(PRESET, dtype="bfloat16")
    model = None
    for slot in range(1, ADAPTERS + 1):
        path = stack.trainer.export_peft(slot, workdir / f"a{slot - 1}")
        if model is None:
            model = PeftModel.from_pretrained(base.model, path, adapter_name="a0")
        else:
            model.load_adapter(path, adapter_name=f"a{slot - 1}")
    model.eval()
    return model, base.tokenizer


def main() -> None:
    args = parse_args(
        __doc__,
        seqs_per_adapter=(int, 4, "sequences per adapter"),
        new_tokens=(int, 32, "tokens generated per sequence"),
        prompt_len=(int, 32, "typical prompt length"),
        rank=(int, 16, "LoRA rank"),
        threads=(int, 0, "torch threads (0 = torch's default); 1 is steadier on busy shared CPUs"),
    )
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    stack, keys = build_ours(args.rank, max_rows=ADAPTERS * args.seqs_per_adapter)
    vocab = stack.sampler.limits.vocab_size
    count = ADAPTERS * args.seqs_per_adapter
    prompts = make_prompts(count, args.prompt_len, vocab)
    owner = [i % ADAPTERS for i in range(count)]  # adapters interleaved across rows
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, stop=[])
    mixed_requests = [SampleRequest(p, params, adapter=keys[owner[i]]) for i, p in enumerate(prompts)]
    base_requests = [SampleRequest(p, params, adapter=None) for p in prompts]
    total_tokens = count * args.new_tokens

    outputs: dict[str, list[list[int]]] = {}

    def ours(requests, name):
        def run():
            results = stack.sampler.generate(requests)
            outputs[name] = [r.sequences[0].tokens for r in results]
        return run

    workdir = Path(tempfile.mkdtemp(prefix="lorafleet-bench-sample-"))
    peft_model, tokenizer = build_peft(stack, workdir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def peft_generate():
        tokens: dict[int, list[int]] = {}
        for a in range(ADAPTERS):
            rows = [i for i in range(count) if owner[i] == a]
            longest = max(len(prompts[i]) for i in rows)
            ids = torch.full((len(rows), longest), pad_id, dtype=torch.int64)
            mask = torch.zeros_like(ids)
            for r, i in enumerate(rows):  # left padding, as generate expects
                ids[r, longest - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[r, longest - len(prompts[i]) :] = 1
            peft_model.set_adapter(f"a{a}")
            with torch.no_grad():
                out = peft_model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                    do_sample=False, pad_token_id=pad_id,
                )
            for r, i in enumerate(rows):
                tokens[i] = out[r, longest:].tolist()
        outputs["peft"] = [tokens[i] for i in range(count)]

    timings = interleaved(
        {
            f"mixed ({ADAPTERS} adapters, {count} seqs)": ours(mixed_requests, "mixed"),
            f"base only ({count} seqs)": ours(base_requests, "base"),
            f"peft_generate ({ADAPTERS} x set_adapter)": peft_generate,
        },
        repeats=args.repeats,
    )
    t_mixed, t_base, t_peft = (t["min_s"] for t in timings.values())
    agree = sum(a == b for a, b in zip(outputs["mixed"], outputs["peft"], strict=True)) / count
    report(
        f"sample: {PRESET} bf16, {count} seqs x {args.new_tokens} new tokens, rank {args.rank}",
        timings,
        {
            "mixed_over_base": (t_base / t_mixed, ">= 0.85"),
            "speedup_vs_peft_generate": (t_peft / t_mixed, ">= 3"),
        },
        args.json,
        extra={
            "tokens_per_side": total_tokens,
            "tok_per_s": {"mixed": total_tokens / t_mixed, "base": total_tokens / t_base, "peft_generate": total_tokens / t_peft},
            "greedy_agreement_with_peft": agree,
            "config": {"adapters": ADAPTERS, "seqs_per_adapter": args.seqs_per_adapter, "new_tokens": args.new_tokens,
                       "prompt_len": args.prompt_len, "rank": args.rank, "targets": "attn+mlp",
                       "threads": torch.get_num_threads()},
            "vllm": "not implemented",
        },
    )
    print(f"greedy sequences identical to PEFT's: {agree:.0%}")


if __name__ == "__main__":
    main()
