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
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

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
        # The device's own capability (not the current device's), and native only: torch's
        # is_bf16_supported() also says yes where bf16 is emulated (before Ampere, sm_80).
        name = torch.cuda.get_device_name(device)
        if torch.cuda.get_device_capability(device) >= (8, 0):
            return DtypeChoice("bfloat16", f"auto: {name} multiplies bf16 natively", auto=True)
        return DtypeChoice("float32", f"auto: {name} has no native bf16 (before sm_80)", auto=True)
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


# --------------------------------------------------------------------------- the device

DEVICE_HELP = "auto (the first CUDA device when there is one, else the CPU), cpu, cuda or cuda:N"
_DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


class DeviceUnavailableError(ValueError):
    """The device asked for is not on this machine (a user error: the commands exit 2 with
    its message, before loading or writing anything)."""


@dataclass(frozen=True)
class DeviceChoice:
    """Where the colocated engines run and what that device is: printed at start-up, written
    to config.json, to every benchmark's JSON and to the server's stats."""

    device: str  # "cpu" or "cuda:N": what torch.device() takes
    requested: str  # what was asked: auto, cpu, cuda or cuda:N
    name: str  # the GPU's name, or the CPU's model
    total_bytes: int | None  # the device's memory (the host's for the CPU)
    free_bytes: int | None  # free when it was chosen (MemAvailable for the CPU)
    reason: str

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def record(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line: `cuda:0 (NVIDIA H200, 139.7 GiB, 139.1 GiB free; auto: ...)`."""
        memory = ""
        if self.total_bytes is not None:
            memory = f", {self.total_bytes / 2**30:.1f} GiB"
            if self.free_bytes is not None:
                memory += f", {self.free_bytes / 2**30:.1f} GiB free"
        return f"{self.device} ({self.name}{memory}; {self.reason})"


class CudaProbe(Protocol):
    """What `resolve_device` asks torch about CUDA (a seam: tests describe any machine)."""

    def built_with_cuda(self) -> str | None: ...  # torch.version.cuda

    def device_count(self) -> int: ...

    def device_name(self, index: int) -> str: ...

    def memory(self, index: int) -> tuple[int, int]: ...  # (free, total) bytes


class TorchCuda:
    """The real `CudaProbe`. `device_count` does not create a CUDA context; `memory` does,
    on that device only (mem_get_info), once it has been chosen."""

    def built_with_cuda(self) -> str | None:
        return torch.version.cuda

    def device_count(self) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def device_name(self, index: int) -> str:
        return torch.cuda.get_device_name(index)

    def memory(self, index: int) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(index)
        return int(free), int(total)


def parse_device(value: str) -> str:
    """`value` as `auto`, `cpu`, `cuda` or `cuda:N`; ValueError naming `--device` otherwise."""
    text = value.strip().lower() if isinstance(value, str) else ""
    match = _DEVICE_PATTERN.match(text)
    if match is None or (match.group(1) != "cuda" and match.group(2) is not None):
        raise ValueError(f"--device {value!r} is not one of: {DEVICE_HELP}")
    return text


def host_memory() -> tuple[int | None, int | None]:
    """(available, total) bytes of host memory from /proc/meminfo; None where unreadable."""
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None, None
    return values.get("MemAvailable"), values.get("MemTotal")


def _found(cuda: CudaProbe) -> str:
    """What this machine has, for the refusal message."""
    built = cuda.built_with_cuda()
    if built is None:
        return f"this torch ({torch.__version__}) is a CPU-only build, without CUDA"
    count = cuda.device_count()
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        return f"torch {torch.__version__} (CUDA {built}) sees no CUDA device{hint}"
    names = ", ".join(f"cuda:{i} {cuda.device_name(i)}" for i in range(count))
    return f"{count} CUDA device(s): {names}"


def resolve_device(value: str, *, cuda: CudaProbe | None = None) -> DeviceChoice:
    """`--device` resolved on this machine: `auto` is cuda:0 when torch sees a CUDA device,
    else the CPU; `cuda` is cuda:0. Raises DeviceUnavailableError naming what was found when
    a CUDA device is asked for and absent. Touches no model: callers resolve the device first,
    so that a refusal comes before anything is loaded or written."""
    requested = parse_device(value)
    cuda = cuda or TorchCuda()
    count = cuda.device_count() if requested != "cpu" else 0
    if requested == "cpu" or (requested == "auto" and count == 0):
        available, total = host_memory()
        reason = "given explicitly" if requested == "cpu" else "auto: no CUDA device"
        return DeviceChoice("cpu", requested, cpu_info().model, total, available, reason)
    index = int(requested.partition(":")[2] or 0)
    if index >= count:
        raise DeviceUnavailableError(
            f"--device {requested}: no such CUDA device here; found {_found(cuda)}"
        )
    free, total = cuda.memory(index)
    reason = "auto: the first CUDA device" if requested == "auto" else "given explicitly"
    return DeviceChoice(f"cuda:{index}", requested, cuda.device_name(index), total, free, reason)
