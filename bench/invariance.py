"""Shared equals alone: does a tenant's numbers depend on who shares its batch? (issue 35)

On SmolLM2-135M, one tenant's datums (two, sharing a 24-token prefix, as an RL group does) are
run alone and then together with 1, 3 and 7 other tenants' datums of other lengths (23 to 150
tokens), in four places:

- `train_forward`: `TrainEngine.forward`, the tenant's per-token log-probs;
- `train_backward`: `forward_backward`, the tenant's adapter gradient row (cosine, max |delta|
  against the solo gradient) and its log-probs;
- `prefill`: the sampler's prompt log-probs of the tenant's prompt (one `generate` with the
  partners' requests);
- `decode`: the log-probs of the 16 tokens the sampler draws for the tenant (seeded), compared
  while the drawn tokens agree (a differing token is counted in `tokens_diverged`).

Then, alone: the sampler versus the trainer on the same tokens (the tenant's prompt and drawn
tokens scored by `TrainEngine.forward`), for the prompt positions (prefill) and the drawn ones
(decode), and the sampler's decode against its own prefill of the same sequence.

Every case runs for each `--dtypes` and each `--numerics` mode (`fast` is the stock kernels,
the "before"; `batch-invariant` the invariant path, model/numerics.py). Reported: max and mean
|delta log-prob| per case; JSON keys `bf16_train_forward_max_abs_diff`,
`bf16_decode_max_abs_diff` (batch-invariant, worst over 1/3/7 partners) and
`bf16_grad_min_cosine`, plus every case under `cases`.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.invariance --json bench/results/invariance.json
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from bench.common import TORCH_DTYPES, bench_device, environment, fixed_dtype
from lorafleet.engines import Colocated, colocate
from lorafleet.fsio import atomic_write_bytes
from lorafleet.model.loader import load_base
from lorafleet.model.numerics import NUMERICS, apply_numerics, parse_numerics
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample import SampleRequest, SamplingParams
from lorafleet.sample.types import VersionKey
from lorafleet.train.items import TrainItem

PRESET = "smollm2-135m"
RANK = 8
PARTNER_LENGTHS = (23, 97, 64, 130, 31, 77, 150)
TENANT_LENGTHS = (40, 56)
SHARED_PREFIX = 24
DECODE_TOKENS = 16
PLACES = ("train_forward", "train_backward", "prefill", "decode")


def _tokens(seed: int, count: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (count,), generator=gen)


def _datum(slot: int, tokens: torch.Tensor) -> TrainItem:
    n = tokens.numel()
    return TrainItem(
        slot,
        tokens[:-1],
        "cross_entropy",
        {"target_tokens": tokens[1:], "weights": torch.ones(n - 1)},
    )


class Setup:
    """The tenant's and partners' datums and prompts, and the adapters they train/sample."""

    def __init__(self, stack: Colocated, keys: list[VersionKey], slots: list[int], vocab: int):
        self.stack, self.keys, self.slots = stack, keys, slots
        prefix = _tokens(1, SHARED_PREFIX, vocab)
        self.tenant_tokens = [
            torch.cat([prefix, _tokens(2 + i, n - SHARED_PREFIX, vocab)])
            for i, n in enumerate(TENANT_LENGTHS)
        ]
        self.partner_tokens = [_tokens(10 + i, n, vocab) for i, n in enumerate(PARTNER_LENGTHS)]

    def items(self, partners: int) -> list[TrainItem]:
        own = [_datum(self.slots[0], t) for t in self.tenant_tokens]
        others = [_datum(self.slots[1 + i], self.partner_tokens[i]) for i in range(partners)]
        return own + others

    def requests(self, partners: int) -> list[SampleRequest]:
        own = SampleRequest(
            self.tenant_tokens[0].tolist(),
            SamplingParams(max_tokens=DECODE_TOKENS, temperature=1.0, seed=7, stop=[]),
            adapter=self.keys[0],
            prompt_logprobs=True,
        )
        others = [
            SampleRequest(
                self.partner_tokens[i].tolist(),
                SamplingParams(max_tokens=8 + 4 * i, temperature=1.0, seed=100 + i, stop=[]),
                adapter=self.keys[1 + i],
                prompt_logprobs=bool(i % 2),
            )
            for i in range(partners)
        ]
        # the tenant's request in the middle of the batch, not always first
        return [*others[: partners // 2], own, *others[partners // 2 :]]


def _train(setup: Setup, partners: int, backward: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    trainer = setup.stack.trainer
    items = setup.items(partners)
    if not backward:
        out = trainer.forward(items)
        return torch.cat([o.logprobs.reshape(-1) for o in out.items[:2]]), None
    grads = trainer.bank.grads
    assert grads is not None
    with torch.no_grad():
        grads.zero_()
    out = trainer.forward_backward(items)
    grad = grads[setup.slots[0]].detach().clone().float()
    with torch.no_grad():
        grads.zero_()
    return torch.cat([o.logprobs.reshape(-1) for o in out.items[:2]]), grad


def _sample(setup: Setup, partners: int) -> tuple[torch.Tensor, list[int], list[float]]:
    """The tenant's prompt log-probs, drawn tokens and their log-probs."""
    requests = setup.requests(partners)
    results = setup.stack.sampler.generate(requests)
    own = results[partners // 2]
    if not own.ok:
        raise RuntimeError(f"the tenant's sample failed: {own.error}")
    for result in results:
        if not result.ok:
            raise RuntimeError(f"a partner's sample failed: {result.error}")
    prompt = torch.tensor([v for v in own.prompt_logprobs or [] if v is not None])
    seq = own.sequences[0]
    return prompt, list(seq.tokens), list(seq.logprobs)


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    delta = (a.double() - b.double()).abs()
    if delta.numel() == 0:  # the drawn tokens differed from the first one on
        return {"max_abs_diff": math.nan, "mean_abs_diff": math.nan}
    return {"max_abs_diff": float(delta.max()), "mean_abs_diff": float(delta.mean())}


def _grad_compare(grad: torch.Tensor, solo: torch.Tensor) -> dict[str, float]:
    cosine = torch.nn.functional.cosine_similarity(grad.double(), solo.double(), dim=0)
    return {"grad_cosine": float(cosine), "grad_max_abs_diff": float((grad - solo).abs().max())}


def measure(stack: Colocated, setup: Setup, partner_counts: list[int]) -> dict[str, object]:
    """Every place and partner count for the mode the model is in now."""
    cases: dict[str, object] = {}
    solo_fwd, _ = _train(setup, 0, False)
    solo_bwd, solo_grad = _train(setup, 0, True)
    assert solo_grad is not None
    solo_prompt, solo_tokens, solo_logprobs = _sample(setup, 0)
    for k in partner_counts:
        fwd, _ = _train(setup, k, False)
        bwd, grad = _train(setup, k, True)
        assert grad is not None
        prompt, tokens, logprobs = _sample(setup, k)
        same = 0
        while same < min(len(tokens), len(solo_tokens)) and tokens[same] == solo_tokens[same]:
            same += 1
        decode = _diff(torch.tensor(logprobs[:same]), torch.tensor(solo_logprobs[:same]))
        cases[f"partners_{k}"] = {
            "train_forward": _diff(fwd, solo_fwd),
            "train_backward": {**_diff(bwd, solo_bwd), **_grad_compare(grad, solo_grad)},
            "prefill": _diff(prompt, solo_prompt),
            "decode": {
                **decode,
                "tokens_compared": same,
                "tokens_diverged": int(same < len(solo_tokens)),
            },
        }
    # the sampler against the trainer on the same tokens, and decode against prefill
    full = torch.cat([setup.tenant_tokens[0], torch.tensor(solo_tokens)])
    trainer_lp = stack.trainer.forward([_datum(setup.slots[0], full)]).items[0].logprobs.reshape(-1)
    n_prompt = setup.tenant_tokens[0].numel() - 1
    refill = stack.sampler.generate(
        [
            SampleRequest(
                full.tolist(),
                SamplingParams(max_tokens=1, temperature=1.0, seed=1, stop=[]),
                adapter=setup.keys[0],
                prompt_logprobs=True,
            )
        ]
    )[0]
    refill_lp = torch.tensor([v for v in refill.prompt_logprobs or [] if v is not None])
    decoded = torch.tensor(solo_logprobs)
    cases["sampler_vs_trainer"] = {
        "prefill": _diff(solo_prompt, trainer_lp[:n_prompt]),
        "decode": _diff(decoded, trainer_lp[n_prompt:]),
    }
    cases["sampler_decode_vs_prefill"] = _diff(decoded, refill_lp[n_prompt:])
    return cases


def _worst(values: Iterable[float]) -> float:
    """The largest value; NaN (nothing comparable) wins, so it is never hidden."""
    found = list(values)
    return math.nan if any(math.isnan(v) for v in found) else max(found)


def components(dtype: torch.dtype) -> dict[str, float]:
    """Each piece of a forward alone: the max |delta| of one row's output computed alone vs
    among other rows / padded to other lengths, at SmolLM2-135M's shapes (random values)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from lorafleet.model.numerics import invariant_attention, invariant_linear

    gen = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}

    def worst(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
        return max(float((a.float() - b.float()).abs().max()) for a, b in pairs)

    heads, length, dim = 9, 40, 64
    q, k, v = (torch.randn(1, heads, length, dim, generator=gen).to(dtype) for _ in range(3))
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    module = torch.nn.Module()

    def padded(total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        keys = torch.zeros(1, heads, total, dim, dtype=dtype)
        values = torch.zeros_like(keys)
        keys[:, :, :length], values[:, :, :length] = k, v
        mask = torch.zeros(1, 1, length, total, dtype=torch.bool)
        mask[0, 0, :, :length] = causal
        return keys, values, mask

    def sdpa(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

    def mine(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return invariant_attention(module, q, keys, values, mask)[0]

    totals = (41, 47, 48, 64, 81, 200)
    out["attention_sdpa_padded_keys"] = worst(
        (sdpa(*padded(t)), sdpa(*padded(length))) for t in totals
    )
    out["attention_invariant_padded_keys"] = worst(
        (mine(*padded(t)), mine(*padded(length))) for t in totals
    )
    decode = invariant_attention(module, q[:, :, -1:], k, v, causal[None, None, -1:])[0]
    out["attention_invariant_decode_vs_prefill"] = worst(
        [(decode[:, 0], mine(*padded(length))[:, -1])]
    )
    for n, kk in ((576, 576), (1536, 576), (576, 1536), (49152, 576)):
        weight = torch.randn(n, kk, generator=gen).to(dtype)
        x = torch.randn(300, kk, generator=gen).to(dtype)
        ref = torch.nn.functional.linear(x, weight)
        tiled = invariant_linear(x, weight, None)
        rows = (1, 2, 7, 16, 33, 64, 200)
        out[f"linear_{n}x{kk}_row_count"] = worst(
            (torch.nn.functional.linear(x[:m], weight), ref[:m]) for m in rows
        )
        out[f"linear_invariant_{n}x{kk}_row_count"] = worst(
            (invariant_linear(x[:m], weight, None), tiled[:m]) for m in rows
        )
    norm = LlamaRMSNorm(576).to(dtype)
    h = torch.randn(300, 576, generator=gen).to(dtype)
    out["rmsnorm_row_count"] = worst((norm(h[:m]), norm(h)[:m]) for m in (1, 7, 64))
    logits = torch.randn(300, 49152, generator=gen)
    full = torch.log_softmax(logits, -1)
    out["log_softmax_fp32_row_count"] = worst(
        (torch.log_softmax(logits[:m], -1), full[:m]) for m in (1, 7, 64)
    )
    return out


def _row(label: str, values: dict[str, float]) -> str:
    extra = f"  cos {values['grad_cosine']:.7f}" if "grad_cosine" in values else ""
    return f"{label:<46}{values['max_abs_diff']:>12.3e}{values['mean_abs_diff']:>12.3e}{extra}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="base dtypes, comma-separated")
    parser.add_argument(
        "--numerics",
        default="fast,batch-invariant",
        help=f"modes, comma-separated ({', '.join(NUMERICS)})",
    )
    parser.add_argument("--partners", default="1,3,7", help="partner counts, comma-separated")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--device", default="cpu", help="where the engines run (cpu, cuda[:N])")
    parser.add_argument(
        "--components-only", action="store_true", help="only the per-component row checks"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = bench_device(args.device).device
    modes = [parse_numerics(m.strip()) for m in args.numerics.split(",") if m.strip()]
    partner_counts = [int(p) for p in args.partners.split(",") if p.strip()]
    if any(not 1 <= p <= len(PARTNER_LENGTHS) for p in partner_counts):
        parser.error(
            f"--partners: each count must be 1..{len(PARTNER_LENGTHS)}, got {args.partners!r}"
        )
    results: dict[str, object] = {}
    parts: dict[str, dict[str, float]] = {}
    choice = None
    start = time.perf_counter()
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for dtype in dtypes:
        if dtype not in TORCH_DTYPES:
            parser.error(f"--dtypes: {dtype!r} is not one of {sorted(TORCH_DTYPES)}")
        with torch.no_grad():
            parts[dtype] = components(TORCH_DTYPES[dtype])
    print(
        f"\n{'component: max |delta| of a row alone vs among others':<52}"
        + "".join(f"{d:>12}" for d in dtypes)
    )
    for name in parts[dtypes[0]]:
        print(f"{name:<52}" + "".join(f"{parts[d][name]:>12.3e}" for d in dtypes))
    for dtype in dtypes if not args.components_only else []:
        choice = fixed_dtype(dtype, "bench.invariance measures each dtype it is given")
        base = load_base(PRESET, dtype=dtype, device=device)
        stack = colocate(
            base.model,
            resolve_tinker_targets(base.model, train_unembed=False),
            base_model_id=PRESET,
            tokenizer=base.tokenizer,
            train_slots=8,
            sample_slots=8,
            r_max=RANK,
            max_rows=16,
            numerics=modes[0],
        )
        from bench.common import publish_random_adapters

        keys, slots = publish_random_adapters(stack, 1 + len(PARTNER_LENGTHS), RANK)
        setup = Setup(stack, keys, slots, int(base.model.config.vocab_size))
        for mode in modes:
            apply_numerics(stack.adapted.model, mode)
            stack.sampler.prefix_cache.clear()
            results[f"{dtype}/{mode}"] = measure(stack, setup, partner_counts)
    print(
        f"\nshared vs solo, SmolLM2-135M, |delta log-prob| per token ({time.perf_counter() - start:.0f} s)"
    )
    print(f"{'case':<46}{'max':>12}{'mean':>12}")
    for name, cases in results.items():
        assert isinstance(cases, dict)
        for case, places in cases.items():
            if case.startswith("partners_"):
                for place in PLACES:
                    print(_row(f"{name} {case} {place}", places[place]))
            elif "max_abs_diff" in places:
                print(_row(f"{name} {case}", places))
            else:
                for place, values in places.items():
                    print(_row(f"{name} {case} {place}", values))
    summary: dict[str, object] = {}
    for dtype, short in (("bfloat16", "bf16"), ("float32", "fp32")):
        for mode in modes:
            cases = results.get(f"{dtype}/{mode}")
            if not isinstance(cases, dict):
                continue
            tag = short if mode == "batch-invariant" else f"{short}_{mode}"
            parts = [v for k, v in cases.items() if k.startswith("partners_")]
            summary[f"{tag}_train_forward_max_abs_diff"] = max(
                p["train_forward"]["max_abs_diff"] for p in parts
            )
            summary[f"{tag}_train_backward_max_abs_diff"] = max(
                p["train_backward"]["max_abs_diff"] for p in parts
            )
            summary[f"{tag}_prefill_max_abs_diff"] = max(
                p["prefill"]["max_abs_diff"] for p in parts
            )
            summary[f"{tag}_decode_max_abs_diff"] = _worst(
                p["decode"]["max_abs_diff"] for p in parts
            )
            summary[f"{tag}_decode_tokens_diverged"] = sum(
                p["decode"]["tokens_diverged"] for p in parts
            )
            summary[f"{tag}_grad_min_cosine"] = min(
                p["train_backward"]["grad_cosine"] for p in parts
            )
            gap = cases["sampler_vs_trainer"]
            summary[f"{tag}_sampler_vs_trainer_max_abs_diff"] = max(
                gap["prefill"]["max_abs_diff"], gap["decode"]["max_abs_diff"]
            )
    print()
    for key, value in summary.items():
        print(
            f"{key:<46}{value:>14.6g}"
            if isinstance(value, float) and not math.isnan(value)
            else f"{key:<46}{value!r:>14}"
        )
    if args.json is not None:
        choice = choice or fixed_dtype(
            dtypes[0], "bench.invariance measures each dtype it is given"
        )
        import json

        record = {
            "benchmark": "bench.invariance",
            **summary,
            "cases": results,
            "numerics": modes,
            "partners": partner_counts,
            "components": parts,
            "environment": environment(choice),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(args.json, (json.dumps(record, indent=2) + "\n").encode())
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
