"""Scale-out costs on SmolLM2-135M (real weights, fp32), LoRA rank 16 on attention + MLP.

Part `gather` (2 gloo ranks under torchrun vs 1 process): the time for the trainer process that
talks to the server to hold one adapter's full training state (A/B + AdamW moments + step, what
a checkpoint or a sync needs), in the per-layer form. Sides, interleaved:
- `1proc_state`: one process reads its bank and optimizer (per-layer copies);
- `2ranks_state_owner0` / `2ranks_state_owner1`: the sharded trainer's `gather_state` for a slot
  whose optimizer state lives on rank 0 / on rank 1 (moments sent layer by layer over gloo),
  measured end to end at the server (includes the hop rank 0 -> server process);
- `1proc_weights` / `2ranks_weights`: only A/B (what export and sampler sync read).
`gather_2ranks_over_1proc` = 2ranks_state_owner1 / 1proc_state (informational: the same bytes
must be copied either way; the question is what sharding adds).

Part `ray` (local Ray cluster): one trainer-rank actor per `--ray-ranks`, two sampler-replica
actors. A training step is one mixed forward_backward over `--adapters` adapters x 2 sequences
x `--seq-len` tokens plus one optim_step; the sync after it publishes every stepped adapter to
every replica through the object store (trainer rank 0 -> object store -> replicas, each replica
writing its private reload copy). `sync_over_step` = sync time / step time (target <= 0.05).
`verify_s` (canary on every replica) is reported apart.

    .venv/bin/python -m bench.scale --json bench/results/scale.json
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import fixed_dtype, interleaved, parse_args, report

PRESET = "smollm2-135m"
RANK = 16


def _targets() -> tuple[str, ...]:
    """The attention + MLP linears, resolved on a weightless (meta) copy of the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lorafleet.model.presets import materialize
    from lorafleet.model.targets import resolve_tinker_targets

    config = AutoConfig.from_pretrained(materialize(PRESET), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return resolve_tinker_targets(model, train_unembed=False)


def _batch(slots, seq_len: int, seed: int):
    from lorafleet.train.engine import TrainItem

    gen = torch.Generator().manual_seed(seed)
    items = []
    for slot in slots:
        for _ in range(2):
            tokens = torch.randint(100, 40000, (seq_len,), generator=gen)
            items.append(
                TrainItem(
                    slot,
                    tokens,
                    "cross_entropy",
                    {"target_tokens": torch.roll(tokens, -1), "weights": torch.ones(seq_len)},
                )
            )
    return items


def _train(engine, slots, seq_len: int, seed: int) -> None:
    from lorafleet.train.optim import AdamHParams

    engine.forward_backward(_batch(slots, seq_len, seed))
    engine.optim_step({slot: AdamHParams(learning_rate=1e-3) for slot in slots})


def bench_gather(args, targets) -> dict:
    from lorafleet.adapters.checkpoint import MOMENTS
    from lorafleet.distributed.launcher import TorchrunRanks
    from lorafleet.distributed.protocol import RankSettings
    from lorafleet.distributed.remote import DistTrainEngine
    from lorafleet.model.adapted import AdaptedModel
    from lorafleet.model.banks import AdapterSpec
    from lorafleet.model.loader import load_base
    from lorafleet.train.engine import TrainEngine

    num_slots = 5  # rank 0 keeps the optimizer state of slots 1-2, rank 1 of slots 3-4
    settings = RankSettings(
        base_model=PRESET,
        targets=targets,
        num_slots=num_slots,
        r_max=RANK,
        dtype="float32",
        torch_threads=1,
    )
    sharded = DistTrainEngine(TorchrunRanks(settings, 2))
    base = load_base(PRESET)
    adapted = AdaptedModel(base.model, targets)
    adapted.add_bank("train", num_slots=num_slots, r_max=RANK)
    single = TrainEngine(adapted, base_model_id=base.model_id)
    try:
        for engine in (sharded, single):
            for slot in (1, 3):
                engine.create_adapter(AdapterSpec(rank=RANK, alpha=32, seed=slot), slot)
            _train(engine, [1, 3], 32, 0)  # real moments, step 1

        def one_state() -> None:
            info = single.bank.check_slot(3)
            weights = single.bank.slot_weights(3)
            state = single.optimizer.slot_state(3)
            for name in MOMENTS:
                {
                    p: (a.clone(), b.clone())
                    for p, (a, b) in single.bank.split_row(
                        state[name], info.spec.rank, info.targets
                    ).items()
                }
            assert weights

        sides = {
            "1proc_state": one_state,
            "2ranks_state_owner0": lambda: sharded.client.call("gather_state", slot=1),
            "2ranks_state_owner1": lambda: sharded.client.call("gather_state", slot=3),
            "1proc_weights": lambda: single.bank.slot_weights(3),
            "2ranks_weights": lambda: sharded.client.call("slot_weights", slot=3),
        }
        timings = interleaved(sides, repeats=args.repeats)
        info = single.bank.check_slot(3)
        adapter_floats = sum(a.numel() + b.numel() for a, b in single.bank.slot_weights(3).values())
        largest_layer = max(a.numel() + b.numel() for a, b in single.bank.slot_weights(3).values())
        return {
            "timings": timings,
            "adapter_mb_fp32": adapter_floats * 4 / 2**20,
            "state_mb_fp32": 3 * adapter_floats * 4 / 2**20,
            "largest_layer_mb_fp32": largest_layer * 4 / 2**20,
            "layers": len(info.targets),
        }
    finally:
        sharded.close()


def rank_gather_worker(args) -> None:
    """Run by torchrun (2 ranks): times `gather_state` inside the ranks, as rank 0 sees it
    (from a common start to holding every tensor), without the hop to a server process."""
    import json

    import torch.distributed as dist

    from lorafleet.distributed.protocol import RankSettings
    from lorafleet.distributed.trainer_worker import RankWorker
    from lorafleet.model.banks import AdapterSpec
    from lorafleet.train.optim import AdamHParams

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    settings = RankSettings(
        base_model=PRESET,
        targets=_targets(),
        num_slots=5,
        r_max=RANK,
        dtype="float32",
        torch_threads=1,
    )
    trainer = RankWorker(settings).trainer
    for slot in (1, 3):
        trainer.create_adapter(AdapterSpec(rank=RANK, alpha=32, seed=slot), slot)
    trainer.run(trainer.engine.prepare(_batch([1, 3], 32, 0)), backward=True)
    trainer.optim_step({1: AdamHParams(learning_rate=1e-3), 3: AdamHParams(learning_rate=1e-3)})
    times: dict[str, list[float]] = {
        "rank_state_owner0": [],
        "rank_state_owner1": [],
        "rank_weights": [],
    }
    for round_ in range(args.repeats + 1):
        for name, run in (
            ("rank_state_owner0", lambda: trainer.gather_state(1)),
            ("rank_state_owner1", lambda: trainer.gather_state(3)),
            ("rank_weights", lambda: trainer.slot_weights(3)),
        ):
            dist.barrier()
            start = time.perf_counter()
            run()
            elapsed = time.perf_counter() - start
            if round_:
                times[name].append(elapsed)
    if dist.get_rank() == 0:
        out = {
            name: {"min_s": min(v), "median_s": statistics.median(v), "runs": len(v)}
            for name, v in times.items()
        }
        Path(args.rank_gather_out).write_text(json.dumps(out))
    dist.destroy_process_group()


def bench_rank_gather(args) -> dict:
    import json
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank_gather.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "bench.scale",
            "--rank-gather-out",
            str(out),
            "--repeats",
            str(args.repeats),
        ]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return json.loads(out.read_text())


def bench_ray(args, targets) -> dict:
    import ray

    from lorafleet.distributed.protocol import RankSettings
    from lorafleet.distributed.ray_samplers import RaySamplerPool, SamplerSettings
    from lorafleet.distributed.ray_trainer import RayRanks
    from lorafleet.distributed.remote import DistTrainEngine
    from lorafleet.model.banks import AdapterSpec

    env = {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "LORAFLEET_CACHE") if k in os.environ}
    ray.init(
        num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False
    )
    trainer = pool = None
    try:
        trainer = DistTrainEngine(
            RayRanks(
                RankSettings(
                    base_model=PRESET,
                    targets=targets,
                    num_slots=args.adapters + 1,
                    r_max=RANK,
                    dtype="float32",
                    torch_threads=1,
                ),
                args.ray_ranks,
            )
        )
        pool = RaySamplerPool(
            SamplerSettings(
                base_model=PRESET,
                targets=targets,
                slots=2 * args.adapters,
                r_max=RANK,
                dtype="float32",
                torch_threads=1,
            ),
            2,
            trainer=trainer,
            verify=False,
        )
        slots = [
            trainer.create_adapter(AdapterSpec(rank=RANK, alpha=32, seed=i))
            for i in range(args.adapters)
        ]
        steps, syncs, verifies = [], [], []
        for step in range(args.repeats + 1):  # the first round warms up
            start = time.perf_counter()
            _train(trainer, slots, args.seq_len, step)
            step_s = time.perf_counter() - start
            start = time.perf_counter()
            keys = [pool.versions.publish(f"adapter-{slot}", trainer.bank, slot) for slot in slots]
            sync_s = time.perf_counter() - start
            start = time.perf_counter()
            for key, slot in zip(keys, slots, strict=True):
                pool.versions.verify_everywhere(key, slot)
            verify_s = time.perf_counter() - start
            for key in keys:
                if key[1] > 0:
                    pool.versions.drop((key[0], key[1] - 1))
            if step:
                steps.append(step_s)
                syncs.append(sync_s)
                verifies.append(verify_s)
            print(
                f"round {step}: step {step_s:.2f} s, sync {sync_s:.3f} s, verify {verify_s:.3f} s",
                flush=True,
            )
        pool.close()
        pool = None
        ratios = [s / t for s, t in zip(syncs, steps, strict=True)]
        return {
            "step_s": {
                "min_s": min(steps),
                "median_s": statistics.median(steps),
                "runs": len(steps),
            },
            "sync_s": {
                "min_s": min(syncs),
                "median_s": statistics.median(syncs),
                "runs": len(syncs),
            },
            "verify_s": {
                "min_s": min(verifies),
                "median_s": statistics.median(verifies),
                "runs": len(verifies),
            },
            "sync_over_step": statistics.median(ratios),
            "sync_over_step_max": max(ratios),
            "trainer_ranks": args.ray_ranks,
            "sampler_replicas": 2,
            "adapters_per_step": args.adapters,
            "tokens_per_step": args.adapters * 2 * args.seq_len,
        }
    finally:
        if pool is not None:
            pool.close()
        if trainer is not None:
            trainer.close()
        ray.shutdown()


def main() -> None:
    args = parse_args(
        __doc__,
        with_device=False,
        with_dtype=False,
        part=(str, "all", "gather, ray or all"),
        adapters=(int, 4, "adapters stepped (and synced) per training step, Ray part"),
        seq_len=(int, 128, "tokens per sequence (2 sequences per adapter), Ray part"),
        ray_ranks=(int, 1, "trainer-rank actors in the Ray part"),
        rank_gather_out=(
            str,
            "",
            "internal: run as a torchrun rank, write in-rank gather times here",
        ),
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.rank_gather_out:
        rank_gather_worker(args)
        return
    torch.set_num_threads(1)
    choice = fixed_dtype(
        "float32", "fixed: the gloo gathers and Ray syncs move fp32 adapter and optimizer state"
    )
    targets = _targets()
    timings: dict[str, dict[str, float]] = {}
    ratios: dict[str, tuple[float, str]] = {}
    extra: dict[str, object] = {
        "model": PRESET,
        "rank": RANK,
        "lora_targets": "attn+mlp",
        "layers": len(targets),
    }
    if args.part in ("gather", "all"):
        gather = bench_gather(args, targets)
        timings.update(gather.pop("timings"))
        timings.update(bench_rank_gather(args))
        ratios["gather_2ranks_over_1proc"] = (
            timings["rank_state_owner1"]["min_s"] / timings["1proc_state"]["min_s"],
            "informational (in the ranks)",
        )
        ratios["gather_2ranks_at_server_over_1proc"] = (
            timings["2ranks_state_owner1"]["min_s"] / timings["1proc_state"]["min_s"],
            "informational (+ hop to the server)",
        )
        extra["gather"] = gather
    if args.part in ("ray", "all"):
        ray_result = bench_ray(args, targets)
        for name in ("step_s", "sync_s", "verify_s"):
            timings[f"ray_{name[:-2]}"] = ray_result.pop(name)
        ratios["sync_over_step"] = (ray_result.pop("sync_over_step"), "<= 0.05")
        extra["ray"] = ray_result
    if args.json and args.part != "all" and Path(args.json).exists():
        _keep_other_part(Path(args.json), args.part, timings, ratios, extra)
    report(
        "scale-out: adapter gather (2 gloo ranks vs 1 process) and Ray sync / step",
        timings,
        ratios,
        Path(args.json) if args.json else None,
        extra,
        dtype=choice,
    )


def _keep_other_part(path: Path, part: str, timings: dict, ratios: dict, extra: dict) -> None:
    """Running one part alone keeps the other part's results already in the JSON file (the
    parts need different amounts of memory, so they are sometimes run apart)."""
    import json

    old = json.loads(path.read_text())
    other = "ray" if part == "gather" else "gather"
    is_ray = lambda name: name.startswith("ray_") or name == "sync_over_step"  # noqa: E731
    for name, value in old.get("timings", {}).items():
        if is_ray(name) == (other == "ray"):
            timings.setdefault(name, value)
    targets = old.get("targets")
    for name, target in (targets if isinstance(targets, dict) else {}).items():
        if is_ray(name) == (other == "ray") and name in old:
            ratios.setdefault(name, (old[name], target))
    if other in old:
        extra.setdefault(other, old[other])


if __name__ == "__main__":
    main()
