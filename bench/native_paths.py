"""The native CPU LoRA kernels on every instruction-set path this CPU can run, side by side.

One `lf_lora_add` call (shrink + expand) per SmolLM2-135M layer shape, 8 adapters of rank 16,
at decode (32 tokens, 4 per adapter) and prefill (8 x 64 tokens), each path timed interleaved
with the others. On an AVX-512 machine this runs the AVX2 build on the same silicon, so
`avx2_over_avx512` says what the AVX2 path costs apart from the machine; on an AVX2 machine it
compares AVX2 with the generic build. Activations in `--dtype` (auto: the machine's base
dtype, as a forward would hand them over).

    .venv/bin/python -m bench.native_paths --json bench/results/native_paths.json
"""

from __future__ import annotations

import torch

from bench.common import bench_dtype, interleaved, parse_args, report, torch_dtype
from lorafleet.model import native
from lorafleet.model.routing import build_routing

ADAPTERS = 8
RANK = 16
SHAPES = {"q_proj": (576, 576), "gate_proj": (576, 1536), "down_proj": (1536, 576)}
TOKENS = {"decode": 32, "prefill": 8 * 64}


def _problem(in_features: int, out_features: int, tokens: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(in_features * 7 + out_features + tokens)
    slots = ADAPTERS + 1
    A = torch.randn(slots, RANK, in_features, generator=gen)
    B = torch.randn(slots, RANK, out_features, generator=gen).transpose(1, 2)  # rank-major
    slot_ids = torch.arange(tokens) % ADAPTERS + 1
    routing = build_routing(slot_ids, torch.full((slots,), 0.5), bank="bench")
    x = torch.randn(tokens, in_features, generator=gen).to(dtype)
    y = torch.zeros(tokens, out_features, dtype=dtype)
    plan = native.layer_plan(A, B)
    assert plan is not None
    return (A, B, routing), plan, x, y


def main() -> None:
    args = parse_args(__doc__, with_device=False)
    choice = bench_dtype(args.dtype)
    dtype = torch_dtype(choice)
    paths = native.runnable_paths()
    loaded = {path: native.kernels_for(path) for path in paths}
    sides = {}
    keep = []
    flops = {}
    for phase, tokens in TOKENS.items():
        for name, (in_f, out_f) in SHAPES.items():
            owner, plan, x, y = _problem(in_f, out_f, tokens, dtype)
            keep.append(owner)
            routing = owner[2]
            flops[(phase, name)] = 2 * tokens * RANK * (in_f + out_f)
            for path, nk in loaded.items():

                def call(nk=nk, plan=plan, routing=routing, x=x, y=y) -> None:
                    for _ in range(20):
                        native.lora_add(nk, plan, routing.native_plan, x, y)

                sides[f"{phase}/{name}/{path}"] = call
    timings = interleaved(sides, args.repeats, warmup=1)
    ratios: dict[str, tuple[float, str]] = {}
    totals = {
        path: sum(t["min_s"] for k, t in timings.items() if k.endswith(f"/{path}"))
        for path in paths
    }
    best = paths[0]
    for path in paths[1:]:
        ratios[f"{path}_over_{best}"] = (totals[path] / totals[best], "time ratio, all shapes")
    gflops = {
        side: flops[tuple(side.split("/")[:2])] * 20 / t["min_s"] / 1e9  # type: ignore[index]
        for side, t in timings.items()
    }
    report(
        f"native LoRA kernels per instruction-set path ({', '.join(paths)}), x in {choice.dtype}",
        timings,
        ratios,
        args.json,
        extra={"gflops": gflops, "paths": paths, "threads": torch.get_num_threads()},
        dtype=choice,
    )
    for side, value in gflops.items():
        print(f"{side:<34}{value:>12.1f} GFLOP/s")


if __name__ == "__main__":
    main()
