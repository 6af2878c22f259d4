"""`lorafleet rl`: a GRPO-style loop per tenant over the Tinker API, all tenants at once.

Each tenant runs on its own thread with its own API key, adapter, task and hyper-parameters;
the SDK calls of all threads are in flight together, so the server batches their sampling and
training into shared passes over the one base model. Per step and tenant: snapshot the weights
for sampling, sample a group per prompt, score, centre rewards per group, one forward_backward
(importance_sampling, ppo or stable_reinforce) and one optim_step.

Off-policy (`max_steps_off_policy` K > 0): each tenant's sampling runs on a thread of its own,
up to K versions ahead of training: the rollouts of step s come from the newest weights
available when they were sampled, at least s - K (so a step's staleness, the versions between
the weights that sampled it and the weights it trains, is at most K). Sampling of step s + 1
overlaps training of step s. Such runs train with `stable_reinforce` by default (samples
recorded by the server with `record_stability_info`, datums with provenance): its weights stay
bounded however stale the samples (docs/losses.md).
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import tinker
from tinker import types

from lorafleet.fsio import atomic_write_json, ensure_private_dir, safe_name
from lorafleet.model.numerics import DEFAULT_NUMERICS
from lorafleet.rl.connect import (
    Backend,
    embedded_device,
    embedded_dtype,
    export_adapter,
    load_tokenizer,
    start_backend,
    tenant_keys,
)
from lorafleet.rl.console_metrics import RewardPoster
from lorafleet.rl.datums import group_advantages, rl_datum
from lorafleet.rl.envs import DEFAULT_SYSTEM_PROMPT, Env, extract_answer, make_env
from lorafleet.rl.evaluation import HeldOut, PendingEval
from lorafleet.rl.report import MetricsLog, Progress, plot_panels, print_table

if TYPE_CHECKING:
    from lorafleet.engines import RolloutConfig

log = logging.getLogger(__name__)
RlLoss = Literal["importance_sampling", "ppo", "stable_reinforce"]
LOSSES: tuple[RlLoss, ...] = ("importance_sampling", "ppo", "stable_reinforce")
StepHook = Callable[[str, dict[str, Any]], None]
MAX_EVAL_PROMPTS = 1024  # bounds each evaluation's cost (one greedy sample per prompt)


@dataclass
class TenantConfig:
    name: str
    task: str = "arithmetic"
    learning_rate: float = 3e-4
    rank: int = 8
    # None: stable_reinforce when the run samples off-policy, else importance_sampling
    loss_fn: RlLoss | None = None
    prompts_per_step: int = 8
    group_size: int = 4
    max_tokens: int = 24
    temperature: float = 1.0
    seed: int = 0
    # Every prompt's system turn; None keeps the chat template's default. A short one keeps
    # the tokens each step prefills and trains on mostly the task's own.
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT

    def validate(self) -> None:
        safe_name(self.name, "tenant name")
        if self.loss_fn is not None and self.loss_fn not in LOSSES:
            raise ValueError(
                f"tenant {self.name}: loss {self.loss_fn!r} is not one of {', '.join(LOSSES)}"
            )
        for key in ("rank", "prompts_per_step", "group_size", "max_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(
                    f"tenant {self.name}: {key} must be >= 1, got {getattr(self, key)}"
                )
        if self.group_size < 2:
            raise ValueError(
                f"tenant {self.name}: group_size must be >= 2 (advantages are centred per group)"
            )
        if not self.learning_rate > 0:
            raise ValueError(
                f"tenant {self.name}: learning_rate must be > 0, got {self.learning_rate}"
            )
        if not 0 <= self.temperature < float("inf"):
            # checked here, not at the first sample: the servers and models would be up by then
            raise ValueError(
                f"tenant {self.name}: temperature must be a finite number >= 0 (0: greedy), "
                f"got {self.temperature}"
            )


@dataclass
class RLConfig:
    base_model: str
    run_dir: Path
    tenants: list[TenantConfig]
    steps: int = 10
    save_every: int = 5
    base_url: str | None = None
    api_keys: list[str] | None = None
    resume: bool = False
    progress: bool = True
    # The embedded server's base dtype; `auto` is bf16 only where the hardware multiplies it
    # natively (the LoRA math and optimizer stay fp32 either way; lorafleet/hardware.py).
    dtype: str = "auto"
    torch_threads: int | None = None
    # what samples inside the embedded server (None: its own sampler); vLLM needs fp32 or
    # bf16 and the canary is exact only in fp32 (docs/rollout_engines.md)
    rollout: RolloutConfig | None = None
    # where the embedded server runs: auto (the first CUDA device, else the CPU), cpu, cuda,
    # cuda:N (lorafleet.hardware.resolve_device)
    device: str = "auto"
    # Held-out evaluation (rl/evaluation.py): greedy accuracy on `eval_prompts` problems that
    # training never sees, before the first update, every `eval_every` steps and after the
    # last; 0 turns it off.
    eval_every: int = 5
    eval_prompts: int = 32
    # how many versions sampling may run ahead of training (0: synchronous, on-policy)
    max_steps_off_policy: int = 0
    # the embedded server's numerics: batch-invariant or fast (model/numerics.py)
    numerics: str = DEFAULT_NUMERICS

    def validate(self) -> None:
        """Every run-level value, named by its flag, before anything is written or started."""
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.save_every < 1:
            raise ValueError(f"--save-every must be >= 1, got {self.save_every}")
        if self.eval_every < 0:
            raise ValueError(
                f"--eval-every must be >= 0 (0: no held-out evaluation), got {self.eval_every}"
            )
        if not 1 <= self.eval_prompts <= MAX_EVAL_PROMPTS:
            raise ValueError(
                f"--eval-prompts must be 1..{MAX_EVAL_PROMPTS}, got {self.eval_prompts}"
            )
        if self.max_steps_off_policy < 0:
            raise ValueError(
                f"--max-steps-off-policy must be >= 0, got {self.max_steps_off_policy}"
            )


@dataclass
class TenantResult:
    name: str
    metrics: list[dict[str, Any]]
    state_path: str | None = None
    sampler_path: str | None = None
    adapter_dir: str | None = None
    error: str | None = None


@dataclass
class Checkpoint:
    """`state.json` in the tenant's dir: what `--resume` continues from."""

    step: int  # steps completed
    state_path: str
    sampler_path: str

    @classmethod
    def read(cls, path: Path) -> Checkpoint | None:
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        try:
            return cls(
                step=int(data["step"]),
                state_path=str(data["state_path"]),
                sampler_path=str(data["sampler_path"]),
            )
        except KeyError as exc:
            raise ValueError(f"{path}: missing field {exc}") from None


def render_prompt(tokenizer: Any, question: str, system_prompt: str | None = None) -> list[int]:
    """The question in the model's chat template. `system_prompt` None keeps the template's own
    default system turn (SmolLM2's is several times longer than its arithmetic questions)."""
    messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    messages.append({"role": "user", "content": question})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def step_seed(seed: int, step: int, index: int = 0) -> int:
    """Problems and samples depend only on (tenant seed, step): a resumed run replays exactly."""
    return (seed * 1_000_003 + step) * 1_009 + index


class TenantRunner:
    def __init__(
        self,
        cfg: TenantConfig,
        run: RLConfig,
        backend: Backend,
        api_key: str,
        progress: Progress,
        stop: threading.Event,
        on_step: StepHook | None = None,
        env: Env | None = None,
        held_out: HeldOut | None = None,
    ):
        self.cfg, self.run_cfg, self.backend, self.api_key = cfg, run, backend, api_key
        self.progress, self.stop, self.on_step = progress, stop, on_step
        self.dir = ensure_private_dir(run.run_dir / cfg.name)
        self.env: Env = env if env is not None else make_env(cfg.task)
        self.held_out = held_out
        self.metrics = MetricsLog(self.dir / "metrics.jsonl", resume=run.resume)
        self.result = TenantResult(cfg.name, self.metrics.rows)
        self.service: tinker.ServiceClient | None = None
        self.done = threading.Event()
        # each step's rewards, drawn by the web console (docs/console.md)
        self.rewards = RewardPoster(backend.base_url, api_key, cfg.name)

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> None:
        """Thread body: errors are recorded, not raised, so one tenant cannot strand the others."""
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001 - reported per tenant in the summary
            self.result.error = f"{type(exc).__name__}: {exc}"
        finally:
            if self.service is not None:
                try:
                    self.service.close("errored" if self.result.error else "success").result(
                        timeout=30
                    )
                except (tinker.TinkerError, TimeoutError, OSError) as exc:
                    self.result.error = self.result.error or f"close: {exc}"
            self.done.set()

    def _run(self) -> None:
        cfg = self.cfg
        self.service = self.backend.client(self.api_key)
        checkpoint = Checkpoint.read(self.dir / "state.json") if self.run_cfg.resume else None
        if checkpoint is not None:
            tc = self.service.create_training_client_from_state_with_optimizer(
                checkpoint.state_path
            ).result()
            start = checkpoint.step
            self.result.state_path, self.result.sampler_path = (
                checkpoint.state_path,
                checkpoint.sampler_path,
            )
            del self.metrics.rows[:]  # keep only steps the checkpoint includes
            self.metrics.rows.extend(
                r for r in read_rows(self.dir / "metrics.jsonl") if r["step"] < start
            )
        else:
            tc = self.service.create_lora_training_client(
                self.backend.base_model, rank=cfg.rank, seed=cfg.seed
            ).result()
            start = 0
        tokenizer = load_tokenizer(self.backend, tc)
        self.progress.add(cfg.name, self.run_cfg.steps, start)
        saved = start
        step = start
        rows = (
            self.off_policy_steps(tc, tokenizer, start)
            if self.run_cfg.max_steps_off_policy > 0
            else (
                self.train_step(tc, tokenizer, s)
                for s in range(start, self.run_cfg.steps)
                if not self.stop.is_set()
            )
        )
        try:
            for row in rows:
                self._record(tc, row)
                step += 1
                self.progress.update(cfg.name, step, _stats(self.metrics.rows))
                if step % self.run_cfg.save_every == 0:
                    self._save(tc, step)
                    saved = step
            if self._eval_due(step, final=True) and not self.stop.is_set():
                row = self._final_eval(tc, tokenizer, step)
                self._record(tc, row)
                self.progress.update(cfg.name, step, _stats(self.metrics.rows))
        except Exception:
            if step > saved:  # keep what was learnt; the step's own error is the one to report
                try:
                    self._save(tc, step)
                except tinker.TinkerError as exc:
                    log.warning("tenant %s: saving after the error failed too: %s", cfg.name, exc)
            raise
        if step > saved or self.result.sampler_path is None:
            self._save(tc, step)  # Ctrl-C or the last step
        if self.result.sampler_path is not None:
            exported = export_adapter(
                self.backend, self.api_key, self.result.sampler_path, self.dir / "adapter"
            )
            self.result.adapter_dir = None if exported is None else str(exported)

    def _record(self, tc: tinker.TrainingClient, row: dict[str, Any]) -> None:
        self.metrics.append(row)
        self.rewards.post(tc.model_id, row)
        if self.on_step is not None:
            self.on_step(self.cfg.name, row)

    def _eval_due(self, step: int, *, final: bool = False) -> bool:
        """At step 0, every `eval_every` steps, and after the last update (`final`), unless the
        last training row already evaluated those weights."""
        every = self.run_cfg.eval_every
        if self.held_out is None or every == 0:
            return False
        if final:
            return not any("eval_accuracy" in r and r["step"] == step for r in self.metrics.rows)
        return step % every == 0

    def _final_eval(self, tc: tinker.TrainingClient, tokenizer: Any, step: int) -> dict[str, Any]:
        """The weights after the last update have no training row: their evaluation is a row of
        its own, `step` = updates applied, with eval keys only."""
        sampler = tc.save_weights_and_get_sampling_client().result()
        pending = self._submit_eval(sampler, tokenizer)
        return {"step": step, **pending.result(tokenizer), "time": time.time()}

    def _submit_eval(self, sampler: Any, tokenizer: Any) -> PendingEval:
        assert self.held_out is not None
        prompts = [
            render_prompt(tokenizer, p.question, self.cfg.system_prompt)
            for p in self.held_out.problems
        ]
        return self.held_out.submit(sampler, prompts, self.cfg.max_tokens)

    def _save(self, tc: tinker.TrainingClient, step: int) -> None:
        name = f"step-{step:05d}"
        state = tc.save_state(name).result().path
        sampler = tc.save_weights_for_sampler(name).result().path
        self.result.state_path, self.result.sampler_path = state, sampler
        atomic_write_json(self.dir / "state.json", asdict(Checkpoint(step, state, sampler)))

    # ------------------------------------------------------------------ one GRPO step
    @property
    def loss_fn(self) -> RlLoss:
        return self.cfg.loss_fn or default_loss(self.run_cfg.max_steps_off_policy)

    def new_sampler(self, tc: tinker.TrainingClient) -> tinker.SamplingClient:
        """The run's current weights for sampling; recorded by the server when the loss needs
        it (stable_reinforce)."""
        record = self.loss_fn == "stable_reinforce"
        return tc.save_weights_and_get_sampling_client(record_stability_info=record).result()

    def train_step(self, tc: tinker.TrainingClient, tokenizer: Any, step: int) -> dict[str, Any]:
        """One synchronous step: fresh weights sample, then train on what they sampled."""
        t0 = time.perf_counter()
        rollouts = self.rollout(self.new_sampler(tc), tokenizer, step, version=step)
        return self.train(tc, rollouts, step, t0)

    def off_policy_steps(
        self, tc: tinker.TrainingClient, tokenizer: Any, start: int
    ) -> Iterator[dict[str, Any]]:
        """The steps from `start` with sampling on a thread of its own, up to K versions ahead:
        the rollouts of step s wait until at least s - K steps are trained, and take the newest
        weights then. Training takes each step's rollouts in order, trains, and publishes its
        new weights to the sampler."""
        k = self.run_cfg.max_steps_off_policy
        ready: queue.Queue[Rollouts | BaseException] = queue.Queue()
        cond = threading.Condition()
        latest: list[Any] = [self.new_sampler(tc), start]  # sampler, version (steps trained)
        quit_ = threading.Event()

        def sample_ahead() -> None:
            try:
                for step in range(start, self.run_cfg.steps):
                    with cond:
                        while latest[1] < step - k and not quit_.is_set():
                            cond.wait(0.5)
                        if quit_.is_set() or self.stop.is_set():
                            return
                        sampler, version = latest
                    ready.put(self.rollout(sampler, tokenizer, step, version))
            except BaseException as exc:  # noqa: BLE001 - handed to the training side to raise
                ready.put(exc)

        thread = threading.Thread(target=sample_ahead, name=f"rl-sample-{self.cfg.name}")
        thread.start()
        try:
            for step in range(start, self.run_cfg.steps):
                if self.stop.is_set():
                    return
                item = ready.get()
                if isinstance(item, BaseException):
                    raise item
                row = self.train(tc, item, step, time.perf_counter() - item.sample_s)
                sampler = self.new_sampler(tc) if step + 1 < self.run_cfg.steps else None
                with cond:
                    if sampler is not None:
                        latest[:] = [sampler, step + 1]
                    cond.notify_all()
                yield row
        finally:
            quit_.set()
            with cond:
                cond.notify_all()
            thread.join()

    def rollout(
        self, sampler: tinker.SamplingClient, tokenizer: Any, step: int, version: int
    ) -> Rollouts:
        """Step `step`'s problems sampled by `sampler` (the weights after `version` steps),
        scored, with their advantages, as datums."""
        cfg = self.cfg
        t0 = time.perf_counter()
        rng = random.Random(step_seed(cfg.seed, step))
        if self.held_out is None:
            problems = self.env.problems(rng, cfg.prompts_per_step)
        else:
            problems = self.held_out.training_problems(rng, cfg.prompts_per_step)
        # the same weights' held-out evaluation, in flight with the step's own samples
        pending = (
            self._submit_eval(sampler, tokenizer)
            if self.held_out is not None and self._eval_due(step)
            else None
        )
        prompts = [render_prompt(tokenizer, p.question, cfg.system_prompt) for p in problems]
        futures = [
            sampler.sample(
                types.ModelInput.from_ints(prompt),
                cfg.group_size,
                types.SamplingParams(
                    max_tokens=cfg.max_tokens,
                    temperature=cfg.temperature,
                    seed=step_seed(cfg.seed, step, i),
                ),
            )
            for i, prompt in enumerate(prompts)
        ]
        responses = [f.result() for f in futures]
        evaluated = {} if pending is None else pending.result(tokenizer)
        out = Rollouts(version=version, sample_s=time.perf_counter() - t0, evaluated=evaluated)
        provenance = self.loss_fn == "stable_reinforce"
        for problem, prompt, response in zip(problems, prompts, responses, strict=True):
            texts = [
                tokenizer.decode(s.tokens, skip_special_tokens=True) for s in response.sequences
            ]
            rewards = [self.env.score(problem, text) for text in texts]
            out.tagged += sum(extract_answer(text) is not None for text in texts)
            out.rewards.extend(rewards)
            for seq, adv in zip(response.sequences, group_advantages(rewards), strict=True):
                out.sampled_tokens += len(seq.tokens)
                if adv != 0.0 and seq.tokens:  # zero-advantage rows carry no gradient
                    if seq.logprobs is None:
                        raise RuntimeError("the sampler returned a sequence without logprobs")
                    datum = rl_datum(prompt, seq.tokens, seq.logprobs, adv)
                    if provenance:
                        datum = with_provenance(datum, len(prompt), seq)
                    out.datums.append(datum)
        return out

    def train(
        self, tc: tinker.TrainingClient, rollouts: Rollouts, step: int, t0: float
    ) -> dict[str, Any]:
        """One forward_backward and optim_step on `rollouts`; the step's metrics row. `t0`:
        when the step began (sync) or when its rollouts were taken up for training (async)."""
        cfg = self.cfg
        t_train = time.perf_counter()
        loss = None
        if rollouts.datums:
            fb = tc.forward_backward(rollouts.datums, self.loss_fn)
            opt = tc.optim_step(types.AdamParams(learning_rate=cfg.learning_rate))
            fb_metrics = fb.result().metrics
            loss = float(fb_metrics.get("loss:sum", 0.0)) / max(rollouts.sampled_tokens, 1)
            rollouts.masked_tokens = fb_metrics.get("masked_tokens:sum")
            opt.result()
        t_end = time.perf_counter()
        n = len(rollouts.rewards)
        mean = sum(rollouts.rewards) / n
        return {
            "step": step,
            "reward_mean": mean,
            "reward_std": (sum((r - mean) ** 2 for r in rollouts.rewards) / n) ** 0.5,
            "tag_rate": rollouts.tagged / n,
            "loss_per_token": loss,
            "loss_fn": self.loss_fn,
            "staleness": step - rollouts.version,
            "masked_tokens": rollouts.masked_tokens,
            "rollouts": n,
            "trained_rows": len(rollouts.datums),
            "sampled_tokens": rollouts.sampled_tokens,
            "sample_s": rollouts.sample_s,
            "train_s": t_end - t_train,
            "step_s": t_end - t0,
            # eval keys: the weights after `eval_version` updates (== step unless off-policy)
            **(
                rollouts.evaluated | {"eval_version": rollouts.version}
                if rollouts.evaluated
                else {}
            ),
            "time": time.time(),
        }


@dataclass
class Rollouts:
    """One step's sampled, scored groups as datums; `version` is how many optimizer steps the
    weights that sampled them had taken."""

    version: int
    sample_s: float
    datums: list[types.Datum] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    tagged: int = 0
    sampled_tokens: int = 0
    masked_tokens: float | None = None
    # the held-out evaluation of the same weights, when one was due (rl/evaluation.py)
    evaluated: dict[str, float | int] = field(default_factory=dict)


def default_loss(max_steps_off_policy: int) -> RlLoss:
    """stable_reinforce off-policy (bounded weights on stale samples), importance_sampling on."""
    return "stable_reinforce" if max_steps_off_policy > 0 else "importance_sampling"


def with_provenance(datum: types.Datum, prompt_len: int, seq: types.SampledSequence) -> types.Datum:
    """rl_datum's layout named for stable_reinforce: the input is the prompt and all but the
    last sampled token; the targets are the prompt from its second token, then every sampled
    token (the cookbook's rl_loop spans)."""
    sid, n = seq.sequence_id, len(seq.tokens)
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=prompt_len),
            types.SampledProvenanceSpan(sequence_id=sid, length=n - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=prompt_len - 1),
            types.SampledProvenanceSpan(sequence_id=sid, length=n),
        ],
    )


def read_rows(path: Path) -> list[dict[str, Any]]:
    from lorafleet.rl.report import read_metrics

    return read_metrics(path) if path.is_file() else []


def _stats(rows: list[dict[str, Any]]) -> str:
    """The progress line: the last training step's figures and the latest evaluation."""
    parts = []
    trained = next((r for r in reversed(rows) if "reward_mean" in r), None)
    if trained is not None:
        loss = trained["loss_per_token"]
        parts.append(
            f"reward {trained['reward_mean']:.3f}  tag {trained['tag_rate']:.2f}  "
            f"loss {'-' if loss is None else f'{loss:+.4f}'}"
            + (f"  stale {trained['staleness']}" if trained.get("staleness") else "")
        )
    evaluated = next((r for r in reversed(rows) if "eval_accuracy" in r), None)
    if evaluated is not None:
        parts.append(f"eval {evaluated['eval_accuracy']:.3f} (step {evaluated['step']})")
    return "  ".join(parts)


def run_rl(config: RLConfig, *, on_step: StepHook | None = None) -> dict[str, TenantResult]:
    """Runs every tenant to `config.steps` (or until Ctrl-C, after which each saves and stops)."""
    names = [t.name for t in config.tenants]
    if len(set(names)) != len(names):
        raise ValueError(f"tenant names must be unique, got {names}")
    for tenant in config.tenants:
        tenant.validate()
    config.validate()
    # Tasks and held-out sets before anything is written or started: a bad task or one too
    # small to hold out --eval-prompts problems is refused up front.
    envs = {t.name: make_env(t.task) for t in config.tenants}
    held_out = {
        t.name: HeldOut.draw(envs[t.name], t.seed, config.eval_prompts)
        if config.eval_every
        else None
        for t in config.tenants
    }
    for t in config.tenants:  # step 0's draw: refuses a task the held-out set leaves empty
        held = held_out[t.name]
        if held is not None:
            held.training_problems(random.Random(step_seed(t.seed, 0)), t.prompts_per_step)
    # before anything is written: a missing CUDA device is refused here
    device = embedded_device(config.device, config.base_url)
    run_dir = ensure_private_dir(config.run_dir)
    if not config.resume:
        taken = [n for n in names if (run_dir / n / "state.json").exists()]
        if taken:
            raise ValueError(
                f"{run_dir} already holds a run for {', '.join(taken)}: pass --resume or use another --run-dir"
            )
    dtype = embedded_dtype(config.dtype, config.base_url, device.device)
    keys = tenant_keys(run_dir, names, config.api_keys)
    atomic_write_json(
        run_dir / "config.json",
        {
            **asdict(config),
            "run_dir": str(run_dir),
            "api_keys": None,
            "dtype": dtype.dtype,
            "dtype_choice": dtype.record(),
            "device": device.device,
            "device_choice": device.record(),
        },
    )
    rows_per_step = sum(t.prompts_per_step * t.group_size for t in config.tenants)
    backend = start_backend(
        base_model=config.base_model,
        run_dir=run_dir,
        keys=list(keys.values()),
        base_url=config.base_url,
        dtype=dtype.dtype,
        max_adapters=max(2, len(names)),
        max_rank=max(max(t.rank for t in config.tenants), 8),
        torch_threads=config.torch_threads,
        max_sample_rows=min(max(rows_per_step, 16), 256),
        rollout=config.rollout,
        device=device.device,
        numerics=config.numerics,
    )
    if backend.server is not None:  # never the key itself: it is in the run dir, 0600
        print(
            f"console: {backend.base_url}/console (sign in with a tenant's key from "
            f"{run_dir / 'api_keys.json'})",
            flush=True,
        )
    stop = threading.Event()
    interrupted = False
    try:
        with Progress(config.progress) as progress:
            runners = [
                TenantRunner(
                    t,
                    config,
                    backend,
                    keys[t.name],
                    progress,
                    stop,
                    on_step,
                    env=envs[t.name],
                    held_out=held_out[t.name],
                )
                for t in config.tenants
            ]
            threads = [
                threading.Thread(target=r.run, name=f"rl-{r.cfg.name}", daemon=True)
                for r in runners
            ]
            for thread in threads:
                thread.start()
            # Poll with sleep, not join(timeout): a KeyboardInterrupt inside Thread.join can
            # leave the thread marked as finished while it still runs (CPython gh-90882).
            while not all(r.done.is_set() for r in runners):
                try:
                    time.sleep(0.1)
                except KeyboardInterrupt:
                    if interrupted:
                        raise  # a second Ctrl-C: stop waiting for the saves
                    interrupted = True
                    stop.set()
                    print(
                        "\ninterrupted: each tenant finishes its step, saves and stops (Ctrl-C again to abort)"
                    )
            for thread in threads:
                thread.join()
    finally:
        backend.close()
    results = {r.cfg.name: r.result for r in runners}
    finish(config, results, interrupted)
    return results


def finish(config: RLConfig, results: dict[str, TenantResult], interrupted: bool) -> None:
    run_dir = config.run_dir
    curves = {name: r.metrics for name, r in results.items()}
    panels = [("reward_mean", "mean reward (training samples)")]
    if any("eval_accuracy" in row for rows in curves.values() for row in rows):
        panels.append(("eval_accuracy", "held-out greedy accuracy"))
    png = plot_panels(run_dir / "reward.png", curves, panels)
    summary = {
        name: {k: v for k, v in asdict(r).items() if k != "metrics"} | _summary(r.metrics)
        for name, r in results.items()
    }
    atomic_write_json(run_dir / "summary.json", {"interrupted": interrupted, "tenants": summary})
    rows = []
    for cfg in config.tenants:
        s = summary[cfg.name]
        rows.append(
            [
                cfg.name,
                cfg.task,
                s["steps"],
                _fmt(s["reward_first"]),
                _fmt(s["reward_last"]),
                _fmt(s["eval_first"]),
                _fmt(s["eval_last"]),
                f"{s['seconds']:.0f}s",
                "-"
                if s["staleness_max"] is None
                else f"{s['staleness_mean']:.1f} / {s['staleness_max']}",
                s["error"] or s["adapter_dir"] or s["sampler_path"] or "-",
            ]
        )
    k = config.max_steps_off_policy
    print_table(
        "lorafleet rl"
        + (f" (up to {k} steps off-policy)" if k else "")
        + (" (interrupted)" if interrupted else ""),
        [
            "tenant",
            "task",
            "steps",
            "reward first",
            "reward last",
            "eval first",
            "eval last",
            "time",
            "stale avg/max",
            "adapter (PEFT)",
        ],
        rows,
    )
    print(
        f"reward curve: {png}\nmetrics: {run_dir}/<tenant>/metrics.jsonl; resume with --resume --run-dir {run_dir}"
    )


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """First/last reward averaged over up to 3 steps: single steps are noisy at 32 rollouts.
    Eval first/last are single evaluations (the same held-out prompts each time, greedy)."""
    trained = [r for r in rows if "reward_mean" in r]
    rewards = [r["reward_mean"] for r in trained]
    evals = [r for r in rows if "eval_accuracy" in r]
    k = min(3, len(rewards))
    stale = [r.get("staleness", 0) for r in trained]
    return {
        "steps": len(trained),
        "reward_first": sum(rewards[:k]) / k if k else None,
        "reward_last": sum(rewards[-k:]) / k if k else None,
        "eval_first": evals[0]["eval_accuracy"] if evals else None,
        "eval_last": evals[-1]["eval_accuracy"] if evals else None,
        "eval_first_step": evals[0]["step"] if evals else None,
        "eval_last_step": evals[-1]["step"] if evals else None,
        "seconds": sum(r["step_s"] for r in trained)
        + sum(r["eval_s"] for r in rows if "reward_mean" not in r and "eval_s" in r),
        "rollouts": sum(r["rollouts"] for r in trained),
        "staleness_mean": sum(stale) / len(stale) if stale else None,
        "staleness_max": max(stale) if stale else None,
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
