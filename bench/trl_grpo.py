"""The TRL side of bench/rl.py and bench/parity.py: TRL's `GRPOTrainer`, driven step by step,
with a PEFT LoRA (`rank` in the spec) or full fine-tuning (`rank` null).

Runs inside the TRL venv (scripts/setup_trl.sh), never in .venv: only the stdlib, torch,
transformers, peft, datasets and trl are imported here, plus lorafleet/rl/envs.py loaded by
file path (stdlib only), so the reward is our scorer, not a copy of it.

The driver (bench/trl_side.py) writes a JSON spec (model dir, prompts already rendered by our
side, LoRA targets, hyper-parameters, loss type) and starts this as a long-lived subprocess, so
model loading and trainer setup stay out of the timings. Protocol, one JSON object per line on
the original stdout (everything else the libraries print goes to stderr):
  -> {"ready": true, ...}            once the trainer is built and training has begun
  <- "N"                             run N more optimizer steps
  -> {"steps": [{...}, ...], "max_rss_mib"}   N steps (keys: STEP_KEYS below), peak memory
  <- "quit"                          stop (exit 0)
A step is timed by a TrainerCallback from on_step_begin to on_step_end: generation, reward,
the policy forward + backward and the optimizer step, exactly one GRPO step. Its learning
figures are TRL's own: the advantages `_generate_and_score_completions` hands to the loss, the
completion mask's lengths, and the clip fractions and entropy `_compute_loss` logs.

With `"shuffle": false` the prompts are taken in the spec's order, `prompts_per_step` a step,
so step k trains on rows[k * prompts_per_step : (k + 1) * prompts_per_step], as our side does;
each step reports the questions it drew so the driver can check that.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


class _Quit(Exception):
    """Raised from the callback to leave `trainer.train()` when the driver says quit."""


def _load_envs(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("lorafleet_rl_envs", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load the reward envs from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building classes
    spec.loader.exec_module(module)
    return module


def _messages(spec: dict[str, Any], question: str) -> list[dict[str, str]]:
    """The chat our side renders (rl/loop.py render_prompt): the same system turn, if any."""
    system = spec.get("system_prompt")
    head = [] if system is None else [{"role": "system", "content": system}]
    return [*head, {"role": "user", "content": question}]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _learning(scored: dict[str, Any], metrics: dict[str, list[float]]) -> dict[str, Any]:
    """One step's learning figures, named as our side's (bench/reward_runs.py). The policy
    ratio is exactly 1 on this side (num_iterations=1 and no vLLM: TRL takes the old log-probs
    as the current ones, detached), so its clip fractions must read 0."""
    advantages = scored.get("advantages", [])
    return {
        "adv_abs_mean": _mean([abs(a) for a in advantages]),
        "nonzero_adv_frac": _mean([float(a != 0.0) for a in advantages]),
        "sampled_len_mean": _mean(scored.get("lengths", [])),
        "reward_mean": _mean(metrics.get("reward", [])),
        "clip_frac": _mean(metrics.get("clip_ratio/region_mean", [])),
        "entropy": _mean(metrics.get("entropy", [])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description="TRL GRPOTrainer side of bench/rl.py (runs in the TRL venv)"
    )
    parser.add_argument("--spec", type=Path, required=True, help="JSON written by bench/rl.py")
    spec = json.loads(parser.parse_args().spec.read_text())

    # Protocol lines go to a private copy of stdout; fd 1 becomes stderr so that whatever
    # transformers/TRL print cannot corrupt the protocol.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def send(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    import torch

    if spec["torch_threads"]:
        torch.set_num_threads(int(spec["torch_threads"]))
    import peft
    import transformers
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    envs = _load_envs(Path(spec["envs_path"]))
    env = envs.make_env(spec["task"])
    counted: dict[str, Any] = {"tokens": 0, "rows": 0, "nonzero_adv_rows": 0, "questions": []}
    # TRL's advantages and completion lengths of the step (wrapped below)
    scored: dict[str, Any] = {}
    # TRL times its own phases (generate, rewards, per-token log-probs, loss) with
    # ProfilingContext, which only reports to wandb/mlflow/trackio: collect them per step.
    profiled: dict[str, float] = {}
    from trl.extras import profiling

    def _collect(self: Any, duration: float) -> None:
        profiled[self.name] = profiled.get(self.name, 0.0) + duration

    profiling.ProfilingContext._log_metrics = _collect

    def reward(prompts, completions, completion_ids, question, answer, **_: Any) -> list[float]:
        """Our env's scorer on the decoded completion; also counts the tokens generated (EOS
        included, as our sampler counts them)."""
        counted["tokens"] += sum(len(ids) for ids in completion_ids)
        counted["rows"] += len(completion_ids)
        counted["questions"].extend(question[:: spec["group_size"]])
        out = []
        for completion, q, a in zip(completions, question, answer, strict=True):
            text = completion[0]["content"] if isinstance(completion, list) else completion
            out.append(float(env.score(envs.Problem(q, a), text)))
        # TRL trains every row; ours skips rows whose advantage is 0 (all-equal groups). The
        # RepeatSampler puts a prompt's group_size samples next to each other.
        group = spec["group_size"]
        for i in range(0, len(out), group):
            rewards = out[i : i + group]
            counted["nonzero_adv_rows"] += sum(r != sum(rewards) / len(rewards) for r in rewards)
        return out

    class Driver(TrainerCallback):
        def __init__(self) -> None:
            self.remaining = 0
            self.started = 0.0
            self.chunk: list[dict[str, float]] = []

        def on_train_begin(self, args, state, control, **kwargs):  # HF signature
            send(
                {
                    "ready": True,
                    "torch_threads": torch.get_num_threads(),
                    "lora_modules": lora_modules,
                    "prompt_ids_match": prompt_ids_match,
                    "trainable_params": trainable,
                    "param_dtypes": dtypes,
                    "full_finetuning": full,
                    "autocast_bf16": autocast_bf16,
                    "loss_type": config.loss_type,
                    "shuffle": config.shuffle_dataset,
                    "versions": {
                        "trl": trl.__version__,
                        "peft": peft.__version__,
                        "transformers": transformers.__version__,
                        "torch": torch.__version__,
                    },
                }
            )

        def on_step_begin(self, args, state, control, **kwargs):
            if self.remaining == 0:
                line = sys.stdin.readline().strip()
                if not line or line == "quit":
                    raise _Quit
                self.remaining = int(line)
                self.chunk = []
            counted.update(tokens=0, rows=0, nonzero_adv_rows=0, questions=[])
            profiled.clear()
            scored.clear()
            trainer._metrics["train"].clear()  # what _compute_loss logs, this step only
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            elapsed = time.perf_counter() - self.started
            self.chunk.append(
                {
                    "step_s": elapsed,
                    "tokens": counted["tokens"],
                    "rows": counted["rows"],
                    "nonzero_adv_rows": counted["nonzero_adv_rows"],
                    "questions": counted["questions"],
                    "phases": dict(profiled),
                    **_learning(scored, trainer._metrics["train"]),
                }
            )
            self.remaining -= 1
            if self.remaining == 0:
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                send({"steps": self.chunk, "max_rss_mib": rss})

    # bench/rl.py resolves `auto` before writing the spec: this side must load exactly the
    # dtype our side runs, never decide on its own.
    if spec["dtype"] not in ("float32", "bfloat16"):
        raise ValueError(f"spec dtype must be float32 or bfloat16, got {spec['dtype']!r}")
    full = spec.get("rank") is None
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    # Full fine-tuning keeps fp32 master weights and, on a bf16 run, computes under bf16
    # autocast (mixed precision): Adam's updates at its learning rates (~1e-6 of a weight) are
    # below bf16's resolution and would round away in bf16 weights. A LoRA run loads the base
    # in the run's dtype, as our side does (PEFT keeps the LoRA weights fp32).
    load_dtype = torch.float32 if full else getattr(torch, spec["dtype"])
    autocast_bf16 = full and spec["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=load_dtype)
    rows = spec["rows"]
    dataset = Dataset.from_list(
        [
            {
                "prompt": _messages(spec, r["question"]),
                "question": r["question"],
                "answer": r["answer"],
            }
            for r in rows
        ]
    )
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir,
            use_cpu=True,
            # LoRA: no autocast, the base computes in the dtype it was loaded in, and PEFT keeps
            # the LoRA weights in fp32 (autocast_adapter_dtype), as our bf16 base does
            bf16=autocast_bf16,
            fp16=False,
            seed=spec["seed"],
            shuffle_dataset=spec.get("shuffle", True),
            # one step = prompts_per_step prompts x group_size samples, one optimizer step
            per_device_train_batch_size=spec["prompts_per_step"] * spec["group_size"],
            gradient_accumulation_steps=1,
            num_generations=spec["group_size"],
            max_completion_length=spec["max_tokens"],
            temperature=spec["temperature"],
            top_p=1.0,
            top_k=0,
            # the loss (spec, default TRL's own dapo: clipped token-level policy gradient), no
            # KL term (beta=0, so no reference model pass), rewards centred per group without
            # std scaling (as our group_advantages); bench/parity.py says why it picks dr_grpo
            beta=0.0,
            loss_type=spec.get("loss_type", "dapo"),
            scale_rewards="none",
            num_iterations=1,
            # optimizer: the Tinker AdamParams defaults our side sends, constant LR, no clipping
            learning_rate=spec["learning_rate"],
            lr_scheduler_type="constant",
            warmup_steps=0,
            adam_beta1=0.9,
            adam_beta2=0.95,
            adam_epsilon=1e-12,
            weight_decay=0.0,
            max_grad_norm=0.0,
            gradient_checkpointing=False,  # GRPOConfig's default is True; our trainer does not recompute
            max_steps=1_000_000,  # the driver decides when to stop
            logging_steps=1_000_000,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
            log_completions=False,
        )
        lora = (
            None
            if full
            else LoraConfig(
                r=spec["rank"],
                lora_alpha=spec["alpha"],
                lora_dropout=0.0,
                bias="none",
                target_modules=spec["target_modules"],
                task_type="CAUSAL_LM",
            )
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=lora,
            callbacks=[Driver()],
        )
        generate_and_score = trainer._generate_and_score_completions

        def recorded(*args: Any, **kwargs: Any) -> Any:
            """TRL's own batch as the loss will see it: advantages and completion lengths."""
            output = generate_and_score(*args, **kwargs)
            scored["advantages"] = output["advantages"].detach().float().flatten().tolist()
            scored["lengths"] = output["completion_mask"].sum(dim=1).float().tolist()
            return output

        trainer._generate_and_score_completions = recorded
        lora_modules = sorted(
            name.removeprefix("base_model.model.")
            for name, module in trainer.model.named_modules()
            if isinstance(module, peft.tuners.lora.LoraLayer)
        )
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        dtypes = {  # "lora": the trained weights (all of them in full fine-tuning)
            "lora": sorted({str(p.dtype) for p in trainer.model.parameters() if p.requires_grad}),
            "base": sorted(
                {str(p.dtype) for p in trainer.model.parameters() if not p.requires_grad}
            ),
        }
        # TRL renders conversational prompts itself; check it gets our token ids.
        sample = rows[: min(len(rows), 16)]
        ids, _, _ = trainer._tokenize_prompts([_messages(spec, r["question"]) for r in sample])
        prompt_ids_match = all(
            list(map(int, got)) == r["prompt_ids"] for got, r in zip(ids, sample, strict=True)
        )
        with contextlib.suppress(_Quit):  # the driver said quit
            trainer.train()


if __name__ == "__main__":
    main()
