"""Tinker-API servers under the same client workload: lorafleet vs skyrl-tx 0.3.0 (JAX backend).

Both servers run as their own processes on loopback and are driven by the official `tinker`
SDK from a separate client process (lorafleet: SDK 0.38 from our venv; skyrl-tx: SDK 0.16.1
from its venv, since 0.38 needs /client/config, which skyrl-tx 0.3.0 lacks). The two client
processes stay alive and run one round each in turn (A B A B ...); every workload is warmed up
once first (skyrl-tx JIT-compiles per batch shape) and reported by its minimum.

Workloads on the tiny-qwen3 preset, LoRA rank 8 on attention + MLP (skyrl-tx never trains the
unembedding; alpha 32 on both sides), TENANTS adapters:
- fwdbwd_1:   one adapter, forward_backward(8 x 32 tokens) + optim_step;
- fwdbwd_all: every adapter at once (one client thread each), each 8 x 32 + optim_step;
- sample_all: every adapter's sampling client at once, 8 samples x 32 new tokens each
              (compared in generated tokens per second);
- loop_all:   the headline workload: every client (one thread each) runs STEPS steps of
              forward_backward + optim_step + sample; `time_over_skyrl_tx` = our time ÷ theirs
              (target <= 0.5).

Base dtype `--dtype` (default auto: bf16 only where the CPU multiplies it natively), resolved
here once and given to both servers: `lorafleet serve --dtype`, and skyrl-tx through the
`dtype` of the config.json it loads (it builds its model in that dtype).

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.server --json bench/results/server.json

`--skyrl-venv DIR` must hold skyrl-tx; `--setup-skyrl` creates it (PEERS.md recipe); without
one the skyrl side is skipped and only lorafleet is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TENANTS = 4
STEPS = 10
ROWS, TOKENS, SAMPLES, NEW_TOKENS, RANK = 8, 32, 8, 32, 8
KEY = "tml-bench-key-0123456789"
DEFAULT_SKYRL_VENV = Path.home() / ".cache" / "lorafleet-peers" / "skyrl-tx-0.3.0"


# =============================================================================== client side
# Runs inside either venv: only the stdlib and `tinker` (0.16.1 or 0.38) may be imported here.


def _resolve(value):
    """0.38 returns futures from client factories; 0.16 returns the clients themselves."""
    return value.result() if "Future" in type(value).__name__ else value


def client_main(base_url: str, base_model: str, tenants: int) -> None:
    import random
    from concurrent.futures import ThreadPoolExecutor

    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key=KEY)
    trainers = []
    for i in range(tenants):
        try:
            made = service.create_lora_training_client(
                base_model=base_model, rank=RANK, seed=i, train_unembed=False
            )
        except TypeError:
            made = service.create_lora_training_client(base_model=base_model, rank=RANK)
        trainers.append(_resolve(made))
    rng = random.Random(0)

    def batch():
        out = []
        for _ in range(ROWS):
            seq = [rng.randrange(10, 500) for _ in range(TOKENS + 1)]
            out.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(seq[:-1]),
                    loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * TOKENS},
                )
            )
        return out

    data = [batch() for _ in range(tenants)]

    def train_step(i: int) -> None:
        fwd = trainers[i].forward_backward(data[i], "cross_entropy")
        opt = trainers[i].optim_step(types.AdamParams(learning_rate=1e-4))
        fwd.result()
        opt.result()

    samplers = [
        _resolve(tc.save_weights_and_get_sampling_client(name=f"bench-{i}"))
        for i, tc in enumerate(trainers)
    ]
    prompt = types.ModelInput.from_ints([rng.randrange(10, 500) for _ in range(16)])
    # Exactly NEW_TOKENS per sample on both sides: SDK >= 0.38 spells "never stop, not even at
    # EOS" as stop=[]; skyrl-tx with SDK 0.16 does not stop at EOS by default.
    version = tuple(int(p) for p in tinker.__version__.split(".")[:2])
    stop = [] if version >= (0, 38) else None
    params = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=1, stop=stop)

    def sample(i: int) -> int:
        response = (
            samplers[i].sample(prompt=prompt, num_samples=SAMPLES, sampling_params=params).result()
        )
        return sum(len(s.tokens) for s in response.sequences)

    pool = ThreadPoolExecutor(tenants)

    def tenant_loop(i: int) -> None:
        for _ in range(STEPS):
            train_step(i)
            sample(i)

    def workloads() -> dict[str, float]:
        times: dict[str, float] = {}
        start = time.perf_counter()
        train_step(0)
        times["fwdbwd_1"] = time.perf_counter() - start
        start = time.perf_counter()
        list(pool.map(train_step, range(tenants)))
        times["fwdbwd_all"] = time.perf_counter() - start
        start = time.perf_counter()
        tokens = sum(pool.map(sample, range(tenants)))
        times["sample_all"] = time.perf_counter() - start
        times["sample_all_tokens"] = float(tokens)
        start = time.perf_counter()
        list(pool.map(tenant_loop, range(tenants)))
        times["loop_all"] = time.perf_counter() - start
        return times

    workloads()  # warm-up (JIT compiles on skyrl-tx)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        print(json.dumps(workloads()), flush=True)
    pool.shutdown()


# =============================================================================== driver side


def setup_skyrl(venv: Path) -> None:
    """PEERS.md: torch first (the local CPU wheel), skyrl-tx without the CUDA extras, SDK 0.16.1."""
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, "skyrl-tx[tinker]==0.3.0", "jax", "flax", "optax"], check=True)
    subprocess.run([*pip, "tinker==0.16.1"], check=True)


def _uv_shim(directory: Path, python: Path) -> None:
    """skyrl-tx starts its engine with `uv run --extra ... -m tx.tinker.engine ...`."""
    shim = directory / "uv"
    shim.write_text(
        f"#!{python}\nimport os, sys\nargs = sys.argv[1:]\nif args[:1] == ['run']:\n    args = args[1:]\n"
        "out, i = [], 0\nwhile i < len(args):\n    if args[i] == '--extra':\n        i += 2\n        continue\n"
        f"    out.append(args[i])\n    i += 1\nos.execv({str(python)!r}, [{str(python)!r}, *out])\n"
    )
    shim.chmod(0o700)


def _skyrl_model_dir(model_dir: Path, dest: Path, dtype: str) -> Path:
    """skyrl-tx 0.3.0 reads `rope_theta` from the top level of config.json, where transformers 5
    no longer writes it (it moved into `rope_parameters`): same weights, config with both. It
    also builds its model in config.json's dtype, so that is set to the dtype our side runs."""
    dest.mkdir()
    for item in model_dir.iterdir():
        if item.name != "config.json":
            (dest / item.name).symlink_to(item)
    config = json.loads((model_dir / "config.json").read_text())
    config.setdefault(
        "rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    )
    config["dtype"] = config["torch_dtype"] = dtype
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


class Side:
    """One server process plus its long-lived client process."""

    def __init__(
        self,
        name: str,
        server_cmd: list[str],
        client_python: str,
        env: dict[str, str],
        port: int,
        base_model: str,
        startup_s: float,
    ):
        self.name = name
        url = f"http://127.0.0.1:{port}"
        self.server = subprocess.Popen(
            server_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        from bench.common import wait_healthy  # driver side only (the client side has no torch)

        wait_healthy(url, self.server, startup_s, what="server")
        client_env = {**env, "TINKER_TELEMETRY": "0", "TINKER_API_KEY": KEY}
        self.client = subprocess.Popen(
            [
                client_python,
                str(Path(__file__).resolve()),
                "--client",
                url,
                "--base-model",
                base_model,
                "--tenants",
                str(TENANTS),
            ],
            env=client_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._read()  # warm-up done

    def _read(self) -> dict[str, float]:
        assert self.client.stdout is not None
        line = self.client.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: the client process exited ({self.client.wait()})")
        return json.loads(line)

    def round(self) -> dict[str, float]:
        assert self.client.stdin is not None
        self.client.stdin.write("round\n")
        self.client.stdin.flush()
        return self._read()

    def close(self) -> None:
        for process in (self.client, self.server):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(20)
                except subprocess.TimeoutExpired:
                    process.kill()


def driver_main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.common import (
        add_device_option,
        add_dtype_option,
        bench_device,
        bench_dtype,
        report,
    )
    from lorafleet.model.presets import materialize
    from lorafleet.server.main import free_port

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skyrl-venv", type=Path, default=DEFAULT_SKYRL_VENV)
    parser.add_argument("--setup-skyrl", action="store_true", help="create --skyrl-venv first")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="lorafleet engine threads (1 is fastest for tiny models on shared CPUs)",
    )
    add_dtype_option(parser)
    add_device_option(parser)  # lorafleet's server; skyrl-tx runs on the CPU
    args = parser.parse_args()
    device = bench_device(args.device).device
    choice = bench_dtype(args.dtype, device)

    model_dir = str(materialize("tiny-qwen3"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LORAFLEET_API_KEYS": KEY}
    if args.setup_skyrl:
        setup_skyrl(args.skyrl_venv)
    sides: list[Side] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            port = free_port()
            sides.append(
                Side(
                    "lorafleet",
                    [
                        sys.executable,
                        "-m",
                        "lorafleet.cli",
                        "serve",
                        "--base-model",
                        model_dir,
                        "--port",
                        str(port),
                        "--data-dir",
                        f"{tmp}/lorafleet",
                        "--max-lora-rank",
                        str(RANK),
                        "--torch-threads",
                        str(args.torch_threads),
                        "--dtype",
                        choice.dtype,
                        "--device",
                        device,
                    ],
                    sys.executable,
                    env,
                    port,
                    model_dir,
                    120,
                )
            )
            skyrl_python = args.skyrl_venv / "bin" / "python"
            if skyrl_python.exists():
                shim_dir = Path(tmp) / "shim"
                shim_dir.mkdir()
                _uv_shim(shim_dir, skyrl_python)
                sky_model = str(
                    _skyrl_model_dir(Path(model_dir), Path(tmp) / "skyrl-model", choice.dtype)
                )
                port = free_port()
                sky_env = {
                    **env,
                    "JAX_PLATFORMS": "cpu",
                    "PATH": f"{shim_dir}:{env.get('PATH', '')}",
                }
                config = json.dumps({"max_lora_adapters": 8, "max_lora_rank": RANK})
                sides.append(
                    Side(
                        "skyrl_tx",
                        [
                            str(skyrl_python),
                            "-m",
                            "tx.tinker.api",
                            "--base-model",
                            sky_model,
                            "--backend",
                            "jax",
                            "--backend-config",
                            config,
                            "--checkpoints-base",
                            f"{tmp}/skyrl",
                            "--database-url",
                            f"sqlite:///{tmp}/skyrl.db",
                            "--host",
                            "127.0.0.1",
                            "--port",
                            str(port),
                        ],
                        str(skyrl_python),
                        sky_env,
                        port,
                        sky_model,
                        300,
                    )
                )
            else:
                print(
                    f"no skyrl-tx venv at {args.skyrl_venv} (pass --setup-skyrl): measuring lorafleet only"
                )
            results: dict[str, list[dict[str, float]]] = {side.name: [] for side in sides}
            for _ in range(args.repeats):
                for side in sides:
                    results[side.name].append(side.round())
        finally:
            for side in sides:
                side.close()

    timings: dict[str, dict[str, float]] = {}
    tokens: dict[str, float] = {}
    for name, rounds in results.items():
        for workload in ("fwdbwd_1", "fwdbwd_all", "sample_all", "loop_all"):
            values = sorted(r[workload] for r in rounds)
            timings[f"{name}:{workload}"] = {
                "min_s": values[0],
                "median_s": values[len(values) // 2],
                "runs": len(values),
            }
        tokens[name] = rounds[-1]["sample_all_tokens"]
    ratios: dict[str, tuple[float, str]] = {}
    if "skyrl_tx" in results:
        ratios["time_over_skyrl_tx"] = (
            timings["lorafleet:loop_all"]["min_s"] / timings["skyrl_tx:loop_all"]["min_s"],
            "<= 0.5",
        )
        for workload in ("fwdbwd_1", "fwdbwd_all"):
            ratio = (
                timings[f"skyrl_tx:{workload}"]["min_s"] / timings[f"lorafleet:{workload}"]["min_s"]
            )
            ratios[f"speedup_vs_skyrl:{workload}"] = (ratio, ">= 1 (lorafleet faster)")
        # tokens per second, in case one side still stopped some samples early
        rate = {
            name: tokens[name] / timings[f"{name}:sample_all"]["min_s"]
            for name in ("lorafleet", "skyrl_tx")
        }
        ratios["speedup_vs_skyrl:sample_all_tok_per_s"] = (
            rate["lorafleet"] / rate["skyrl_tx"],
            ">= 1 (lorafleet faster)",
        )
    report(
        f"Tinker API servers, tiny-qwen3 {choice.dtype}, {TENANTS} tenants, rank {RANK}: fwd+bwd {ROWS}x{TOKENS}, sample {SAMPLES}x{NEW_TOKENS}",
        timings,
        ratios,
        args.json,
        extra={"sampled_tokens_per_round": tokens, "tenants": TENANTS},
        dtype=choice,
    )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--client":
        cli = argparse.ArgumentParser()
        cli.add_argument("--client", required=True)
        cli.add_argument("--base-model", required=True)
        cli.add_argument("--tenants", type=int, default=TENANTS)
        client_args = cli.parse_args()
        client_main(client_args.client, client_args.base_model, client_args.tenants)
    else:
        driver_main()
