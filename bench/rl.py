"""RL throughput with several tenants in one run vs one tenant, on SmolLM2-135M.

Every side is one GRPO step per tenant (8 prompts x 4 samples, sampling + forward_backward +
optim_step) through the real SDK against one embedded server; with 4 tenants their requests
are in flight together, so the server batches them. `tenants4_throughput_over_1` is rollouts/s
with 4 tenants over rollouts/s with 1 (target >= 1.5). The TRL GRPOTrainer comparison
(`step_time_over_trl`) is not implemented yet.

    .venv/bin/python -m bench.rl --json bench/results/rl.json
"""

from __future__ import annotations

import os
import tempfile
import threading
from itertools import count
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

from bench.common import interleaved, parse_args, report  # noqa: E402
from lorafleet.rl.connect import load_tokenizer, start_backend  # noqa: E402
from lorafleet.rl.loop import RLConfig, TenantConfig, TenantRunner  # noqa: E402
from lorafleet.rl.report import Progress  # noqa: E402


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], max_tokens=(int, 16, "tokens sampled per rollout"),
                      base_model=(str, "smollm2-135m", "preset or HF dir"))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        tenants = [TenantConfig(name=f"t{i}", task="arithmetic", prompts_per_step=8, group_size=4,
                                max_tokens=args.max_tokens, seed=i) for i in range(5)]
        keys = [f"tml-bench-rl-{i:02d}-0123456789" for i in range(5)]
        backend = start_backend(base_model=args.base_model, run_dir=run_dir, keys=keys, base_url=None,
                                max_adapters=5, max_sample_rows=128)
        config = RLConfig(args.base_model, run_dir, tenants, progress=False)
        stop = threading.Event()
        runners = [TenantRunner(t, config, backend, k, Progress(False), stop) for t, k in zip(tenants, keys, strict=True)]
        clients = [backend.client(k) for k in keys]
        tcs = [c.create_lora_training_client(backend.base_model, rank=8, seed=i).result() for i, c in enumerate(clients)]
        tokenizer = load_tokenizer(backend, tcs[0])
        steps = count()

        def one() -> None:
            runners[0].train_step(tcs[0], tokenizer, next(steps))

        def four() -> None:
            step = next(steps)
            threads = [threading.Thread(target=r.train_step, args=(tc, tokenizer, step)) for r, tc in zip(runners[1:], tcs[1:], strict=True)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        try:
            timings = interleaved({"1 tenant x 32 rollouts": one, "4 tenants x 32 rollouts": four}, args.repeats, warmup=1)
        finally:
            for c in clients:
                c.close("success").result(timeout=30)
            backend.close()
    t1 = timings["1 tenant x 32 rollouts"]["min_s"]
    t4 = timings["4 tenants x 32 rollouts"]["min_s"]
    report("RL rollouts/s: 4 tenants in one run vs 1 (SmolLM2-135M, 8 prompts x 4 samples per tenant-step)", timings,
           {"tenants4_throughput_over_1": ((4 * 32 / t4) / (32 / t1), ">= 1.5")}, args.json,
           extra={"max_tokens": args.max_tokens, "step_time_over_trl": None})


if __name__ == "__main__":
    main()
