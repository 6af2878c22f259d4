"""Shared timing helpers: sides run interleaved (A B A B ...), each reported by its minimum.

The machines are shared and noisy, so benchmarks compare sides measured in the same run and
report ratios; nothing here asserts a time.

A ratio means little without the machine it came from: whether the CPU multiplies bf16
natively decides most of a run's speed (lorafleet/hardware.py). So every bench takes
`--dtype` (default `auto`, the same choice `lorafleet serve` / `rl` / `sft` make), prints the
resolved dtype and its reason at start-up, and every JSON records where it ran
(`environment()`), the dtype choice included.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from lorafleet.fsio import atomic_write_bytes
from lorafleet.hardware import (
    DEVICE_HELP,
    DeviceChoice,
    DtypeChoice,
    cpu_info,
    dtype_name,
    parse_device,
    resolve_device,
    resolve_dtype,
)
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.numerics import NumericsName

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _dtype_value(value: str) -> str:
    try:
        return dtype_name(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_dtype_option(parser: argparse.ArgumentParser, default: str = "auto") -> None:
    """`--dtype` for benches that build their own parser: the base model's dtype on every side
    of the comparison, `auto` by default so a bench measures what the commands run here."""
    parser.add_argument(
        "--dtype",
        type=_dtype_value,
        default=_dtype_value(default),
        help="base model dtype on every side: auto (bf16 where the hardware multiplies bf16 "
        "natively, else fp32; lorafleet/hardware.py), float32 or bfloat16 (default: %(default)s)",
    )


def _device_value(value: str) -> str:
    try:
        return parse_device(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_device_option(parser: argparse.ArgumentParser, default: str = "cpu") -> None:
    """`--device` for benches that build their own parser: where our engines run. The default
    is the CPU, where the figures in docs/performance.md were measured and where the peers some
    benches compare against (vLLM's CPU build, TRL, skyrl-tx) run; `auto` or `cuda[:N]` moves
    our side (and the peers that can follow it) to a GPU."""
    parser.add_argument(
        "--device",
        type=_device_value,
        default=_device_value(default),
        help=f"where our engines run: {DEVICE_HELP} (default: %(default)s)",
    )


def add_numerics_option(parser: argparse.ArgumentParser) -> None:
    """`--numerics` for benches that run our engines: batch-invariant (the commands' default)
    or fast (model/numerics.py); `bench_numerics` resolves it and `environment` records it."""
    from lorafleet.model.numerics import DEFAULT_NUMERICS, NUMERICS

    parser.add_argument(
        "--numerics",
        choices=NUMERICS,
        default=DEFAULT_NUMERICS,
        help="our engines' numerics: batch-invariant or fast (default: %(default)s)",
    )


def bench_numerics(value: str) -> NumericsName:
    """`--numerics` checked, printed and kept for `environment` (every JSON records it)."""
    global _NUMERICS
    from lorafleet.model.numerics import parse_numerics

    _NUMERICS = parse_numerics(value)
    print(f"numerics: {_NUMERICS}", flush=True)
    return _NUMERICS


_NUMERICS: str | None = None  # the bench's numerics once resolved (bench_numerics)


def bench_device(value: str) -> DeviceChoice:
    """`--device` resolved (a missing CUDA device is refused, naming what was found), printed
    with the device's name and memory, and kept for `environment` (every JSON records it)."""
    global _DEVICE
    _DEVICE = resolve_device(_device_value(value))
    print(f"device: {_DEVICE.describe()}", flush=True)
    return _DEVICE


_DEVICE: DeviceChoice | None = None  # the bench's device once resolved (bench_device)


def parse_args(
    description: str,
    *,
    with_dtype: bool = True,
    with_device: bool = True,
    with_numerics: bool = False,
    **extra: tuple[type, object, str],
) -> argparse.Namespace:
    """The common options (`--json`, `--repeats`, `--dtype` unless `with_dtype=False`, for the
    benches whose dtype is fixed by what they compare, `--device` unless `with_device=False`,
    for those that run on the CPU only) plus the bench's own `extra` ones."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed rounds per side (min is reported)"
    )
    if with_dtype:
        add_dtype_option(parser)
    if with_device:
        add_device_option(parser)
    if with_numerics:
        add_numerics_option(parser)
    for name, (kind, default, help_text) in extra.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=default, help=help_text
        )
    return parser.parse_args()


def bench_dtype(value: str, device: str | torch.device = "cpu") -> DtypeChoice:
    """`--dtype` resolved on `device` (`auto`: the machine's choice, probed once), printed with
    its reason at start-up so a reader of the log knows what the numbers were measured in."""
    choice = resolve_dtype(_dtype_value(value), device)
    print(f"dtype: {choice.dtype} ({choice.reason})", flush=True)
    return choice


def fixed_dtype(dtype: str, reason: str) -> DtypeChoice:
    """For a bench whose dtype is part of what it compares (no `--dtype`): recorded and
    printed like a resolved one, with the reason it is fixed."""
    choice = DtypeChoice(_dtype_value(dtype), reason, auto=False)
    print(f"dtype: {choice.dtype} ({choice.reason})", flush=True)
    return choice


def torch_dtype(choice: DtypeChoice) -> torch.dtype:
    return TORCH_DTYPES[_dtype_value(choice.dtype)]


def interleaved(
    sides: Mapping[str, Callable[[], object]], repeats: int, warmup: int = 1
) -> dict[str, dict[str, float]]:
    """Runs every side once per round, round after round; returns min/median seconds per side."""
    for _ in range(warmup):
        for fn in sides.values():
            fn()
            _synchronize()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn()
            _synchronize()  # a side on a GPU has finished only when its kernels have
            times[name].append(time.perf_counter() - start)
    out = {}
    for name, values in times.items():
        ordered = sorted(values)
        out[name] = {
            "min_s": ordered[0],
            "median_s": ordered[len(ordered) // 2],
            "runs": len(values),
        }
    return out


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _native_path() -> str:
    from lorafleet.model import native

    try:
        return native.path_name()
    except Exception as exc:  # noqa: BLE001 - the record must not cost a finished run
        return f"unknown ({type(exc).__name__}: {exc})"


def environment(dtype: DtypeChoice | None = None) -> dict[str, object]:
    """Where a bench ran: the CPU and what this process may use of it (the ATen / oneDNN caps
    lower it), the threads, the native LoRA kernel path, the device our engines ran on (its
    name and memory; the CPU when the bench took no `--device`), the CUDA device, and the
    dtype choice with its reason. Read at the end of a run, so the thread count is the one it
    ran with."""
    info = cpu_info()
    cuda = torch.cuda.is_available()
    device = _DEVICE if _DEVICE is not None else resolve_device("cpu")
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = os.cpu_count()
    return {
        "cpu_model": info.model,
        "cpu_class": info.cpu_class,
        "hardware_class": info.hardware_class,
        "aten_capability": info.aten_capability,
        "onednn_max_cpu_isa": info.onednn_cap,
        "native_path": _native_path(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "cpus_allowed": allowed,
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cuda_device": torch.cuda.get_device_name() if cuda else None,
        "cuda_version": torch.version.cuda if cuda else None,
        "device": device.record(),
        "dtype": dtype.record() if dtype is not None else None,
        "numerics": _NUMERICS,
    }


def report(
    title: str,
    timings: Mapping[str, Mapping[str, float]],
    ratios: Mapping[str, tuple[float, str]],
    json_path: Path | None,
    extra: Mapping[str, object] | None = None,
    *,
    dtype: DtypeChoice,
) -> dict[str, object]:
    """Prints a table of sides and ratios (with their targets) and writes the JSON.

    `dtype` is required so that no result is written without the dtype it was measured in and
    why (it lands in `environment.dtype`, next to the machine it ran on)."""
    print(f"\n{title}")
    where = _DEVICE.device if _DEVICE is not None else "cpu"
    print(f"device {where}; dtype {dtype.dtype} ({dtype.reason}); native kernels {_native_path()}")
    print(f"{'side':<34}{'min ms':>12}{'median ms':>12}")
    for name, t in timings.items():
        print(f"{name:<34}{t['min_s'] * 1e3:>12.2f}{t['median_s'] * 1e3:>12.2f}")
    print(f"\n{'ratio':<34}{'value':>12}  target")
    for name, (value, target) in ratios.items():
        print(f"{name:<34}{value:>12.3f}  {target}")
    result: dict[str, object] = {
        "benchmark": title,
        "timings": dict(timings),
        **{name: value for name, (value, _) in ratios.items()},
        "targets": {name: target for name, (_, target) in ratios.items()},
        "environment": environment(dtype),
        **(dict(extra) if extra else {}),
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        # Atomic (a reader never sees half a result); NaN stays allowed, as before.
        atomic_write_bytes(json_path, (json.dumps(result, indent=2) + "\n").encode())
        print(f"\nwrote {json_path}")
    return result


def wait_healthy(
    url: str,
    process: subprocess.Popen,
    timeout_s: float,
    *,
    what: str = "lorafleet serve",
    details: Callable[[], str] = lambda: "",
    poll_s: float = 0.25,
) -> None:
    """Waits until the server `process` started answers `/api/v1/healthz` with 200; raises,
    with `details()` (e.g. its log's tail), if it exits first or is not ready in time."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(
                f"{what} exited with {process.returncode} before it was ready\n{details()}"
            )
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} at {url} not ready after {timeout_s:.0f} s\n{details()}")
        time.sleep(poll_s)


def smollm2_shaped_config(**overrides):
    """SmolLM2-135M's architecture with random weights: timing needs the shapes, not the values."""
    from transformers import LlamaConfig

    values = dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def make_prompts(count: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """Random-token prompts with lengths spread around prompt_len (so rows really sit at
    different lengths); the same for every side of a benchmark."""
    gen = torch.Generator().manual_seed(0)
    lengths = [max(4, prompt_len - 8 + (7 * i) % 17) for i in range(count)]
    return [torch.randint(100, vocab, (n,), generator=gen).tolist() for n in lengths]


def publish_random_adapters(stack, count: int, rank: int) -> tuple[list, list[int]]:
    """`count` adapters of rank `rank` (alpha 2 * rank) in the trainer of a colocated `stack`,
    each with a random non-zero B (a fresh LoRA has B = 0 and equals the base), published to
    its sampler. Returns the version keys and the trainer slots."""
    keys, slots = [], []
    for i in range(count):
        slot = stack.trainer.create_adapter(AdapterSpec(rank=rank, alpha=2.0 * rank, seed=i))
        gen = torch.Generator().manual_seed(1000 + i)
        weights = {
            path: (A, 0.02 * torch.randn(B.shape, generator=gen))
            for path, (A, B) in stack.trainer.bank.slot_weights(slot).items()
        }
        stack.trainer.bank.load_slot_weights(slot, weights)
        keys.append(stack.versions.publish(f"adapter-{i}", stack.trainer.bank, slot))
        slots.append(slot)
    return keys, slots


def peft_generate_per_adapter(
    peft_model,
    prompts: list[list[int]],
    owner: list[int],
    new_tokens: int,
    pad_id: int,
    device: torch.device | str = "cpu",
) -> list[list[int]]:
    """The PEFT baseline: for each adapter `a{k}` in turn, `set_adapter` and one batched,
    left-padded greedy `generate` over its prompts (owner[i] is prompt i's adapter). Returns
    exactly `new_tokens` tokens per prompt, in prompt order."""
    tokens: dict[int, list[int]] = {}
    for adapter in sorted(set(owner)):
        rows = [i for i in range(len(prompts)) if owner[i] == adapter]
        longest = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), longest), pad_id, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(rows):  # left padding, as generate expects
            ids[r, longest - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, longest - len(prompts[i]) :] = 1
        peft_model.set_adapter(f"a{adapter}")
        with torch.no_grad():
            out = peft_model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        for r, i in enumerate(rows):
            tokens[i] = out[r, longest:].tolist()
    return [tokens[i] for i in range(len(prompts))]
