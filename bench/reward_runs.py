"""RL runs for reward comparisons: ours through the Tinker SDK, TRL's as a peer process, stepped
in alternation (bench/parity.py, bench/lora_vs_full.py).

Our run is one tenant of an embedded lorafleet server, trained by `lorafleet rl`'s own step
(TenantRunner.rollout + TenantRunner.train: the same sampling, scoring, group-centred advantages,
datums, loss and AdamParams as `lorafleet rl`), with held-out evaluation off so that step k's
problems are exactly `env.problems(Random(step_seed(seed, k)), prompts)`. TRL's run is
bench/trl_grpo.py fed those same problems in that order. Both report the same per-step row:

- `reward_mean`, `adv_abs_mean` (mean |advantage| over all rollouts), `nonzero_adv_frac`
  (rollouts whose advantage is not 0: the rows that carry gradient), `sampled_len_mean`
  (tokens per completion, EOS included), `step_s`;
- both: `prompts_match` (the questions the step drew are the recipe's for that step, in
  order: the same on both sides);
- ours: `log_ratio_mean/min/max` (trainer log-prob minus sampler log-prob over the trained
  tokens: how on-policy the step really was), `trained_rows`, `optimizer_stepped` (False when
  every group agreed: `lorafleet rl` then sends no forward_backward and no optim_step);
- TRL's: `clip_frac` (its PPO clip's region fraction, 0 when on-policy), `entropy`.

Runs are stepped in pairs, A's step then B's, so that machine load falls on both alike.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from bench.trl_side import TrlSide, trl_spec
from lorafleet.rl.connect import Backend, load_tokenizer
from lorafleet.rl.datums import group_advantages
from lorafleet.rl.envs import Env, Problem, make_env
from lorafleet.rl.loop import RLConfig, TenantConfig, TenantRunner, step_seed
from lorafleet.rl.report import Progress

# TRL's closest loss to our summed importance_sampling: see bench/parity.py's docstring.
TRL_LOSS = "dr_grpo"


class Run(Protocol):
    label: str

    def step(self, step: int) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Recipe:
    """What both systems run: the task and its sampling, the learning rate, the seed."""

    task: str = "arithmetic"
    prompts_per_step: int = 8
    group_size: int = 4
    max_tokens: int = 20
    temperature: float = 1.0
    learning_rate: float = 5e-4
    seed: int = 0

    def tenant(self, name: str, rank: int) -> TenantConfig:
        """Our tenant for this recipe (loss left to `lorafleet rl`'s default: importance_sampling)."""
        return TenantConfig(
            name=name,
            task=self.task,
            learning_rate=self.learning_rate,
            rank=rank,
            prompts_per_step=self.prompts_per_step,
            group_size=self.group_size,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            seed=self.seed,
        )

    def problems(self, steps: int) -> list[Problem]:
        """Every step's problems in order, as our TenantRunner draws them without held-out."""
        env = make_env(self.task)
        return [
            p
            for step in range(steps)
            for p in env.problems(random.Random(step_seed(self.seed, step)), self.prompts_per_step)
        ]

    def with_(self, **changes: Any) -> Recipe:
        return replace(self, **changes)


def slug(label: str) -> str:
    """A run label as a file or tenant name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.") or "run"


def group_stats(rewards: Sequence[float], group_size: int) -> dict[str, float]:
    """mean |advantage| and the fraction of nonzero advantages over rollouts laid out group
    after group, with `lorafleet rl`'s advantages (rl/datums.py group_advantages)."""
    if not rewards or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    advantages = [
        a
        for i in range(0, len(rewards), group_size)
        for a in group_advantages(rewards[i : i + group_size])
    ]
    return {
        "adv_abs_mean": sum(abs(a) for a in advantages) / len(advantages),
        "nonzero_adv_frac": sum(a != 0.0 for a in advantages) / len(advantages),
    }


class _DrawnEnv:
    """The task's env, keeping the questions of its last draw: what our step really trained on,
    compared with the recipe's (and so with TRL's) per step."""

    def __init__(self, inner: Env):
        self.inner, self.name = inner, inner.name
        self.drawn: list[str] = []

    def problems(self, rng: random.Random, count: int) -> list[Problem]:
        out = self.inner.problems(rng, count)
        self.drawn = [p.question for p in out]
        return out

    def score(self, problem: Problem, completion: str) -> float:
        return self.inner.score(problem, completion)

    def correct(self, problem: Problem, completion: str) -> bool:
        return self.inner.correct(problem, completion)


def expected_questions(problems: Sequence[Problem], step: int, per_step: int) -> list[str]:
    return [p.question for p in problems[step * per_step : (step + 1) * per_step]]


class _Recorded:
    """A Tinker future whose result is kept once read."""

    def __init__(self, inner: Any, sink: list[Any]):
        self.inner, self.sink = inner, sink

    def result(self, *args: Any, **kwargs: Any) -> Any:
        value = self.inner.result(*args, **kwargs)
        self.sink.append(value)
        return value


class _RecordingClient:
    """Stands in for the TrainingClient in TenantRunner.train (the real step, unchanged) and
    keeps forward_backward's results, whose metrics hold the step's log-ratios."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.fb_results: list[Any] = []

    def forward_backward(self, *args: Any, **kwargs: Any) -> _Recorded:
        return _Recorded(self.inner.forward_backward(*args, **kwargs), self.fb_results)

    def optim_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.optim_step(*args, **kwargs)


def adapter_config(backend: Backend, api_key: str, training_client: Any) -> dict[str, Any]:
    """What our adapter really is (rank, alpha, exact target layers), from its PEFT export."""
    probe = training_client.save_weights_for_sampler("bench-lora-config").result().path
    peft_dir = backend.peft_dir(api_key, probe)
    if peft_dir is None:
        raise RuntimeError("the adapter's PEFT config is readable from an embedded server only")
    return json.loads((peft_dir / "adapter_config.json").read_text())


class OurRun:
    """One tenant on the embedded server, a LoRA on attention + MLP (no unembedding, which TRL
    cannot train through a LoRA), trained step by step."""

    def __init__(
        self,
        backend: Backend,
        api_key: str,
        recipe: Recipe,
        *,
        rank: int,
        steps: int,
        run_dir: Path,
        label: str,
    ):
        self.label, self.recipe = label, recipe
        tenant = recipe.tenant(slug(label), rank)
        self.service = backend.client(api_key)
        tc = self.service.create_lora_training_client(
            backend.base_model, rank=rank, seed=recipe.seed, train_unembed=False
        ).result()
        self.tc = tc
        self.recording = _RecordingClient(tc)
        self.tokenizer = load_tokenizer(backend, tc)
        self.lora = adapter_config(backend, api_key, tc)
        config = RLConfig(backend.base_model, run_dir, [tenant], progress=False, eval_every=0)
        self.env = _DrawnEnv(make_env(recipe.task))
        self.problems = recipe.problems(steps)
        self.runner = TenantRunner(
            tenant, config, backend, api_key, Progress(False), threading.Event(), env=self.env
        )

    def step(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.recording.fb_results.clear()
        rollouts = self.runner.rollout(self.runner.new_sampler(self.tc), self.tokenizer, step, step)
        row = self.runner.train(self.recording, rollouts, step, t0)  # type: ignore[arg-type]
        out: dict[str, Any] = {
            "step": step,
            "reward_mean": row["reward_mean"],
            **group_stats(rollouts.rewards, self.recipe.group_size),
            "sampled_len_mean": row["sampled_tokens"] / row["rollouts"],
            "trained_rows": row["trained_rows"],
            "optimizer_stepped": row["trained_rows"] > 0,
            "loss_fn": row["loss_fn"],
            "step_s": row["step_s"],
            "prompts_match": self.env.drawn
            == expected_questions(self.problems, step, self.recipe.prompts_per_step),
        }
        if self.recording.fb_results:
            metrics = self.recording.fb_results[-1].metrics
            active = float(metrics.get("active_tokens:sum", 0.0))
            if active > 0 and "log_ratio:sum" in metrics:
                out["log_ratio_mean"] = float(metrics["log_ratio:sum"]) / active
                out["log_ratio_min"] = float(metrics["log_ratio:min"])
                out["log_ratio_max"] = float(metrics["log_ratio:max"])
        return out

    def close(self) -> None:
        self.service.close("success").result(timeout=30)


class TrlRun:
    """bench/trl_grpo.py on the recipe's problems in order: PEFT LoRA as `lora` (our adapter's
    PEFT config), or full fine-tuning when `lora` is None."""

    def __init__(
        self,
        python: Path,
        *,
        recipe: Recipe,
        steps: int,
        model_dir: Path,
        dtype: str,
        tokenizer: Any,
        lora: dict[str, Any] | None,
        torch_threads: int | None,
        workdir: Path,
        label: str,
    ):
        self.label, self.recipe = label, recipe
        self.problems = recipe.problems(steps)
        tenant = recipe.tenant("trl", 1)
        spec = trl_spec(
            model_dir=model_dir,
            dtype=dtype,
            task=recipe.task,
            problems=self.problems,
            tokenizer=tokenizer,
            system_prompt=tenant.system_prompt,
            prompts_per_step=recipe.prompts_per_step,
            group_size=recipe.group_size,
            max_tokens=recipe.max_tokens,
            temperature=recipe.temperature,
            learning_rate=recipe.learning_rate,
            lora=lora,
            seed=recipe.seed,
            torch_threads=torch_threads,
            loss_type=TRL_LOSS,
            shuffle=False,
        )
        self.side = TrlSide(python, spec, workdir, name=slug(label))
        self.side.check(lora_modules=None if lora is None else lora["target_modules"], dtype=dtype)

    def step(self, step: int) -> dict[str, Any]:
        (raw,) = self.side.steps(1)
        expected = expected_questions(self.problems, step, self.recipe.prompts_per_step)
        return {"step": step, **{k: raw.get(k) for k in TRL_STEP_KEYS}} | {
            "prompts_match": raw.get("questions") == expected,
            "phases": raw.get("phases", {}),  # TRL's own profile of the step (nested)
            "max_rss_mib": self.side.max_rss_mib,  # the TRL process's peak so far
        }

    def close(self) -> None:
        self.side.close()


TRL_STEP_KEYS = (
    "reward_mean",
    "adv_abs_mean",
    "nonzero_adv_frac",
    "sampled_len_mean",
    "clip_frac",
    "entropy",
    "step_s",
)
StepLog = Callable[[Run, dict[str, Any]], None]


def run_pair(
    first: Callable[[], Run],
    second: Callable[[], Run] | None,
    steps: int,
    log: StepLog,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Builds the runs, then steps them in alternation (first's step k, second's step k), and
    closes both whatever happens. Returns each run's rows."""
    runs: list[Run] = []
    try:
        runs.append(first())
        if second is not None:
            runs.append(second())
        rows: list[list[dict[str, Any]]] = [[] for _ in runs]
        for step in range(steps):
            for run, out in zip(runs, rows, strict=True):
                row = run.step(step)
                out.append(row)
                log(run, row)
    finally:
        for run in runs:
            run.close()
    return rows[0], rows[1] if len(rows) > 1 else None


def format_row(run: Run, row: dict[str, Any]) -> str:
    """One progress line per run and step."""

    def f(key: str, fmt: str) -> str:
        value = row.get(key)
        return "-" if value is None else format(value, fmt)

    extra = (
        f"log-ratio {f('log_ratio_mean', '+.4f')}"
        if "optimizer_stepped" in row
        else f"clip {f('clip_frac', '.3f')}"
    )
    extra += " prompts " + ("ok" if row.get("prompts_match") else "DIFFER")
    return (
        f"{run.label:<24} step {row['step']:>3}: reward {f('reward_mean', '.3f')} "
        f"|adv| {f('adv_abs_mean', '.3f')} nonzero {f('nonzero_adv_frac', '.2f')} "
        f"len {f('sampled_len_mean', '.1f')} {extra} ({f('step_s', '.1f')} s)"
    )
