"""What batch-invariant numerics cost: the README job's RL step, batch-invariant vs fast.

The README job (`lorafleet rl --tenants 2 --tasks arithmetic,rg:chain_sum`) reduced to its
engine work, on one colocated stack over SmolLM2-135M: per step and tenant, publish the
adapter, sample 8 prompts x 4 samples (max 20 tokens, temperature 1, stop at EOS) of the task
rendered in the chat template with the default system prompt, score, and one
`forward_backward` (importance_sampling, group-centred advantages) and `optim_step` (AdamW,
lr 5e-4). Both tenants' samples go into one `generate` and both tenants' datums into one
`forward_backward`, as the server's rounds batch them. The HTTP and SDK time of the real
command is the same for both modes and is left out, so the ratio here is an upper bound of the
command's.

The machine is shared, so besides wall time each side records its process CPU time (one torch
thread: the work the step did, however long it waited for a core); the cost is judged on CPU
time and the wall-time ratio is recorded next to it.

Sides, interleaved step by step on the same model (`apply_numerics` switches it; the adapters
keep training): `fast` and `batch-invariant`, each for the 2-tenant README step and for the
1-tenant step (bench/rl.py's, tenant 0 alone). Reported: min and median seconds per step, and
`invariant_step_cost` = median batch-invariant / median fast - 1 in CPU time (README step),
`invariant_step_cost_1_tenant`, and both in wall time (`..._wall`).

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.numerics_cost --repeats 4 --json bench/results/numerics_cost.json
"""

from __future__ import annotations

import faulthandler
import random
import signal
import statistics
import time

import torch

from bench.common import bench_device, bench_dtype, parse_args, report
from lorafleet.adapters.hparams import AdamHParams
from lorafleet.engines import Colocated, colocate
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.loader import load_base
from lorafleet.model.numerics import NUMERICS, apply_numerics
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.rl.datums import group_advantages
from lorafleet.rl.envs import DEFAULT_SYSTEM_PROMPT, Env, make_env
from lorafleet.rl.loop import render_prompt
from lorafleet.sample import SampleRequest, SamplingParams
from lorafleet.train.items import TrainItem

PRESET = "smollm2-135m"
TASKS = ("arithmetic", "rg:chain_sum")
PROMPTS, GROUP, MAX_TOKENS, RANK = 8, 4, 20, 8


class Tenant:
    def __init__(self, stack: Colocated, task: str, index: int):
        self.stack, self.env, self.name = stack, make_env(task), f"t{index}"
        self.slot = stack.trainer.create_adapter(AdapterSpec(rank=RANK, alpha=32.0, seed=index))
        self.rng = random.Random(index)
        self.version = 0


def _step(tenants: list[Tenant], tokenizer: object, seed: int) -> None:
    """One RL step for `tenants` together (see the module docstring)."""
    stack = tenants[0].stack
    requests, owners, problems = [], [], []
    for tenant in tenants:
        tenant.version += 1
        key = stack.versions.publish(
            tenant.name, stack.trainer.bank, tenant.slot, version=tenant.version
        )
        env: Env = tenant.env
        for k, problem in enumerate(env.problems(tenant.rng, PROMPTS)):
            prompt = render_prompt(tokenizer, problem.question, DEFAULT_SYSTEM_PROMPT)
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed * 100 + k)
            requests.append(SampleRequest(prompt, params, adapter=key, num_samples=GROUP))
            owners.append(tenant)
            problems.append(problem)
    results = stack.sampler.generate(requests)
    items: list[TrainItem] = []
    for request, result, tenant, problem in zip(requests, results, owners, problems, strict=True):
        if not result.ok:
            raise RuntimeError(f"a sample failed: {result.error}")
        texts = [
            tokenizer.decode(s.tokens, skip_special_tokens=True)  # type: ignore[attr-defined]
            for s in result.sequences
        ]
        rewards = [tenant.env.score(problem, t) for t in texts]
        prompt = list(request.prompt)
        for seq, advantage in zip(result.sequences, group_advantages(rewards), strict=True):
            if not seq.tokens:
                continue
            pad = len(prompt) - 1
            n = len(seq.tokens)
            items.append(
                TrainItem(
                    tenant.slot,
                    torch.tensor(prompt + seq.tokens[:-1]),
                    "importance_sampling",
                    {
                        "target_tokens": torch.tensor([0] * pad + seq.tokens),
                        "logprobs": torch.tensor([0.0] * pad + seq.logprobs),
                        "advantages": torch.tensor([0.0] * pad + [advantage] * n),
                    },
                )
            )
    stack.trainer.forward_backward(items)
    stack.trainer.optim_step({t.slot: AdamHParams(learning_rate=5e-4) for t in tenants})


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: where a slow run spends its time
    args = parse_args(__doc__, threads=(int, 1, "torch threads (the server runs one)"))
    torch.set_num_threads(args.threads)
    device = bench_device(args.device).device
    choice = bench_dtype(args.dtype, device)
    base = load_base(PRESET, dtype=choice.dtype, device=device)
    stack = colocate(
        base.model,
        resolve_tinker_targets(base.model),
        base_model_id=PRESET,
        tokenizer=base.tokenizer,
        train_slots=2,
        sample_slots=8,
        r_max=RANK,
        max_rows=PROMPTS * GROUP * len(TASKS),
    )
    tenants = [Tenant(stack, task, i) for i, task in enumerate(TASKS)]
    sides = {
        f"{mode} {label}": (mode, group)
        for label, group in (("2 tenants", tenants), ("1 tenant", tenants[:1]))
        for mode in NUMERICS[::-1]  # fast first
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(1 + args.repeats):  # the first round warms up, untimed
        for name, (mode, group) in sides.items():
            apply_numerics(stack.adapted.model, mode)
            start, start_cpu = time.perf_counter(), time.process_time()
            _step(group, base.tokenizer, round_)
            took, took_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            print(f"  {name}: {took:.2f}s wall, {took_cpu:.2f}s cpu", flush=True)
            if round_:
                times[name].append(took)
                cpu[name].append(took_cpu)
        print(
            f"round {round_}: " + ", ".join(f"{n} {v[-1]:.2f}s" for n, v in times.items() if v),
            flush=True,
        )
    timings = {
        name: {"min_s": min(v), "median_s": statistics.median(v), "runs": len(v)}
        for name, v in times.items()
    }
    cpu_timings = {
        f"{name} (cpu)": {"min_s": min(v), "median_s": statistics.median(v), "runs": len(v)}
        for name, v in cpu.items()
    }

    def cost(label: str, table: dict[str, dict[str, float]], suffix: str = "") -> float:
        fast = table[f"fast {label}{suffix}"]["median_s"]
        return table[f"batch-invariant {label}{suffix}"]["median_s"] / fast - 1.0

    report(
        "batch-invariant vs fast numerics: RL step time (README job's engine work)",
        {**timings, **cpu_timings},
        {
            "invariant_step_cost": (
                cost("2 tenants", cpu_timings, " (cpu)"),
                "<= 0.15 for batch-invariant by default (process CPU time)",
            ),
            "invariant_step_cost_1_tenant": (cost("1 tenant", cpu_timings, " (cpu)"), "recorded"),
            "invariant_step_cost_wall": (cost("2 tenants", timings), "recorded (load-noisy)"),
            "invariant_step_cost_1_tenant_wall": (cost("1 tenant", timings), "recorded"),
        },
        args.json,
        {"numerics": list(NUMERICS), "threads": args.threads},
        dtype=choice,
    )


if __name__ == "__main__":
    main()
