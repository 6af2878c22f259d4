"""What this machine multiplies fast, read once: the CPU's class and the base model's dtype.

The base model's dtype decides most of a CPU run's speed. Where the CPU has bf16 instructions
(AVX512_BF16, AMX) a bf16 matmul runs several times faster than fp32; where it has not, oneDNN
emulates bf16 at a small fraction of fp32's speed. So `--dtype auto` (the default of every
command and benchmark) picks bf16 only where the hardware multiplies it natively, and confirms
that with a short probe, because flags can lie: `ATEN_CPU_CAPABILITY` / `ONEDNN_MAX_CPU_ISA`
or a VM may hide the instructions the flags advertise.

The CPU class is also what the native LoRA kernels build for (`model/native.py`) and what
every benchmark records, so that a number always says where it was measured.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

# CPU classes, weakest first. Each implies the ones before it.
CPU_CLASSES = ("DEFAULT", "AVX2", "AVX512", "AVX512_BF16", "AMX")
# What oneDNN's ISA cap lets it use (ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA), as a CPU class.
_ONEDNN_CAPS = {
    "SSE41": "DEFAULT",
    "AVX": "DEFAULT",
    "AVX2": "AVX2",
    "AVX2_VNNI": "AVX2",
    "AVX2_VNNI_2": "AVX2",
    "AVX512_CORE": "AVX512",
    "AVX512_CORE_VNNI": "AVX512",
    "AVX512_CORE_BF16": "AVX512_BF16",
    "AVX512_CORE_FP16": "AVX512_BF16",
    "AVX10_1_512": "AVX512_BF16",
    "AVX512_CORE_AMX": "AMX",
    "AVX10_1_512_AMX": "AMX",
    "AVX512_CORE_AMX_FP16": "AMX",
    "AVX10_1_512_AMX_FP16": "AMX",
    "DEFAULT": "AMX",
    "ALL": "AMX",
}
# torch.backends.cpu.get_cpu_capability() (which ATEN_CPU_CAPABILITY lowers) as a CPU class.
_ATEN_CAPS = {"DEFAULT": "DEFAULT", "NO AVX": "DEFAULT", "AVX2": "AVX2", "AVX512": "AMX"}
# The probe's verdict: bf16 counts as native when its matmul runs at least this fraction of
# fp32's speed (time ratio fp32/bf16). Native bf16 runs at or above fp32's speed, emulated bf16
# at a few percent of it; the probe's small matmul is overhead-bound and a loaded machine
# makes it noisy, so the threshold sits far from both rather than at 1.
MIN_BF16_SPEEDUP = 0.25
PROBE_BUDGET_S = 0.05


@dataclass(frozen=True)
class CpuInfo:
    model: str  # /proc/cpuinfo "model name", or platform.processor()
    arch: str  # platform.machine()
    flags: frozenset[str]
    hardware_class: str  # from the flags alone: one of CPU_CLASSES
    cpu_class: str  # what this process may use: the flags capped by ATEN/oneDNN settings
    aten_capability: str  # torch.backends.cpu.get_cpu_capability()
    onednn_cap: str | None  # ONEDNN_MAX_CPU_ISA, when set

    def has(self, cpu_class: str) -> bool:
        return CPU_CLASSES.index(self.cpu_class) >= CPU_CLASSES.index(cpu_class)


def _read_cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return model or platform.processor() or "unknown", flags


def hardware_class(flags: frozenset[str], arch: str) -> str:
    """The strongest CPU class whose instructions the flags list (x86 only; others: DEFAULT)."""
    if arch not in ("x86_64", "AMD64", "i686", "x86"):
        return "DEFAULT"
    if not {"avx2", "fma"} <= flags:
        return "DEFAULT"
    if not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "AVX2"
    if "amx_bf16" in flags and "amx_tile" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX512_BF16"
    return "AVX512"


def _weakest(*classes: str) -> str:
    return min(classes, key=CPU_CLASSES.index)


def cpu_info_from(
    model: str, arch: str, flags: frozenset[str], aten_capability: str, onednn_cap: str | None
) -> CpuInfo:
    """The pure part of `cpu_info`, separate so tests can describe any machine."""
    from_flags = hardware_class(flags, arch)
    caps = [from_flags, _ATEN_CAPS.get(aten_capability.upper(), "DEFAULT")]
    if onednn_cap:
        caps.append(_ONEDNN_CAPS.get(onednn_cap.strip().upper(), "DEFAULT"))
    return CpuInfo(
        model=model,
        arch=arch,
        flags=flags,
        hardware_class=from_flags,
        cpu_class=_weakest(*caps),
        aten_capability=aten_capability,
        onednn_cap=onednn_cap,
    )


@functools.cache
def cpu_info() -> CpuInfo:
    model, flags = _read_cpuinfo()
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return cpu_info_from(
        model, platform.machine(), flags, torch.backends.cpu.get_cpu_capability(), onednn
    )


@dataclass(frozen=True)
class DtypeChoice:
    """The base model's dtype and why: printed at start-up, written to config.json and to
    every benchmark's JSON."""

    dtype: str  # "float32" or "bfloat16"
    reason: str
    auto: bool  # picked by `auto` (False: given explicitly)
    bf16_speedup: float | None = None  # the probe's fp32/bf16 time ratio, when it ran

    def record(self) -> dict[str, Any]:
        return asdict(self)


def probe_bf16_speedup(budget_s: float = PROBE_BUDGET_S) -> float:
    """fp32 time / bf16 time of the same small matmul, best of as many rounds as fit the
    budget (at least one). The shape is small enough that one emulated bf16 round stays well
    inside the budget, and large enough that oneDNN takes its real (not reference) kernels."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(128, 256, generator=generator)
    b = torch.randn(256, 128, generator=generator)
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    best = {torch.float32: float("inf"), torch.bfloat16: float("inf")}
    deadline = time.perf_counter() + budget_s  # the warm-up calls count against it too
    with torch.inference_mode():
        torch.mm(a16, b16)  # first call: oneDNN picks and JITs its kernel
        torch.mm(a, b)
        while True:
            for dtype, (x, y) in ((torch.bfloat16, (a16, b16)), (torch.float32, (a, b))):
                start = time.perf_counter()
                torch.mm(x, y)
                best[dtype] = min(best[dtype], time.perf_counter() - start)
            if time.perf_counter() >= deadline:
                break
    return best[torch.float32] / max(best[torch.bfloat16], 1e-9)


def choose_dtype(
    device: str | torch.device = "cpu",
    *,
    info: CpuInfo | None = None,
    probe: Callable[[], float] = probe_bf16_speedup,
) -> DtypeChoice:
    """What `--dtype auto` means on `device`: bf16 where the hardware multiplies bf16 natively
    (CUDA devices with bf16; x86 CPUs with AVX512_BF16 or AMX, confirmed by the probe), fp32
    everywhere else."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            name = torch.cuda.get_device_name(device)
            return DtypeChoice("bfloat16", f"auto: {name} multiplies bf16 natively", auto=True)
        return DtypeChoice("float32", "auto: this CUDA device has no native bf16", auto=True)
    if device.type != "cpu":
        return DtypeChoice("float32", f"auto: no bf16 rule for {device.type} devices", auto=True)
    info = info or cpu_info()
    if not info.has("AVX512_BF16"):
        limited = (
            f" (the CPU has {info.hardware_class}, this process may use {info.cpu_class})"
            if info.cpu_class != info.hardware_class
            else ""
        )
        return DtypeChoice(
            "float32",
            f"auto: CPU class {info.cpu_class}{limited} has no native bf16 matmul",
            auto=True,
        )
    speedup = probe()
    if speedup < MIN_BF16_SPEEDUP:  # the flags promised bf16, but it runs emulated here
        return DtypeChoice(
            "float32",
            f"auto: CPU class {info.cpu_class}, but a bf16 matmul probe ran {1 / speedup:.1f}x "
            "slower than fp32",
            auto=True,
            bf16_speedup=speedup,
        )
    return DtypeChoice(
        "bfloat16",
        f"auto: CPU class {info.cpu_class}, bf16 matmul probe {speedup:.1f}x fp32",
        auto=True,
        bf16_speedup=speedup,
    )


@functools.cache
def _auto_dtype(device: str) -> DtypeChoice:
    return choose_dtype(device)


# What `--dtype` accepts everywhere (CLI, benches), each to the name loaders and peers take.
DTYPE_NAMES = {
    "auto": "auto",
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def dtype_name(value: str) -> str:
    """`value` spelled out (`bf16` -> `bfloat16`); ValueError naming `--dtype` otherwise."""
    name = DTYPE_NAMES.get(value.strip().lower())
    if name is None:
        raise ValueError(f"--dtype {value!r} is not one of: {', '.join(DTYPE_NAMES)}")
    return name


def resolve_dtype(value: str | torch.dtype, device: str | torch.device = "cpu") -> DtypeChoice:
    """`auto` -> the machine's choice (probed once per process and device); an explicit dtype
    wins as given, its short names spelled out (the loader validates what it supports)."""
    if isinstance(value, torch.dtype):
        name = str(value).removeprefix("torch.")
        return DtypeChoice(name, "given explicitly", auto=False)
    name = dtype_name(value)
    if name == "auto":
        return _auto_dtype(str(torch.device(device)))
    return DtypeChoice(name, "given explicitly", auto=False)
