"""tinker-cookbook's multi-turn recipe (`multiplayer_rl.guess_number`), unmodified, against a
`lorafleet serve` started for the run (issue 24).

The recipe is what users run; its own metrics are the measurement. This script starts the
server as a subprocess (free port, a temp data dir, one key), runs the recipe as a subprocess
with the issue's settings pointed at it through the SDK's environment (`TINKER_BASE_URL`,
`TINKER_API_KEY`), waits for it, then reads the recipe's `metrics.jsonl` (per step:
`time/sampling`, `time/train_step`, `time/total`, rewards, turns, tokens) and the server's
`/api/v1/lorafleet/stats` (prefix-cache counters among them, where the server keeps them).

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.cookbook_multiturn --json bench/results/cookbook_multiturn.json

The issue's run: SmolLM2's model directory, fp32, `renderer_name=role_colon group_size=4
batch_size=4 max_tokens=16 max_steps=2` (the defaults here). There is no side-by-side
comparison inside one run: the baseline is the issue's measurement of the same recipe.
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
from typing import Any

import httpx

from bench.common import (
    add_device_option,
    bench_device,
    environment,
    fixed_dtype,
    wait_healthy,
)

RECIPE = "tinker_cookbook.recipes.multiplayer_rl.guess_number.train"
# The project installs the cookbook with --no-deps (it pins transformers<=5.5.4), so the recipe
# runs in an overlay venv: the project's site-packages (torch, tinker, transformers, the cookbook)
# through a .pth file, plus the recipe's own imports pinned here, installed without resolution
# so nothing else changes. Built once, like the vLLM venv (scripts/setup_vllm.sh).
RECIPE_VENV = Path.home() / ".cache" / "lorafleet-peers" / "cookbook-0.5.8"
RECIPE_DEPS = (
    "chz==0.4.0",
    "termcolor==3.3.0",
    "tml-renderers==0.2.1",
    "blobfile==3.3.0",
    "lxml==6.1.3",
    "pycryptodomex==3.24.2",
    "cloudpickle==3.1.3",
    "tiktoken==0.14.0",
    "datasets==5.2.0",
    "dill==0.4.1",
    "multiprocess==0.70.19",
    "pandas==3.1.1",
    "pyarrow==26.0.1",
    "xxhash==4.1.0",
    "aiohttp==3.14.5",
    "aiohappyeyeballs==2.7.1",
    "aiosignal==1.4.0",
    "frozenlist==1.8.0",
    "multidict==7.2.1",
    "propcache==0.5.4",
    "yarl==1.25.1",
)
KEY = "tml-cookbook-bench-key-0123456"
# Per-step metrics shown in the table (all of them go to the JSON).
SHOWN = (
    "time/sampling",
    "time/train_step",
    "time/total",
    "time/run_evals",
    "time/policy_sample:mean",
    "time/policy_sample:max",
    "env/all/reward/total",
    "env/all/total_episodes",
    "env/all/total_turns",
    "env/all/turns_per_episode",
    "env/all/total_ob_tokens",
    "env/all/total_ac_tokens",
    "env/all/ob_tokens_per_turn",
    "env/all/ac_tokens_per_turn",
)
# The measurement of step 0 before the prefix cache and nested-prefix training.
BASELINE = {"time/sampling": 270.0, "time/train_step": 341.0, "time/total": 612.0}


def _extra(value: str) -> tuple[str, str]:
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--extra takes KEY=VALUE, got {value!r}")
    return key, val


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument(
        "--base-model",
        default="smollm2-135m",
        help="preset or local HF dir; the recipe gets its directory as model_name (default: %(default)s)",
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    add_device_option(parser)
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--renderer", default="role_colon")
    parser.add_argument(
        "--timeout-s", type=float, default=3600.0, help="for the recipe (default: %(default)s)"
    )
    parser.add_argument(
        "--extra",
        type=_extra,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another recipe option (chz syntax), repeatable",
    )
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra `lorafleet serve` argument, repeatable (e.g. --serve-arg=--torch-threads=2)",
    )
    parser.add_argument(
        "--recipe-deps",
        type=Path,
        default=None,
        help="a `pip install --target` directory holding the recipe's own imports (RECIPE_DEPS): "
        "the recipe then runs with this python and that directory on PYTHONPATH instead of the "
        "overlay venv",
    )
    args = parser.parse_args(argv)
    if args.recipe_deps is not None and not args.recipe_deps.is_dir():
        parser.error(f"--recipe-deps must be a directory, got {str(args.recipe_deps)!r}")
    for name in ("max_steps", "group_size", "batch_size", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.timeout_s <= 0:
        parser.error(f"--timeout-s must be > 0, got {args.timeout_s}")
    return args


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def recipe_python(venv: Path = RECIPE_VENV) -> Path:
    """The overlay venv's python, built on first use (in a temp dir, renamed into place)."""
    python = venv / "bin" / "python"
    if python.exists():
        return python
    import site
    import venv as venv_module

    venv.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{venv.name}.", dir=venv.parent))
    try:
        venv_module.create(tmp, with_pip=True, symlinks=True)
        main_site = site.getsitepackages()[0]
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        (tmp / "lib" / version / "site-packages" / "lorafleet-main.pth").write_text(
            main_site + "\n"
        )
        pip = [str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps"]
        subprocess.run([*pip, *RECIPE_DEPS], check=True)
        subprocess.run([str(tmp / "bin" / "python"), "-c", f"import {RECIPE}"], check=True)
        # Only `bin/python -m ...` is used: it finds pyvenv.cfg next to it after the rename.
        os.rename(tmp, venv)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return python


def read_metrics(log_path: Path) -> list[dict[str, Any]]:
    """The recipe's metrics.jsonl, one record per logged step (train steps carry `time/total`)."""
    path = log_path / "metrics.jsonl"
    if not path.is_file():
        raise RuntimeError(f"the recipe wrote no {path}")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if "time/total" in r]


def recipe_command(args: argparse.Namespace, model_dir: Path, log_path: Path) -> list[str]:
    options = {
        "model_name": str(model_dir),
        "renderer_name": args.renderer,
        "group_size": str(args.group_size),
        "batch_size": str(args.batch_size),
        "max_tokens": str(args.max_tokens),
        "max_steps": str(args.max_steps),
        "log_path": str(log_path),
        "behavior_if_log_dir_exists": "raise",
    }
    options.update(dict(args.extra))
    python = sys.executable if args.recipe_deps is not None else str(recipe_python())
    return [python, "-m", RECIPE, *(f"{k}={v}" for k, v in options.items())]


def recipe_env(args: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    """The recipe's environment: with `--recipe-deps`, that directory first on PYTHONPATH."""
    if args.recipe_deps is None:
        return env
    path = [str(args.recipe_deps.resolve()), env.get("PYTHONPATH", "")]
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lorafleet.model.loader import resolve_base
    from lorafleet.server.main import free_port

    dtype = fixed_dtype(
        args.dtype, "the issue's setting (fp32)" if args.dtype == "float32" else "--dtype"
    )
    _model_id, model_dir = resolve_base(args.base_model)
    work = Path(tempfile.mkdtemp(prefix="cookbook-multiturn-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LORAFLEET_API_KEYS": KEY}
    serve_cmd = [
        sys.executable,
        "-m",
        "lorafleet.cli",
        "serve",
        "--base-model",
        str(model_dir),
        "--port",
        str(port),
        "--data-dir",
        str(work / "data"),
        "--dtype",
        args.dtype,
        "--device",
        bench_device(args.device).device,
        *args.serve_arg,
    ]
    serve_log = work / "serve.log"
    recipe_log = work / "recipe.log"
    log_path = work / "recipe"
    cmd = recipe_command(args, model_dir, log_path)
    print("serve: " + " ".join(serve_cmd), flush=True)
    print("recipe: " + " ".join(cmd), flush=True)
    with serve_log.open("wb") as serve_out:
        server = subprocess.Popen(serve_cmd, stdout=serve_out, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(url, server, 600, details=lambda: _tail(serve_log))
            env_of_recipe = recipe_env(args, {**env, "TINKER_BASE_URL": url, "TINKER_API_KEY": KEY})
            start = time.perf_counter()
            with recipe_log.open("wb") as recipe_out:
                try:
                    done = subprocess.run(
                        cmd,
                        stdout=recipe_out,
                        stderr=subprocess.STDOUT,
                        env=env_of_recipe,
                        timeout=args.timeout_s,
                    )
                except subprocess.TimeoutExpired:
                    raise RuntimeError(
                        f"the recipe did not finish in {args.timeout_s:.0f} s; its log:\n{_tail(recipe_log)}"
                    ) from None
            wall_s = time.perf_counter() - start
            if done.returncode != 0:
                raise RuntimeError(
                    f"the recipe exited with {done.returncode}; its log ({recipe_log}):\n{_tail(recipe_log)}"
                    f"\nserver log ({serve_log}):\n{_tail(serve_log, 15)}"
                )
            stats = httpx.get(
                f"{url}/api/v1/lorafleet/stats", headers={"X-API-Key": KEY}, timeout=30
            ).json()
        finally:
            _stop(server)
    steps = read_metrics(log_path)
    if len(steps) != args.max_steps:
        raise RuntimeError(
            f"the recipe logged {len(steps)} train steps, expected {args.max_steps} ({log_path})"
        )
    return {
        "benchmark": "cookbook guess_number (tinker-cookbook 0.5.8, unmodified) on lorafleet serve",
        "settings": {
            "model_dir": str(model_dir),
            "dtype": args.dtype,
            "renderer_name": args.renderer,
            "group_size": args.group_size,
            "batch_size": args.batch_size,
            "max_tokens": args.max_tokens,
            "max_steps": args.max_steps,
            "extra": dict(args.extra),
            "serve_args": list(args.serve_arg),
            "recipe_deps": None if args.recipe_deps is None else str(args.recipe_deps),
        },
        "commands": {"serve": serve_cmd, "recipe": cmd},
        "recipe_wall_s": wall_s,
        "steps": steps,
        "baseline_step0": BASELINE,
        "server_stats": stats,
        "work_dir": str(work),
        "environment": environment(dtype),
    }


def print_table(result: dict[str, Any]) -> None:
    steps = result["steps"]
    print(f"\n{result['benchmark']}")
    print(
        f"{'metric':<30}"
        + "".join(f"{'step ' + str(s.get('step', i)):>14}" for i, s in enumerate(steps))
        + f"{'issue step 0':>14}"
    )
    for name in SHOWN:
        row = "".join(
            f"{s[name]:>14.3f}" if isinstance(s.get(name), int | float) else f"{'-':>14}"
            for s in steps
        )
        base = BASELINE.get(name)
        print(f"{name:<30}{row}{base if base is not None else '-':>14}")
    cache = result["server_stats"].get("prefix_cache")
    print(
        f"\nrecipe wall time {result['recipe_wall_s']:.1f} s; server prefix_cache: {cache if cache is not None else 'not reported'}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print_table(result)
    if args.json is not None:
        from lorafleet.fsio import atomic_write_bytes, ensure_private_dir

        ensure_private_dir(args.json.parent)
        atomic_write_bytes(args.json, (json.dumps(result, indent=2) + "\n").encode())
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
