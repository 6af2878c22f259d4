"""Shared timing helpers: sides run interleaved (A B A B ...), each reported by its minimum.

The machines are shared and noisy, so benchmarks compare sides measured in the same run and
report ratios; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from lorafleet.fsio import atomic_write_bytes
from lorafleet.model.banks import AdapterSpec


def parse_args(description: str, **extra: tuple[type, object, str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed rounds per side (min is reported)"
    )
    for name, (kind, default, help_text) in extra.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=default, help=help_text
        )
    return parser.parse_args()


def interleaved(
    sides: Mapping[str, Callable[[], object]], repeats: int, warmup: int = 1
) -> dict[str, dict[str, float]]:
    """Runs every side once per round, round after round; returns min/median seconds per side."""
    for _ in range(warmup):
        for fn in sides.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    out = {}
    for name, values in times.items():
        ordered = sorted(values)
        out[name] = {
            "min_s": ordered[0],
            "median_s": ordered[len(ordered) // 2],
            "runs": len(values),
        }
    return out


def environment() -> dict[str, object]:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }


def report(
    title: str,
    timings: Mapping[str, Mapping[str, float]],
    ratios: Mapping[str, tuple[float, str]],
    json_path: Path | None,
    extra: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """Prints a table of sides and ratios (with their targets) and writes the JSON."""
    print(f"\n{title}")
    print(f"{'side':<34}{'min ms':>12}{'median ms':>12}")
    for name, t in timings.items():
        print(f"{name:<34}{t['min_s'] * 1e3:>12.2f}{t['median_s'] * 1e3:>12.2f}")
    print(f"\n{'ratio':<34}{'value':>12}  target")
    for name, (value, target) in ratios.items():
        print(f"{name:<34}{value:>12.3f}  {target}")
    result: dict[str, object] = {
        "benchmark": title,
        "timings": dict(timings),
        **{name: value for name, (value, _) in ratios.items()},
        "targets": {name: target for name, (_, target) in ratios.items()},
        "environment": environment(),
        **(dict(extra) if extra else {}),
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        # Atomic (a reader never sees half a result); NaN stays allowed, as before.
        atomic_write_bytes(json_path, (json.dumps(result, indent=2) + "\n").encode())
        print(f"\nwrote {json_path}")
    return result


def smollm2_shaped_config(**overrides):
    """SmolLM2-135M's architecture with random weights: timing needs the shapes, not the values."""
    from transformers import LlamaConfig

    values = dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def make_prompts(count: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """Random-token prompts with lengths spread around prompt_len (so rows really sit at
    different lengths); the same for every side of a benchmark."""
    gen = torch.Generator().manual_seed(0)
    lengths = [max(4, prompt_len - 8 + (7 * i) % 17) for i in range(count)]
    return [torch.randint(100, vocab, (n,), generator=gen).tolist() for n in lengths]


def publish_random_adapters(stack, count: int, rank: int) -> tuple[list, list[int]]:
    """`count` adapters of rank `rank` (alpha 2 * rank) in the trainer of a colocated `stack`,
    each with a random non-zero B (a fresh LoRA has B = 0 and equals the base), published to
    its sampler. Returns the version keys and the trainer slots."""
    keys, slots = [], []
    for i in range(count):
        slot = stack.trainer.create_adapter(AdapterSpec(rank=rank, alpha=2.0 * rank, seed=i))
        gen = torch.Generator().manual_seed(1000 + i)
        weights = {
            path: (A, 0.02 * torch.randn(B.shape, generator=gen))
            for path, (A, B) in stack.trainer.bank.slot_weights(slot).items()
        }
        stack.trainer.bank.load_slot_weights(slot, weights)
        keys.append(stack.versions.publish(f"adapter-{i}", stack.trainer.bank, slot))
        slots.append(slot)
    return keys, slots


def peft_generate_per_adapter(
    peft_model,
    prompts: list[list[int]],
    owner: list[int],
    new_tokens: int,
    pad_id: int,
    device: torch.device | str = "cpu",
) -> list[list[int]]:
    """The PEFT baseline: for each adapter `a{k}` in turn, `set_adapter` and one batched,
    left-padded greedy `generate` over its prompts (owner[i] is prompt i's adapter). Returns
    exactly `new_tokens` tokens per prompt, in prompt order."""
    tokens: dict[int, list[int]] = {}
    for adapter in sorted(set(owner)):
        rows = [i for i in range(len(prompts)) if owner[i] == adapter]
        longest = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), longest), pad_id, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(rows):  # left padding, as generate expects
            ids[r, longest - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, longest - len(prompts[i]) :] = 1
        peft_model.set_adapter(f"a{adapter}")
        with torch.no_grad():
            out = peft_model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        for r, i in enumerate(rows):
            tokens[i] = out[r, longest:].tolist()
    return [tokens[i] for i in range(len(prompts))]
