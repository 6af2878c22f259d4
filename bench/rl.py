"""RL steps on SmolLM2-135M: lorafleet vs TRL's GRPOTrainer + PEFT, and 4 tenants vs 1.

Every lorafleet side is GRPO steps through the real SDK against one embedded server (one step
per tenant: snapshot the adapter for sampling, 8 prompts x 4 samples, score, forward_backward
and optim_step). The TRL side is `GRPOTrainer` with a PEFT LoRA (`use_vllm=False`) in its own
venv, run by bench/trl_grpo.py as a long-lived subprocess (model loading stays out of the
timings) and timed per optimizer step by a TrainerCallback. Both sides run the same model; base
dtype (`--dtype`, default the main job's `auto`, resolved once here and given to both sides as
the same concrete dtype; LoRA weights fp32 on both sides); task
(built-in `arithmetic`, prompts rendered by our side, rewards from our scorer); group size,
prompts per step and max tokens; LoRA rank, alpha and target layers (attention + MLP, read back
from our adapter's PEFT config; not the unembedding, which TRL cannot train through a LoRA);
learning rate and Adam settings. Two phases, so that no two big processes hold memory at once:
(1) our 1-tenant step and TRL's step, alternating; (2) TRL's process gone, our 1-tenant step and
the 4-tenant step, alternating. Each ratio compares steps from its own phase.

- `step_time_over_trl`: our median seconds per 1-tenant step / TRL's (target <= 0.5);
  `token_time_over_trl` compares seconds per generated token as well, since the sides may
  stop at EOS at different points.
- `tenants4_throughput_over_1`: rollouts/s with 4 tenants in one run over 1 tenant (>= 1.5),
  over all timed rounds (total rollouts / total seconds on each side).
  The 1-tenant steps of that phase are the same four tenants' steps, taken alone in turn, so
  both sides train at the same point of learning (a tenant whose groups all agree trains
  nothing, and its step is cheap); `trained_rows` per step is in the JSON.
- `lorafleet_phases`: where our 1-tenant step's time goes, from the client (per SDK call)
  and from the server (time inside the engine per request kind).

    .venv/bin/python -m bench.rl --setup-trl --json bench/results/rl.json

Without a TRL venv (`--trl-venv`, created by `--setup-trl` = scripts/setup_trl.sh) the TRL side
is skipped. `--device cuda` runs the embedded server (trainer, sampler, caches) on the GPU, as
`lorafleet rl --device cuda` does; TRL's side is then skipped (it runs on the CPU here), which
leaves `tenants4_throughput_over_1` (scripts/gpu_check.sh runs it on `qwen3-1.7b-shape`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import resource
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from itertools import count
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

from bench import trl_side
from bench.common import (
    add_device_option,
    add_dtype_option,
    add_numerics_option,
    bench_device,
    bench_dtype,
    bench_numerics,
    report,
)
from bench.reward_runs import adapter_config as peft_adapter_config
from lorafleet.rl.connect import Backend, load_tokenizer, start_backend
from lorafleet.rl.envs import make_env
from lorafleet.rl.loop import RLConfig, TenantConfig, TenantRunner
from lorafleet.rl.report import Progress

PROMPTS, GROUP, RANK = 8, 4, 8
# The main job's base dtype (`lorafleet rl`), so the bench measures what users run.
DEFAULT_DTYPE = next(f.default for f in dataclasses.fields(RLConfig) if f.name == "dtype")
# Two phases, each interleaving lorafleet's 1-tenant step with its counterpart, so no two big
# processes hold their memory at once: (1) TRL's process alive, (2) TRL's process gone, 4 tenants.
ONE_T, TRL = "lorafleet 1 tenant (vs TRL)", "TRL GRPOTrainer 1 adapter"
ONE_4, FOUR = "lorafleet 1 tenant (vs 4 tenants)", "lorafleet 4 tenants"


# ================================================================== where our step's time goes
class _TimedFuture:
    def __init__(
        self,
        inner: Any,
        name: str,
        log: list[tuple[str, float, float]],
        wrap: Callable[[Any], Any] | None = None,
    ):
        self.inner, self.name, self.log, self.wrap = inner, name, log, wrap
        self.submitted = time.perf_counter()

    def result(self, *args: Any, **kwargs: Any) -> Any:
        value = self.inner.result(*args, **kwargs)
        self.log.append((self.name, self.submitted, time.perf_counter()))
        return self.wrap(value) if self.wrap is not None else value


class _TimedSampler:
    def __init__(self, inner: Any, log: list[tuple[str, float, float]]):
        self.inner, self.log = inner, log

    def sample(self, *args: Any, **kwargs: Any) -> _TimedFuture:
        return _TimedFuture(self.inner.sample(*args, **kwargs), "sample", self.log)


class TimedTrainingClient:
    """Stands in for a TrainingClient in TenantRunner.train_step (the real step, unchanged) and
    logs each SDK call from submission to its result."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.log: list[tuple[str, float, float]] = []

    def save_weights_and_get_sampling_client(self, *args: Any, **kwargs: Any) -> _TimedFuture:
        inner = self.inner.save_weights_and_get_sampling_client(*args, **kwargs)
        return _TimedFuture(inner, "snapshot", self.log, lambda s: _TimedSampler(s, self.log))

    def forward_backward(self, *args: Any, **kwargs: Any) -> _TimedFuture:
        return _TimedFuture(
            self.inner.forward_backward(*args, **kwargs), "forward_backward", self.log
        )

    def optim_step(self, *args: Any, **kwargs: Any) -> _TimedFuture:
        return _TimedFuture(self.inner.optim_step(*args, **kwargs), "optim_step", self.log)

    def phases(self, start: float, end: float) -> dict[str, float]:
        """Client-side seconds: snapshot, sample (first submit -> last result), score (client
        work until forward_backward is sent), forward_backward, optim_step (after fb's result),
        other (the rest of the step)."""
        spans = defaultdict(list)
        for name, sent, done in self.log:
            spans[name].append((sent, done))
        out: dict[str, float] = {}
        snap = spans["snapshot"][0]
        sample_start, sample_end = (
            min(s for s, _ in spans["sample"]),
            max(d for _, d in spans["sample"]),
        )
        out["snapshot_s"] = snap[1] - snap[0]
        out["sample_s"] = sample_end - sample_start
        if spans["forward_backward"]:
            fb, opt = spans["forward_backward"][0], spans["optim_step"][0]
            out["score_and_datums_s"] = fb[0] - sample_end
            out["forward_backward_s"] = fb[1] - fb[0]
            out["optim_step_s"] = opt[1] - fb[1]
        out["other_s"] = (end - start) - sum(out.values())
        self.log.clear()
        return out


class EngineClock:
    """Wraps the embedded server's executor entry points (bench-only, instance attributes) to
    add up the seconds the engine itself spends per kind of call, and to list each call (kind,
    requests in it, seconds): how well one step's requests were batched. Sampling is either one
    blocking `run_sample` per batch or `start_sample` + one `step_sampler` per decode step
    (continuous batching), depending on the server version."""

    ENTRY_POINTS = ("run_train", "run_optim", "run_sample", "start_sample", "step_sampler")

    def __init__(self, backend: Backend):
        executor = backend.server.service.executor  # type: ignore[union-attr]
        self.batches: list[tuple[str, int, float]] = []
        for name in self.ENTRY_POINTS:
            if hasattr(executor, name):
                kind = name.removeprefix("run_")
                setattr(
                    executor,
                    name,
                    self._wrap(
                        getattr(executor, name), lambda *a, k=kind: (k, len(a[0]) if a else 0)
                    ),
                )
        executor.run_control = self._wrap(
            executor.run_control, lambda op: (f"control:{op.kind}", 1)
        )

    def _wrap(
        self, fn: Callable[..., Any], key: Callable[..., tuple[str, int]]
    ) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.batches.append((*key(*args), time.perf_counter() - start))

        return timed

    def take(self) -> tuple[dict[str, float], list[tuple[str, int, float]]]:
        """(seconds and call count per kind, the calls) since the last call."""
        seconds: dict[str, float] = defaultdict(float)
        calls: dict[str, float] = defaultdict(float)
        for kind, _, secs in self.batches:
            seconds[f"{kind}_s"] += secs
            calls[f"{kind}_calls"] += 1
        batches, self.batches = self.batches, []
        return dict(sorted(seconds.items())) | dict(sorted(calls.items())), batches


# ================================================================== the TRL side
def trl_spec(
    backend: Backend,
    tokenizer: Any,
    adapter_config: dict[str, Any],
    tenant: TenantConfig,
    torch_threads: int | None,
    steps: int,
    dtype: str,
) -> dict[str, Any]:
    """TRL's side of this bench (bench/trl_side.py): our prompts from one fixed generator seed,
    shuffled by TRL, TRL's default loss (dapo): only step time is compared here."""
    assert backend.tokenizer_dir is not None  # embedded: the preset's local dir
    return trl_side.trl_spec(
        model_dir=backend.tokenizer_dir,
        dtype=dtype,
        task=tenant.task,
        problems=make_env(tenant.task).problems(random.Random(12345), PROMPTS * steps),
        tokenizer=tokenizer,
        system_prompt=tenant.system_prompt,
        prompts_per_step=tenant.prompts_per_step,
        group_size=tenant.group_size,
        max_tokens=tenant.max_tokens,
        temperature=tenant.temperature,
        learning_rate=tenant.learning_rate,
        lora=adapter_config,
        seed=tenant.seed,
        torch_threads=torch_threads,
    )


# ================================================================== driver
def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"min_s": ordered[0], "median_s": statistics.median(ordered), "runs": len(ordered)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed rounds (each: our step, 4 tenants, TRL steps)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=16, help="tokens sampled per rollout (max)"
    )
    parser.add_argument("--base-model", default="smollm2-135m", help="preset or HF dir")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch threads on both sides (default: torch's)",
    )
    add_dtype_option(parser, default=DEFAULT_DTYPE)
    add_device_option(parser)  # the embedded server's; TRL's side stays on the CPU
    add_numerics_option(parser)  # the embedded server's
    parser.add_argument("--trl-venv", type=Path, default=trl_side.DEFAULT_TRL_VENV)
    parser.add_argument(
        "--setup-trl", action="store_true", help="create --trl-venv first (scripts/setup_trl.sh)"
    )
    parser.add_argument("--trl-warmup", type=int, default=2, help="TRL steps run before timing")
    parser.add_argument("--trl-steps-per-round", type=int, default=1, help="TRL steps per round")
    parser.add_argument("--no-tenants4", action="store_true", help="skip the 4-tenant side")
    args = parser.parse_args()
    # Resolved here, once: our server and TRL's process both get this concrete dtype.
    device = bench_device(args.device).device
    choice = bench_dtype(args.dtype, device)
    dtype = choice.dtype
    numerics = bench_numerics(args.numerics)
    if args.setup_trl:
        trl_side.setup_trl(args.trl_venv)
    trl_python = trl_side.trl_python(args.trl_venv)
    if not trl_python.exists():
        print(f"no TRL venv at {args.trl_venv} (pass --setup-trl): measuring lorafleet only")

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        tenants = [
            TenantConfig(
                name=f"t{i}",
                task="arithmetic",
                prompts_per_step=PROMPTS,
                group_size=GROUP,
                max_tokens=args.max_tokens,
                rank=RANK,
                seed=i,
            )
            for i in range(5)
        ]
        keys = [f"tml-bench-rl-{i:02d}-0123456789" for i in range(5)]
        backend = start_backend(
            base_model=args.base_model,
            run_dir=run_dir,
            keys=keys,
            base_url=None,
            dtype=dtype,
            max_adapters=5,
            max_rank=RANK,  # as `lorafleet rl` sizes its banks: the tenants' largest rank
            max_sample_rows=128,
            torch_threads=args.torch_threads,
            device=device,
            numerics=numerics,
        )
        config = RLConfig(
            args.base_model, run_dir, tenants, progress=False, dtype=dtype, device=device
        )
        stop = threading.Event()
        runners = [
            TenantRunner(t, config, backend, k, Progress(False), stop)
            for t, k in zip(tenants, keys, strict=True)
        ]
        clients = [backend.client(k) for k in keys]
        # attn + mlp, no unembedding: TRL refuses LoRA on lm_head (its log-probs read lm_head.weight).
        tcs = [
            c.create_lora_training_client(
                backend.base_model, rank=RANK, seed=i, train_unembed=False
            ).result()
            for i, c in enumerate(clients)
        ]
        tokenizer = load_tokenizer(backend, tcs[0])
        # What our adapter really is (rank, alpha, exact target layers), from its PEFT export.
        adapter_config = peft_adapter_config(backend, keys[0], tcs[0])
        clock = EngineClock(backend)
        timed_tc = TimedTrainingClient(tcs[0])
        steps = count()
        rows: dict[str, list[dict[str, Any]]] = {ONE_T: [], TRL: [], ONE_4: [], FOUR: []}
        phases: list[dict[str, Any]] = []

        def one(record: str | None, who: int = 0) -> None:
            timed = timed_tc if who == 0 else TimedTrainingClient(tcs[who])
            clock.take()
            start = time.perf_counter()
            row = runners[who].train_step(timed, tokenizer, next(steps))
            end = time.perf_counter()
            client, (engine, batches) = timed.phases(start, end), clock.take()
            if record is not None:
                rows[record].append(
                    {
                        "step_s": end - start,
                        "tokens": row["sampled_tokens"],
                        "trained_rows": row["trained_rows"],
                    }
                )
                phases.append({"client": client, "engine": engine, "engine_batches": batches})

        def four(record: bool) -> None:
            step = next(steps)
            out: list[dict[str, Any]] = [{} for _ in range(4)]

            def run(i: int) -> None:
                out[i] = runners[i + 1].train_step(tcs[i + 1], tokenizer, step)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            end = time.perf_counter()
            if record:
                rows[FOUR].append(
                    {
                        "step_s": end - start,
                        "tokens": sum(r["sampled_tokens"] for r in out),
                        "trained_rows": sum(r["trained_rows"] for r in out),
                    }
                )

        trl: trl_side.TrlSide | None = None
        try:
            if trl_python.exists() and device != "cpu":
                print("TRL's side runs on the CPU only: skipped with --device " + device)
            elif trl_python.exists():
                steps_needed = args.trl_warmup + args.repeats * args.trl_steps_per_round
                spec = trl_spec(
                    backend,
                    tokenizer,
                    adapter_config,
                    tenants[0],
                    args.torch_threads,
                    max(steps_needed, 16),
                    dtype,
                )
                trl = trl_side.TrlSide(trl_python, spec, run_dir)
                trl.check(lora_modules=adapter_config["target_modules"], dtype=dtype)
                trl.steps(args.trl_warmup)
                one(None)
                for _ in range(args.repeats):
                    one(ONE_T)
                    rows[TRL].extend(trl.steps(args.trl_steps_per_round))
                trl.close()
            if not args.no_tenants4:
                # The solo steps are the same four tenants' steps, in turn: a tenant's step
                # costs more while its groups still disagree (more rows to train), so solo
                # and together must be measured at the same point of learning.
                one(None, who=1)
                four(False)
                for round_ in range(args.repeats):
                    one(ONE_4, who=1 + round_ % 4)
                    four(True)
        finally:
            if trl is not None:
                trl.close()
            for c in clients:
                c.close("success").result(timeout=30)
            backend.close()

    timings = {
        name: _summary([r["step_s"] for r in values]) for name, values in rows.items() if values
    }
    tokens = {
        name: statistics.median(r["tokens"] for r in values)
        for name, values in rows.items()
        if values
    }
    ratios: dict[str, tuple[float, str]] = {}
    if FOUR in timings:
        # All timed rounds together (rollouts / total seconds), not the fastest step: a step's
        # work varies with how many of its groups still disagree (rows to train), so the
        # fastest solo step is often one that trained next to nothing.
        t1 = sum(r["step_s"] for r in rows[ONE_4]) / len(rows[ONE_4])
        t4 = sum(r["step_s"] for r in rows[FOUR]) / len(rows[FOUR])
        ratios["tenants4_throughput_over_1"] = ((4 * 32 / t4) / (32 / t1), ">= 1.5")
    if TRL in timings:
        ratios["step_time_over_trl"] = (
            timings[ONE_T]["median_s"] / timings[TRL]["median_s"],
            "<= 0.5",
        )
        per_token = {
            n: statistics.median(r["step_s"] / max(r["tokens"], 1) for r in rows[n])
            for n in (ONE_T, TRL)
        }
        ratios["token_time_over_trl"] = (
            per_token[ONE_T] / per_token[TRL],
            "<= 0.5 (per generated token)",
        )
    phase_median = {
        side: {
            k: statistics.median(p[side].get(k, 0.0) for p in phases)
            for k in sorted({k for p in phases for k in p[side]})
        }
        for side in ("client", "engine")
    }
    trl_phases = [r["phases"] for r in rows[TRL]]
    trl_phase_median = {
        k: statistics.median(p.get(k, 0.0) for p in trl_phases)
        for k in sorted({k for p in trl_phases for k in p})
    }
    if trl_phase_median:
        print(
            "\nTRL step, median seconds per TRL-profiled phase (nested: _prepare_inputs holds generate and rewards):"
        )
        print("  " + ", ".join(f"{k} {v:.3f}" for k, v in trl_phase_median.items()))
    print("\nlorafleet 1-tenant step, median seconds per phase:")
    for side, values in phase_median.items():
        print(
            f"  {side}: " + ", ".join(f"{k} {v:.3f}" for k, v in values.items() if k.endswith("_s"))
        )
    if phases:
        last = [(k, n) for k, n, _ in phases[-1]["engine_batches"] if k != "step_sampler"]
        print(
            "  engine calls of the last step but step_sampler (kind, requests): "
            + ", ".join(f"{k} x{n}" for k, n in last)
        )
    print(
        "median generated tokens per step: " + ", ".join(f"{n}: {t:.0f}" for n, t in tokens.items())
    )
    report(
        f"RL steps, {args.base_model} ({dtype} base), 8 prompts x 4 samples x <= {args.max_tokens} tokens per tenant-step, LoRA rank {RANK}",
        timings,
        ratios,
        args.json,
        extra={
            "max_tokens": args.max_tokens,
            "prompts_per_step": PROMPTS,
            "group_size": GROUP,
            "dtype": dtype,
            "device": device,
            "learning_rate": tenants[0].learning_rate,
            "lora": {k: adapter_config[k] for k in ("r", "lora_alpha")}
            | {"target_layers": len(adapter_config["target_modules"])},
            "loss": {
                "lorafleet": tenants[0].loss_fn,
                "trl": "dapo, beta=0, scale_rewards=none, num_iterations=1",
            },
            "generated_tokens_per_step_median": tokens,
            "lorafleet_trained_rows_per_step": [
                r["trained_rows"] for r in rows[ONE_T] + rows[ONE_4]
            ],
            "lorafleet_phases_median": phase_median,
            "lorafleet_phases": phases,
            "trl_phases_median": trl_phase_median,
            "steps": rows,
            "trl": None
            if trl is None
            else {k: v for k, v in trl.info.items() if k != "lora_modules"}
            | {"lora_layers_same_as_ours": len(trl.info["lora_modules"])},
            "torch_threads": args.torch_threads,
            "max_rss_mib": {
                "lorafleet (client + server)": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                / 1024,
                "trl": None if trl is None else trl.max_rss_mib,
            },
        },
        dtype=choice,
    )


if __name__ == "__main__":
    main()
