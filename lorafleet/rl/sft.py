"""`lorafleet sft`: supervised fine-tuning of one adapter with `cross_entropy` over the Tinker API.

Rows are chat `messages` (loss on assistant turns only) or `prompt`/`completion` plain text
(loss on the completion only). A held-out split is scored with forward-only passes before,
during and after training, so the reported loss is one the adapter never trained on.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tinker import types

from lorafleet.fsio import atomic_write_json, ensure_private_dir
from lorafleet.model.numerics import DEFAULT_NUMERICS
from lorafleet.rl.connect import (
    embedded_device,
    embedded_dtype,
    export_adapter,
    load_tokenizer,
    start_backend,
    tenant_keys,
)
from lorafleet.rl.datums import sft_datum
from lorafleet.rl.report import MetricsLog, Progress, plot_curves, print_table


@dataclass
class SFTConfig:
    base_model: str
    data: Path
    run_dir: Path
    steps: int = 20
    batch_size: int = 8
    learning_rate: float = 5e-4
    rank: int = 8
    eval_fraction: float = 0.2
    eval_every: int = 5
    seed: int = 0
    base_url: str | None = None
    api_key: str | None = None
    progress: bool = True
    dtype: str = "auto"  # the embedded server's base dtype (see RLConfig.dtype)
    device: str = "auto"  # where the embedded server runs (see RLConfig.device)
    numerics: str = DEFAULT_NUMERICS  # the embedded server's numerics (see RLConfig.numerics)


def _ids(encoded: Any) -> list[int]:
    if not isinstance(encoded, list):
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


def encode_row(tokenizer: Any, row: Any, where: str) -> tuple[list[int], list[float]]:
    """Tokens and per-token weights (1 = trained on) for one JSONL row."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: 'messages' must be a non-empty list")
        for i, m in enumerate(messages):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise ValueError(f"{where}: messages[{i}] needs string 'role' and 'content'")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: no assistant message to train on")
        tokens = _ids(tokenizer.apply_chat_template(messages, tokenize=True))
        weights = [0.0] * len(tokens)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            # The assistant turn is what the full render adds beyond the generation prompt; this
            # relies on the template rendering prefixes stably (ChatML does), so check it.
            start = len(
                _ids(
                    tokenizer.apply_chat_template(
                        messages[:i], tokenize=True, add_generation_prompt=True
                    )
                )
            )
            prefix = _ids(tokenizer.apply_chat_template(messages[: i + 1], tokenize=True))
            end = len(prefix)
            if tokens[:end] != prefix:
                raise ValueError(
                    f"{where}: the chat template does not render message prefixes stably; use prompt/completion rows"
                )
            weights[start:end] = [1.0] * (end - start)
        return tokens, weights
    if "prompt" in row and "completion" in row:
        if not isinstance(row["prompt"], str) or not isinstance(row["completion"], str):
            raise ValueError(f"{where}: 'prompt' and 'completion' must be strings")
        prompt = _ids(tokenizer(row["prompt"], add_special_tokens=False))
        completion = _ids(
            tokenizer(row["completion"] + (tokenizer.eos_token or ""), add_special_tokens=False)
        )
        return prompt + completion, [0.0] * len(prompt) + [1.0] * len(completion)
    raise ValueError(
        f"{where}: a row needs 'messages' or both 'prompt' and 'completion' (got keys {sorted(row)})"
    )


def load_rows(path: Path) -> list[tuple[int, Any]]:
    """(line number, parsed row) for every non-blank line; bad JSON names its line."""
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
    if len(rows) < 2:
        raise ValueError(
            f"{path}: needs at least 2 rows (one to train on, one held out), has {len(rows)}"
        )
    return rows


def _mean_loss(tc: Any, datums: list[types.Datum]) -> float:
    out = tc.forward(datums, "cross_entropy").result()
    weight = sum(sum(d.loss_fn_inputs["weights"].data) for d in datums)
    return float(out.metrics["loss:sum"]) / max(weight, 1.0)


def run_sft(config: SFTConfig) -> dict[str, Any]:
    if config.steps < 1 or config.batch_size < 1:
        raise ValueError("--steps and --batch-size must be >= 1")
    if not 0.0 < config.eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction must be in (0, 1), got {config.eval_fraction}")
    rows = load_rows(config.data)
    device = embedded_device(config.device, config.base_url)  # refused before anything is written
    dtype = embedded_dtype(config.dtype, config.base_url, device.device)
    run_dir = ensure_private_dir(config.run_dir)
    key = tenant_keys(run_dir, ["sft"], [config.api_key] if config.api_key else None)["sft"]
    atomic_write_json(
        run_dir / "config.json",
        {
            **asdict(config),
            "data": str(config.data),
            "run_dir": str(run_dir),
            "api_key": None,
            "dtype": dtype.dtype,
            "dtype_choice": dtype.record(),
            "device": device.device,
            "device_choice": device.record(),
        },
    )
    backend = start_backend(
        base_model=config.base_model,
        run_dir=run_dir,
        keys=[key],
        base_url=config.base_url,
        dtype=dtype.dtype,
        max_adapters=2,
        max_rank=max(config.rank, 8),
        device=device.device,
        numerics=config.numerics,
    )
    service = backend.client(key)
    metrics = MetricsLog(run_dir / "metrics.jsonl", resume=False)
    try:
        tc = service.create_lora_training_client(
            backend.base_model, rank=config.rank, seed=config.seed
        ).result()
        tokenizer = load_tokenizer(backend, tc)
        datums = [
            sft_datum(*encode_row(tokenizer, row, f"{config.data}:{number}"))
            for number, row in rows
        ]
        order = list(range(len(datums)))
        random.Random(config.seed).shuffle(order)
        n_eval = max(1, round(len(order) * config.eval_fraction))
        held_out = [datums[i] for i in order[:n_eval]]
        train = [datums[i] for i in order[n_eval:]]
        start = time.perf_counter()
        first_eval = _mean_loss(tc, held_out)
        metrics.append({"step": 0, "eval_loss": first_eval, "train_loss": None})
        rng = random.Random(config.seed + 1)
        with Progress(config.progress) as progress:
            progress.add("sft", config.steps, 0)
            for step in range(1, config.steps + 1):
                batch = rng.sample(train, min(config.batch_size, len(train)))
                fb = tc.forward_backward(batch, "cross_entropy")
                opt = tc.optim_step(types.AdamParams(learning_rate=config.learning_rate))
                weight = sum(sum(d.loss_fn_inputs["weights"].data) for d in batch)
                train_loss = float(fb.result().metrics["loss:sum"]) / max(weight, 1.0)
                opt.result()
                row: dict[str, Any] = {"step": step, "train_loss": train_loss, "eval_loss": None}
                if step % config.eval_every == 0 or step == config.steps:
                    row["eval_loss"] = _mean_loss(tc, held_out)
                metrics.append(row)
                progress.update(
                    "sft",
                    step,
                    f"train {train_loss:.3f}"
                    + (f"  held-out {row['eval_loss']:.3f}" if row["eval_loss"] else ""),
                )
        sampler_path = tc.save_weights_for_sampler("final").result().path
        state_path = tc.save_state("final").result().path
        adapter = export_adapter(backend, key, sampler_path, run_dir / "adapter")
    finally:
        service.close("success").result(timeout=30)
        backend.close()
    last_eval = metrics.rows[-1]["eval_loss"]
    summary = {
        "train_rows": len(train),
        "held_out_rows": len(held_out),
        "eval_loss_before": first_eval,
        "eval_loss_after": last_eval,
        "seconds": time.perf_counter() - start,
        "sampler_path": sampler_path,
        "state_path": state_path,
        "adapter_dir": None if adapter is None else str(adapter),
        "config": asdict(config),
    }
    atomic_write_json(run_dir / "summary.json", json.loads(json.dumps(summary, default=str)))
    plot_curves(
        run_dir / "loss.png",
        {"held-out": [r for r in metrics.rows if r["eval_loss"] is not None]},
        "eval_loss",
        "held-out loss / token",
    )
    print_table(
        "lorafleet sft",
        ["rows (train/held-out)", "held-out loss before", "after", "adapter (PEFT)"],
        [
            [
                f"{len(train)}/{len(held_out)}",
                f"{first_eval:.4f}",
                f"{last_eval:.4f}",
                summary["adapter_dir"] or sampler_path,
            ]
        ],
    )
    return summary
