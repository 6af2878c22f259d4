"""Micro-benchmark: one BankAdamW.step over k slots vs k separate torch AdamW steps.

Why it exists: the bank optimizer is only worth its complexity if one vectorised pass
over [k, P] beats k per-adapter optimizers that each walk ~60 small tensors.

    .venv/bin/python bench/optim_micro.py [--slots 8] [--params 2400000] [--tensors 60]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lorafleet.train.optim import AdamHParams, BankAdamW


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _interleaved_min_times(
    cases: dict[str, tuple[Callable[[], None], Callable[[], None]]],
    repeats: int,
    device: torch.device,
) -> dict[str, float]:
    """Min over repeats of each (run, prepare) case, taking turns between cases.

    Taking turns means background load hits every case alike; the minimum is the
    least-disturbed run, the best estimate of the kernels' own cost.
    """
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(repeats):
        for name, (run, prepare) in cases.items():
            prepare()
            _sync(device)
            t0 = time.perf_counter()
            run()
            _sync(device)
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--params", type=int, default=2_400_000, help="P, values per adapter")
    ap.add_argument("--tensors", type=int, default=60, help="tensors per torch adapter")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--clip", type=float, default=0.0, help="grad_clip_norm (0 = off)")
    ap.add_argument(
        "--scattered",
        action="store_true",
        help="step every other slot (gather/scatter path) instead of a contiguous run",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    device = torch.device(args.device)
    k, n = args.slots, args.tensors
    per = args.params // n
    p_total = per * n
    hp = AdamHParams(learning_rate=1e-4, weight_decay=0.01, grad_clip_norm=args.clip)

    gen = torch.Generator().manual_seed(0)
    num_slots = 2 * k + 1 if args.scattered else k + 1
    params = torch.randn(num_slots, p_total, generator=gen).to(device)
    grads = torch.zeros_like(params)
    grad_src = torch.randn(num_slots, p_total, generator=gen).to(device)
    bank = BankAdamW(params, grads)
    slots = list(range(1, num_slots, 2)) if args.scattered else list(range(1, k + 1))
    hps = dict.fromkeys(slots, hp)

    def bank_prepare() -> None:
        grads.copy_(grad_src)  # step() zeroes the rows it consumed
        bank.note_gradient(slots)

    # k adapters, each a list of n tensors (like per-layer A/B) that sum to P.
    adapters = []
    for s in slots:
        ts = [torch.nn.Parameter(t.clone()) for t in params[s].split(per)]
        for t, g in zip(ts, grad_src[s].split(per), strict=True):
            t.grad = g.clone()
        adapters.append(ts)

    def torch_runner(foreach: bool | None) -> Callable[[], None]:
        opts = [
            torch.optim.AdamW(
                ts,
                lr=hp.learning_rate,
                betas=(hp.beta1, hp.beta2),
                eps=hp.eps,
                weight_decay=hp.weight_decay,
                foreach=foreach,
            )
            for ts in adapters
        ]

        def run() -> None:
            for ts, opt in zip(adapters, opts, strict=True):
                if hp.grad_clip_norm > 0:
                    torch.nn.utils.clip_grad_norm_(ts, hp.grad_clip_norm, foreach=foreach)
                opt.step()

        return run

    def noop() -> None:
        pass

    # Warm up allocator / lazy state for both.
    bank_prepare()
    bank.step(hps)
    runners = {"default": torch_runner(None), "foreach": torch_runner(True)}
    for r in runners.values():
        r()

    times = _interleaved_min_times(
        {
            "bank": (lambda: bank.step(hps), bank_prepare),
            **{name: (r, noop) for name, r in runners.items()},
        },
        args.repeats,
        device,
    )
    t_bank = times.pop("bank")
    print(
        f"device={device} slots={k} scattered={args.scattered} P={p_total} "
        f"tensors/adapter={n} clip={args.clip} threads={torch.get_num_threads()}"
    )
    print(f"BankAdamW.step            : {t_bank * 1e3:8.2f} ms")
    for name, t in times.items():
        print(f"{k} x torch AdamW ({name:7s}): {t * 1e3:8.2f} ms   torch/bank = {t / t_bank:.2f}x")


if __name__ == "__main__":
    main()
