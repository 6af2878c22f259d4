"""TRL's `GRPOTrainer` as a peer process: its venv, its spec, and the driver of bench/trl_grpo.py.

Shared by bench/rl.py (step time) and bench/parity.py / bench/lora_vs_full.py (rewards). The
TRL side runs in its own venv (scripts/setup_trl.sh) so TRL's dependencies never enter .venv,
and as a long-lived subprocess so model loading stays out of its step times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lorafleet.rl.envs import Problem
from lorafleet.rl.loop import render_prompt

REPO = Path(__file__).resolve().parents[1]
TRL_VERSION = "1.16.0"
DEFAULT_TRL_VENV = Path(
    os.environ.get(
        "LORAFLEET_TRL_VENV", Path.home() / ".cache" / "lorafleet-peers" / f"trl-{TRL_VERSION}"
    )
)


def setup_trl(venv: Path) -> None:
    subprocess.run(
        ["bash", str(REPO / "scripts" / "setup_trl.sh")],
        check=True,
        env={**os.environ, "LORAFLEET_TRL_VENV": str(venv)},
    )


def trl_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _die_with_parent() -> None:
    """The TRL process holds GiBs mid-step: if this process dies (e.g. OOM-killed), so does it."""
    if sys.platform == "linux":
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class TrlSide:
    """bench/trl_grpo.py in the TRL venv, driven over stdin/stdout (protocol in its docstring)."""

    def __init__(self, python: Path, spec: dict[str, Any], workdir: Path, name: str = "trl"):
        spec_path = workdir / f"{name}-spec.json"
        spec_path.write_text(json.dumps(spec))
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [str(python), str(REPO / "bench" / "trl_grpo.py"), "--spec", str(spec_path)],
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            preexec_fn=_die_with_parent,
        )
        self.info = self._read()
        self.max_rss_mib = 0.0

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(
                f"the TRL process exited ({self.process.wait()}); its log ends with:\n{tail}"
            )
        return json.loads(line)

    def steps(self, n: int) -> list[dict[str, Any]]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{n}\n")
        self.process.stdin.flush()
        out = self._read()
        self.max_rss_mib = out["max_rss_mib"]
        return out["steps"]

    def check(self, *, lora_modules: Sequence[str] | None, dtype: str) -> None:
        """Raises unless TRL trains what our side trains: the same LoRA layers (None: full
        fine-tuning, no LoRA), the same prompt token ids, the base in `dtype` (LoRA only: full
        fine-tuning keeps fp32 master weights)."""
        if lora_modules is not None:
            ours = sorted(lora_modules)
            if self.info["lora_modules"] != ours:
                raise RuntimeError(
                    "TRL's LoRA layers differ from ours: "
                    f"{sorted(set(self.info['lora_modules']) ^ set(ours))}"
                )
            trl_base = self.info["param_dtypes"]["base"]
            if trl_base != [f"torch.{dtype}"]:
                raise RuntimeError(f"TRL's base weights are {trl_base}, ours torch.{dtype}")
        elif self.info["lora_modules"]:
            raise RuntimeError("TRL was asked for full fine-tuning but holds LoRA layers")
        if not self.info["prompt_ids_match"]:
            raise RuntimeError("TRL renders the prompts to other token ids than our side")

    def close(self) -> None:
        if self.process.poll() is None and self.process.stdin is not None:
            try:
                self.process.stdin.write("quit\n")
                self.process.stdin.flush()
                self.process.wait(30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self._log.close()


def trl_spec(
    *,
    model_dir: Path,
    dtype: str,
    task: str,
    problems: Sequence[Problem],
    tokenizer: Any,
    system_prompt: str | None,
    prompts_per_step: int,
    group_size: int,
    max_tokens: int,
    temperature: float,
    learning_rate: float,
    lora: dict[str, Any] | None,
    seed: int,
    torch_threads: int | None,
    loss_type: str = "dapo",
    shuffle: bool = True,
) -> dict[str, Any]:
    """Everything the TRL side must match: our model dir, our prompts rendered by our
    tokenizer's chat template (TRL re-renders them; the TRL side checks it gets the same ids),
    our LoRA as its PEFT config says (`lora` None: full fine-tuning). With `shuffle` False TRL
    takes `problems` in order, `prompts_per_step` a step."""
    return {
        "model_dir": str(model_dir),
        "dtype": dtype,
        "task": task,
        "envs_path": str(REPO / "lorafleet" / "rl" / "envs.py"),
        "rows": [
            {
                "question": p.question,
                "answer": p.answer,
                "prompt_ids": render_prompt(tokenizer, p.question, system_prompt),
            }
            for p in problems
        ],
        "system_prompt": system_prompt,
        "prompts_per_step": prompts_per_step,
        "group_size": group_size,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "learning_rate": learning_rate,
        "rank": None if lora is None else int(lora["r"]),
        "alpha": None if lora is None else lora["lora_alpha"],
        "target_modules": None if lora is None else list(lora["target_modules"]),
        "seed": seed,
        "torch_threads": torch_threads,
        "loss_type": loss_type,
        "shuffle": shuffle,
    }
