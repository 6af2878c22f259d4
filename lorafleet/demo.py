"""`lorafleet demo`: four adapters with different ranks and tasks train in shared batches.

What a newcomer sees first: the base loads once, four adapters (one per "tenant") are attached,
every step is ONE mixed forward/backward plus ONE batched optimizer call, each adapter's loss
falls on its own task, and each is exported as a PEFT directory that `peft`/vLLM load as-is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.kernel_check import prove_fused_kernel
from lorafleet.model.loader import load_base
from lorafleet.model.numerics import DEFAULT_NUMERICS, NumericsName, apply_numerics
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.train.engine import TrainEngine, TrainItem
from lorafleet.train.optim import AdamHParams


@dataclass(frozen=True)
class DemoTenant:
    name: str
    rank: int
    learning_rate: float
    prompt: str
    answer: str


TENANTS = (
    DemoTenant("arithmetic", 4, 2e-3, "What is 17 + 25?", "17 + 25 = 42."),
    DemoTenant("capitals", 8, 1e-3, "What is the capital of Peru?", "The capital of Peru is Lima."),
    DemoTenant("pirate", 16, 1e-3, "Say hello.", "Ahoy, matey! Welcome aboard."),
    DemoTenant("json", 32, 5e-4, "Give the answer as JSON.", '{"answer": 7, "ok": true}'),
)


def _chat_item(tokenizer: Any, tenant: DemoTenant, slot: int) -> TrainItem:
    """One SFT datum: loss on the assistant answer only (weights 0 on the prompt)."""
    messages = [{"role": "user", "content": tenant.prompt}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt_ids, list):
        prompt_ids = list(prompt_ids["input_ids"])
    answer_ids = tokenizer(tenant.answer + tokenizer.eos_token, add_special_tokens=False)[
        "input_ids"
    ]
    seq = list(prompt_ids) + list(answer_ids)
    weights = [0.0] * (len(prompt_ids) - 1) + [1.0] * len(answer_ids)
    return TrainItem(
        slot=slot,
        tokens=torch.tensor(seq[:-1]),
        loss_fn="cross_entropy",
        loss_inputs={"target_tokens": torch.tensor(seq[1:]), "weights": torch.tensor(weights)},
    )


def run_demo(
    base_model: str,
    *,
    dtype: str,
    steps: int,
    out_dir: Path,
    device: str = "cpu",
    numerics: NumericsName = DEFAULT_NUMERICS,
) -> list[dict[str, float]]:
    start = time.perf_counter()
    base = load_base(base_model, dtype=dtype, device=device)
    loaded_s = time.perf_counter() - start
    apply_numerics(base.model, numerics)
    adapted = AdaptedModel(base.model, resolve_tinker_targets(base.model))
    r_max = max(t.rank for t in TENANTS)
    adapted.add_bank("train", num_slots=len(TENANTS) + 1, r_max=r_max)
    # on CUDA the fused LoRA kernel runs only once it has matched the torch path here
    adapted.kernel_verdict = prove_fused_kernel(adapted, r_max)
    engine = TrainEngine(adapted, base_model_id=base.model_id)
    slots = [
        engine.create_adapter(AdapterSpec(rank=t.rank, alpha=2.0 * t.rank, seed=i))
        for i, t in enumerate(TENANTS)
    ]
    items = [_chat_item(base.tokenizer, t, s) for t, s in zip(TENANTS, slots, strict=True)]
    hparams = {
        s: AdamHParams(learning_rate=t.learning_rate) for t, s in zip(TENANTS, slots, strict=True)
    }
    print(
        f"base {base.model_id} ({sum(p.numel() for p in base.model.parameters()) / 1e6:.1f}M params, {dtype}, "
        f"{device}) loaded in {loaded_s:.1f}s; {len(adapted.layers)} layers carry banks"
    )
    print(
        f"{len(TENANTS)} adapters: "
        + ", ".join(f"{t.name} (rank {t.rank}, lr {t.learning_rate:g})" for t in TENANTS)
    )
    history: list[dict[str, float]] = []
    print(f"\n{'step':>4}  " + "  ".join(f"{t.name:>11}" for t in TENANTS) + "   step time")
    for step in range(steps):
        t0 = time.perf_counter()
        out = engine.forward_backward(items)  # one mixed batch, all four adapters
        engine.optim_step(hparams)  # one BankAdamW call
        elapsed = time.perf_counter() - t0
        per_token = {
            t.name: o.metrics["loss:sum"] / max(float(item.loss_inputs["weights"].sum()), 1.0)
            for t, o, item in zip(TENANTS, out.items, items, strict=True)
        }
        history.append(per_token)
        print(
            f"{step:>4}  "
            + "  ".join(f"{per_token[t.name]:>11.3f}" for t in TENANTS)
            + f"   {elapsed:8.2f}s"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    print("\nexported PEFT adapters:")
    for t, s in zip(TENANTS, slots, strict=True):
        path = engine.export_peft(s, out_dir / t.name, overwrite=True)
        print(f"  {t.name:<11} {path}")
    first, last = history[0], history[-1]
    print(
        "\nloss per answer token, first -> last step: "
        + ", ".join(f"{k} {first[k]:.2f} -> {last[k]:.2f}" for k in first)
    )
    return history
