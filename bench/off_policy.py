"""Off-policy stability: `importance_sampling` vs `stable_reinforce` on the same task with
samples K = 0, 2 and 8 versions stale, reward and gradient norm per step.

Every side is a GRPO loop through the real SDK against one embedded server: at step s the
prompts are sampled by the weights of step max(0, s - K) (a named sampler checkpoint per step,
sampled with `record_stability_info=True`), scored, their advantages centred per group, then one
`forward_backward` with the side's loss and one `optim_step`; the optimizer's `grad_norm:mean`
is the gradient norm. Both losses see the same prompts and seeds at each step; the runs differ
only in loss and staleness. `importance_sampling` takes the sampler's log-probs from the client
(the stale sampler's), `stable_reinforce` from the server's records of the same samples.

The task is learnable by the tiny random-weight presets in seconds (share of digits in a short
completion, as the loop tests use), so a whole grid runs on two busy CPU cores; the learning
rate is the loop tests' (high), which is what makes staleness bite.

    .venv/bin/python -m bench.off_policy --json bench/results/off_policy.json \
        --png docs/off_policy.png

Not measured here: a bf16 sampler against an fp32 trainer (the embedded server samples with
the trainer's own base weights and dtype; a bf16 rollout engine beside an fp32 trainer needs
`--rollout-engine vllm`).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tinker import types

from bench.common import add_dtype_option, bench_dtype, environment
from lorafleet.fsio import atomic_write_bytes
from lorafleet.rl.connect import start_backend
from lorafleet.rl.datums import group_advantages, rl_datum
from lorafleet.rl.loop import with_provenance

KEY = "tml-bench-off-policy-0123456789"
LOSSES = ("importance_sampling", "stable_reinforce")


def digit_share(text: str) -> float:
    """The reward: share of the completion that is digits or spaces."""
    return sum(c.isdigit() or c.isspace() for c in text) / max(len(text), 1)


def run_side(
    service: Any,
    base_model: str,
    tokenizer: Any,
    loss: str,
    k: int,
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    tc = service.create_lora_training_client(base_model, rank=args.rank, seed=args.seed).result()
    samplers: list[Any] = []
    rows = []
    for step in range(args.steps):
        path = tc.save_weights_for_sampler(f"{loss}-k{k}-v{step}").result().path
        samplers.append(service.create_sampling_client(model_path=path, record_stability_info=True))
        version = max(0, step - k)
        sampler = samplers[version]
        rng = random.Random(args.seed * 7919 + step)
        prompts = [
            tokenizer.encode(f"say {rng.randint(0, 99)}:", add_special_tokens=False)
            for _ in range(args.prompts)
        ]
        futures = [
            sampler.sample(
                types.ModelInput.from_ints(p),
                args.group_size,
                types.SamplingParams(
                    max_tokens=args.max_tokens, temperature=1.0, seed=step * 100 + i
                ),
            )
            for i, p in enumerate(prompts)
        ]
        datums, rewards = [], []
        for prompt, future in zip(prompts, futures, strict=True):
            seqs = future.result().sequences
            group = [digit_share(tokenizer.decode(s.tokens)) for s in seqs]
            rewards.extend(group)
            for seq, adv in zip(seqs, group_advantages(group), strict=True):
                if adv != 0.0 and seq.tokens:
                    datum = rl_datum(prompt, seq.tokens, seq.logprobs, adv)
                    if loss == "stable_reinforce":
                        datum = with_provenance(datum, len(prompt), seq)
                    datums.append(datum)
        row: dict[str, Any] = {
            "step": step,
            "staleness": step - version,
            "reward_mean": statistics.fmean(rewards),
            "trained_rows": len(datums),
        }
        if datums:
            config = args.sr_config if loss == "stable_reinforce" else None
            fb = tc.forward_backward(datums, loss, loss_fn_config=config).result().metrics
            opt = tc.optim_step(types.AdamParams(learning_rate=args.lr)).result().metrics
            row.update(
                grad_norm=opt["grad_norm:mean"],
                loss=fb["loss:sum"],
                log_ratio_max=fb.get("log_ratio:max"),
                log_ratio_min=fb.get("log_ratio:min"),
                masked_tokens=fb.get("masked_tokens:sum"),
                active_tokens=fb.get("active_tokens:sum"),
            )
        rows.append(row)
        print(
            f"{loss:<20} K={k} step {step:>3}  reward {row['reward_mean']:.3f}  "
            f"grad_norm {row.get('grad_norm', float('nan')):.3g}",
            flush=True,
        )
    return rows


def plot(path: Path, results: dict[str, list[dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, rows in results.items():
        style = "-" if name.startswith("stable") else "--"
        xs = [r["step"] for r in rows]
        top.plot(xs, [r["reward_mean"] for r in rows], style, marker="o", ms=3, label=name)
        g = [(r["step"], r["grad_norm"]) for r in rows if "grad_norm" in r]
        if g:
            bottom.plot(*zip(*g, strict=True), style, marker="o", ms=3, label=name)
    top.set_ylabel("mean reward")
    bottom.set_ylabel("gradient norm (optim_step)")
    bottom.set_yscale("symlog", linthresh=1.0)  # 0 = nothing trained (every token masked)
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    tail = rows[-max(1, len(rows) // 4) :]
    norms = [r["grad_norm"] for r in rows if "grad_norm" in r]
    return {
        "reward_first": rows[0]["reward_mean"],
        "reward_last_quarter": statistics.fmean(r["reward_mean"] for r in tail),
        "grad_norm_median": statistics.median(norms) if norms else None,
        "grad_norm_max": max(norms) if norms else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-model", default="tiny-qwen3")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ks", default="0,2,8", help="staleness values, comma list")
    parser.add_argument("--losses", default=",".join(LOSSES))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument(
        "--sr-config",
        type=json.loads,
        default=None,
        help="stable_reinforce loss_fn_config as JSON, e.g. '{\"token_mask_high\": 20}'",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument(
        "--replot", type=Path, default=None, help="only redraw --png from this bench JSON"
    )
    add_dtype_option(parser, "float32")
    args = parser.parse_args()
    if args.replot is not None:
        if args.png is None:
            raise SystemExit("--replot needs --png")
        plot(args.png, json.loads(args.replot.read_text())["steps"])
        return
    dtype = bench_dtype(args.dtype)
    ks = [int(k) for k in args.ks.split(",")]
    losses = args.losses.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        backend = start_backend(
            base_model=args.base_model,
            run_dir=Path(tmp),
            keys=[KEY],
            base_url=None,
            dtype=dtype.dtype,
            max_rank=max(args.rank, 8),
            torch_threads=args.torch_threads,
            max_sample_rows=max(16, args.prompts * args.group_size),
        )
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(backend.tokenizer_dir))
            service = backend.client(KEY)
            results: dict[str, list[dict[str, Any]]] = {}
            started = time.perf_counter()
            for k in ks:
                for loss in losses:
                    results[f"{loss} K={k}"] = run_side(
                        service, backend.base_model, tokenizer, loss, k, args
                    )
            seconds = time.perf_counter() - started
            service.close("success").result(timeout=30)
        finally:
            backend.close()
    table = {name: summary(rows) for name, rows in results.items()}
    print(
        f"\n{'side':<30}{'reward first':>14}{'reward last 1/4':>17}{'|g| median':>12}{'|g| max':>12}"
    )
    nan = float("nan")
    for name, s in table.items():
        median = nan if s["grad_norm_median"] is None else s["grad_norm_median"]
        peak = nan if s["grad_norm_max"] is None else s["grad_norm_max"]
        print(
            f"{name:<30}{s['reward_first']:>14.3f}{s['reward_last_quarter']:>17.3f}"
            f"{median:>12.3g}{peak:>12.3g}"
        )
    if args.png is not None:
        plot(args.png, results)
        print(f"wrote {args.png}")
    if args.json is not None:
        out = {
            "benchmark": "off_policy",
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "summary": table,
            "steps": results,
            "seconds": seconds,
            "environment": environment(dtype),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(args.json, (json.dumps(out, indent=2) + "\n").encode())
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
