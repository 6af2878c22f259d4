"""Builds and loads the CPU LoRA kernels of `lora_cpu.c` (used by kernels.py when no autograd
is needed).

The source is compiled on first use with the system C compiler (`$CC`, else `cc`) into the
private lorafleet cache, for one instruction-set path chosen at run time: `avx512`, `avx2`
(AVX2 + FMA) or `generic` on x86, `native` elsewhere. The path is the strongest one the CPU
has and this process may use (`hardware.cpu_info().cpu_class`, which `ATEN_CPU_CAPABILITY`
and `ONEDNN_MAX_CPU_ISA` lower), or the one `LORAFLEET_NATIVE_ISA` names. Every path gives the
same bits: each multiply-add is an explicit FMA (or `fmaf`) and the build forbids contraction.
The library's name hashes the source, the flags, the compiler and the CPU, so a shared home
directory never hands one machine's build to another. It is loaded with ctypes: no Python
headers, no torch extension toolchain, and a build takes well under a second.

Threads: where torch runs on GNU OpenMP (libgomp, as its Linux wheels do), the library is built
with -fopenmp and so links the same runtime; each call then spreads its work over
`torch.get_num_threads()` threads of torch's own pool, never a second pool competing for the
cores. Elsewhere, or if that build fails, a serial build is used.

A machine without a C compiler still runs everything: `status()` says why the kernels are
off, a warning is logged once, and kernels.py keeps to its torch implementation (same values
to fp32 rounding). `LORAFLEET_NATIVE_KERNELS=0` turns them off on purpose.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from _ctypes import CFuncPtr
from dataclasses import dataclass
from pathlib import Path

import torch

from lorafleet.hardware import cpu_info
from lorafleet.model.presets import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("lora_cpu.c")
ABI_VERSION = 4  # lf_abi_version() of the source this module speaks to
FLAGS = (
    "-O3",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-std=gnu11",
    "-shared",
    "-fPIC",
)
OPENMP_FLAGS = ("-fopenmp",)
ENV_SWITCH = "LORAFLEET_NATIVE_KERNELS"
ENV_ISA = "LORAFLEET_NATIVE_ISA"
# Instruction-set paths, strongest first, with the CPU class each needs and its -march.
# x86-64-v4 is AVX-512 F/BW/CD/DQ/VL; x86-64-v3 is AVX2 + FMA (+ BMI, F16C).
ISA_PATHS: dict[str, tuple[str, tuple[str, ...]]] = {
    "avx512": ("AVX512", ("-march=x86-64-v4", "-mtune=native")),
    "avx2": ("AVX2", ("-march=x86-64-v3", "-mtune=native")),
    "generic": ("DEFAULT", ("-march=x86-64", "-mtune=generic")),
}
NATIVE_PATH = ("native", ("-march=native",))  # non-x86: the compiler's own idea of this CPU
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_ptr = ctypes.c_void_p
_i64 = ctypes.c_int64
_i32 = ctypes.c_int32


class NativeKernelError(RuntimeError):
    """The native kernels were asked for but cannot run here."""


class LayerPlan(ctypes.Structure):
    """One adapted layer's bank as `lf_lora_add` reads it (lf_layer in lora_cpu.c): raw
    pointers into the bank's storage, which never moves, plus its strides and sizes. Built
    once per layer and bank (`layer_plan`), so a decode step passes one pointer per layer."""

    _fields_ = [
        ("A", ctypes.c_void_p),
        ("a_slot_stride", ctypes.c_int64),
        ("R", ctypes.c_int64),
        ("in_features", ctypes.c_int64),
        ("B", ctypes.c_void_p),
        ("b_slot_stride", ctypes.c_int64),
        ("b_rank_stride", ctypes.c_int64),
        ("out_features", ctypes.c_int64),
        ("b_row_rest", ctypes.c_int64),
    ]


class RoutingPlan(ctypes.Structure):
    """One forward's routing as `lf_lora_add` reads it (lf_routing in lora_cpu.c). It points
    into the routing's own tensors, so it must live no longer than that routing (see
    `routing.Routing.native_plan`)."""

    _fields_ = [
        ("rows", ctypes.c_void_p),
        ("segments", ctypes.c_void_p),
        ("num_segments", ctypes.c_int64),
        ("scale", ctypes.c_void_p),
        ("count", ctypes.c_int64),
    ]


@dataclass(frozen=True)
class NativeKernels:
    """The loaded library's entry points (ctypes functions with their signatures set)."""

    path: Path
    shrink: CFuncPtr
    expand_add: CFuncPtr
    lora_add: CFuncPtr
    openmp: bool  # built with OpenMP: calls use torch.get_num_threads() threads


def _compiler() -> str | None:
    name = os.environ.get("CC") or "cc"
    return shutil.which(name)


def _cpu_identity() -> str:
    """What a build for this CPU depends on: its model and feature flags."""
    info = cpu_info()
    return f"{info.arch}|{info.model}|{sorted(info.flags)}"


def _torch_uses_libgomp() -> bool:
    """Whether this process already runs GNU OpenMP (torch's pool): an OpenMP build then binds
    to that same runtime by its soname, libgomp.so.1."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            return any("libgomp" in line for line in f)
    except OSError:
        return False


def _library_path(compiler: str, flags: tuple[str, ...]) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False, timeout=30
    ).stdout.splitlines()[:1]
    digest = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        " ".join(flags).encode(),
        str(version).encode(),
        _cpu_identity().encode(),
    ):
        digest.update(part)
        digest.update(b"\0")
    directory = cache_dir() / "native"
    directory.mkdir(mode=0o700, exist_ok=True)
    return directory / f"lora_cpu-{digest.hexdigest()[:16]}.so"


def _build(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    """Compiles into a temp file beside `target` and renames it in: concurrent builders each
    publish a complete library, never a half-written one."""
    fd, tmp_name = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        result = subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", str(tmp)],
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
        if result.returncode != 0:
            raise NativeKernelError(
                f"{compiler} failed on {SOURCE.name} (exit {result.returncode}): "
                f"{result.stderr.strip()[-2000:]}"
            )
        os.chmod(tmp, 0o700)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _bind(path: Path) -> NativeKernels:
    lib = ctypes.CDLL(str(path))
    if lib.lf_abi_version() != ABI_VERSION:
        raise NativeKernelError(f"{path} speaks ABI {lib.lf_abi_version()}, expected {ABI_VERSION}")
    shrink = lib.lf_shrink
    shrink.argtypes = [
        _ptr,
        _i32,
        _i64,
        _i64,
        _ptr,
        _ptr,
        _i64,
        _ptr,
        _i64,
        _i64,
        _ptr,
        _ptr,
        _ptr,
        _i64,
        _i32,
    ]
    shrink.restype = ctypes.c_int
    expand = lib.lf_expand_add
    expand.argtypes = [
        _ptr,
        _i64,
        _i64,
        _ptr,
        _ptr,
        _i64,
        _ptr,
        _i64,
        _i64,
        _i64,
        _ptr,
        _i32,
        _i64,
        _i32,
    ]
    expand.restype = ctypes.c_int
    lora_add = lib.lf_lora_add
    lora_add.argtypes = [
        ctypes.POINTER(LayerPlan),
        ctypes.POINTER(RoutingPlan),
        _ptr,
        _i32,
        _i64,
        _ptr,
        _i32,
        _i64,
        _i32,
    ]
    lora_add.restype = ctypes.c_int
    return NativeKernels(
        path=path, shrink=shrink, expand_add=expand, lora_add=lora_add, openmp=bool(lib.lf_openmp())
    )


def runnable_paths() -> list[str]:
    """The instruction-set paths this process can run, strongest first (tests compare them
    bit for bit)."""
    info = cpu_info()
    if info.arch not in ("x86_64", "AMD64"):
        return [NATIVE_PATH[0]]
    return [name for name, (needs, _) in ISA_PATHS.items() if info.has(needs)]


def chosen_path() -> str:
    """The path the kernels run: `LORAFLEET_NATIVE_ISA` if set, else the strongest runnable."""
    forced = os.environ.get(ENV_ISA, "").strip().lower()
    runnable = runnable_paths()
    if not forced:
        return runnable[0]
    if forced not in runnable:
        raise NativeKernelError(
            f"{ENV_ISA}={forced!r} is not a path this CPU can run; runnable: {', '.join(runnable)}"
        )
    return forced


def _path_flags(path_name: str) -> tuple[str, ...]:
    return NATIVE_PATH[1] if path_name == NATIVE_PATH[0] else ISA_PATHS[path_name][1]


@functools.cache
def _load_path(path_name: str) -> tuple[NativeKernels | None, str]:
    switch = os.environ.get(ENV_SWITCH, "1").strip().lower()
    if switch in ("0", "false", "no", "off"):
        return None, f"turned off by {ENV_SWITCH}={os.environ[ENV_SWITCH]}"
    compiler = _compiler()
    if compiler is None:
        return None, f"no C compiler ({os.environ.get('CC') or 'cc'}) on PATH"
    base_flags = FLAGS + _path_flags(path_name)
    builds: list[tuple[str, tuple[str, ...]]] = (
        [("OpenMP", base_flags + OPENMP_FLAGS)] if _torch_uses_libgomp() else []
    )
    builds.append(("serial", base_flags))
    failures = []
    for name, flags in builds:
        try:
            path = _library_path(compiler, flags)
            if not path.exists():
                _build(compiler, flags, path)
            kernels = _bind(path)
            _self_check(kernels)
        except (NativeKernelError, OSError, subprocess.SubprocessError) as exc:
            failures.append(f"{name} build: {exc}")
            continue
        if failures:
            log.warning("native CPU LoRA kernels: %s; using the %s build", failures[0], name)
        return kernels, f"loaded {path} ({path_name}, {name})"
    return None, "; ".join(failures)


@functools.cache
def _load() -> tuple[NativeKernels | None, str]:
    """The chosen path's kernels, decided once: every adapted layer's no-grad call asks."""
    try:
        path_name = chosen_path()
    except NativeKernelError as exc:
        return None, str(exc)
    return _load_path(path_name)


def kernels_for(path_name: str) -> NativeKernels:
    """The kernels built for one instruction-set path (tests compare the paths' bits)."""
    if path_name not in runnable_paths():
        raise NativeKernelError(f"path {path_name!r} cannot run here; runnable: {runnable_paths()}")
    loaded, reason = _load_path(path_name)
    if loaded is None:
        raise NativeKernelError(f"native CPU LoRA kernels ({path_name}) off: {reason}")
    return loaded


def path_name() -> str:
    """Which LoRA kernels a no-grad CPU forward runs, in one word for benchmark JSON:
    `avx512+openmp`, `avx2+serial`, ..., or `torch` when the native kernels are off."""
    loaded, _ = _load()
    if loaded is None:
        return "torch"
    return f"{chosen_path()}+{'openmp' if loaded.openmp else 'serial'}"


def kernels() -> NativeKernels | None:
    """The loaded kernels, or None (the reason is in `status()`, and logged once)."""
    loaded, reason = _load()
    if loaded is None:
        _warn_once(reason)
    return loaded


def available() -> bool:
    return kernels() is not None


def status() -> str:
    """One line for logs and benchmarks: which LoRA kernels a no-grad CPU forward runs."""
    loaded, reason = _load()
    return (
        f"native CPU LoRA kernels: {reason}" if loaded else f"native CPU LoRA kernels off: {reason}"
    )


@functools.cache
def _warn_once(reason: str) -> None:
    if not reason.startswith("turned off"):
        log.warning("native CPU LoRA kernels unavailable (%s); using torch matmuls", reason)


def require() -> NativeKernels:
    loaded = kernels()
    if loaded is None:
        raise NativeKernelError(status())
    return loaded


# --------------------------------------------------------------------------- calls


def shrink(
    native: NativeKernels,
    x: torch.Tensor,
    rows: torch.Tensor,
    segments: torch.Tensor,
    A: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """hidden[t] = scale[t] * A[slot(t)] @ x[rows[t]] as fp32 [len(rows), A.shape[1]].

    x: [tokens, in] fp32/bf16 with unit column stride; A: [slots, R, in] fp32 with each
    slot's [R, in] contiguous; rows/segments: a routing's order and segments (int64)."""
    count, R, in_features = rows.shape[0], A.shape[1], A.shape[2]
    hidden = torch.empty(count, R, dtype=torch.float32)
    status_code = native.shrink(
        x.data_ptr(), DTYPE_CODES[x.dtype], x.stride(0), in_features,
        rows.data_ptr(), segments.data_ptr(), segments.shape[0],
        A.data_ptr(), A.stride(0), R,
        scale.data_ptr(), hidden.data_ptr(), None, 0, torch.get_num_threads(),
    )  # fmt: skip
    if status_code != 0:
        raise MemoryError(
            f"native LoRA shrink could not allocate its scratch ({in_features} features)"
        )
    return hidden


def expand_add(
    native: NativeKernels,
    hidden: torch.Tensor,
    B: torch.Tensor,
    rows: torch.Tensor,
    segments: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """y[rows[t]] += B[slot(t)] @ hidden[t], rounded into y's dtype as `y.add_(delta.to(y.dtype))`.

    hidden: fp32 [len(rows), R] with unit column stride (a column slice is fine); B: the
    bank's [slots, out, R] view of rank-major storage (B[s].T contiguous); y: [tokens, out]."""
    status_code = native.expand_add(
        hidden.data_ptr(), hidden.stride(0), hidden.shape[1],
        rows.data_ptr(), segments.data_ptr(), segments.shape[0],
        B.data_ptr(), B.stride(0), B.stride(2), B.shape[1],
        y.data_ptr(), DTYPE_CODES[y.dtype], y.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    if status_code != 0:
        raise MemoryError(
            f"native LoRA expand could not allocate its scratch ({B.shape[1]} features)"
        )


def layer_plan(A: torch.Tensor, B: torch.Tensor, row_rest: int | None = None) -> LayerPlan | None:
    """The plan of a bank's A [slots, R, in] and B [slots, out, R] views, or None when they
    are not laid out as the kernels read them: CPU fp32, each slot's A row-major, B rank-major
    (banks.py). The plan holds raw pointers: the caller keeps A and B alive with it.

    `row_rest`: the floats from a slot's B to the end of its bank row (banks.py lays a slot's
    layers out in model order, so that is what the next layers read first); the call prefetches
    into it while its last slot's A streams in. None: B's own block only."""
    if A.dim() != 3 or B.dim() != 3 or A.shape[0] != B.shape[0] or A.shape[1] != B.shape[2]:
        return None
    for W in (A, B):
        if not W.is_cpu or W.dtype != torch.float32:
            return None
    if A.stride(2) != 1 or A.stride(1) != A.shape[2] or B.stride(1) != 1:
        return None
    b_block = B.shape[2] * B.stride(2)
    if row_rest is None:
        row_rest = b_block
    if row_rest < b_block:
        raise ValueError(f"row_rest {row_rest} is shorter than B's own block ({b_block} floats)")
    return LayerPlan(
        A.data_ptr(), A.stride(0), A.shape[1], A.shape[2],
        B.data_ptr(), B.stride(0), B.stride(2), B.shape[1], row_rest,
    )  # fmt: skip


def routing_plan(
    order: torch.Tensor, segments: torch.Tensor, token_scale: torch.Tensor
) -> RoutingPlan:
    """The plan of a routing's `order`, `segments` and `token_scale` (CPU, as build_routing
    makes them for a CPU bank); the caller keeps the three tensors alive with it."""
    for name, t, dtype in (
        ("order", order, torch.int64),
        ("segments", segments, torch.int64),
        ("token_scale", token_scale, torch.float32),
    ):
        if not t.is_cpu or t.dtype != dtype or not t.is_contiguous():
            raise NativeKernelError(
                f"routing {name} must be a contiguous CPU {dtype} tensor, got {t.dtype} on {t.device}"
            )
    return RoutingPlan(
        order.data_ptr(),
        segments.data_ptr(),
        segments.shape[0],
        token_scale.data_ptr(),
        order.shape[0],
    )


def lora_add(
    native: NativeKernels, layer: LayerPlan, routing: RoutingPlan, x: torch.Tensor, y: torch.Tensor
) -> None:
    """y[rows[t]] += B[slot(t)] @ (scale[t] * A[slot(t)] @ x[rows[t]]): `shrink` then
    `expand_add` in one call, bit for bit, with the hidden in the library's scratch.

    x: [..., in] and y: [..., out], fp32 or bf16, with unit column stride and evenly spaced
    rows (2-D, or contiguous): row t is at `t * stride(-2)`. Their sizes must be those of the
    plans (checked by the caller, which built both)."""
    if not ((x.dim() == 2 or x.is_contiguous()) and (y.dim() == 2 or y.is_contiguous())):
        raise NativeKernelError(
            f"x {tuple(x.shape)} and y {tuple(y.shape)} need evenly spaced rows"
        )
    status_code = native.lora_add(
        layer, routing, x.data_ptr(), DTYPE_CODES[x.dtype], x.stride(-2),
        y.data_ptr(), DTYPE_CODES[y.dtype], y.stride(-2), torch.get_num_threads(),
    )  # fmt: skip
    if status_code != 0:
        raise MemoryError(f"native LoRA could not allocate its scratch ({routing.count} tokens)")


def _self_check(native: NativeKernels) -> None:
    """A miscompiled or mis-targeted library must not reach a forward: compare one small
    routed product with torch before first use."""
    gen = torch.Generator().manual_seed(0)
    slots, R, in_features, out = 3, 8, 40, 24
    A = torch.randn(slots, R, in_features, generator=gen)
    B = torch.randn(slots, R, out, generator=gen).transpose(1, 2)
    x = torch.randn(5, in_features, generator=gen)
    rows = torch.tensor([4, 0, 2, 1], dtype=torch.int64)
    segments = torch.tensor([[1, 0, 1], [2, 1, 4]], dtype=torch.int64)
    scale = torch.tensor([0.5, 2.0, 2.0, 2.0])
    slot_of = torch.tensor([1, 2, 2, 2])
    hidden = shrink(native, x, rows, segments, A, scale)
    want_hidden = torch.einsum("ti,tri->tr", x[rows], A[slot_of]) * scale[:, None]
    y = torch.zeros(5, out)
    expand_add(native, hidden, B, rows, segments, y)
    want_y = torch.zeros(5, out).index_add_(0, rows, torch.einsum("tr,tor->to", hidden, B[slot_of]))
    fused = torch.zeros(5, out)
    plan = layer_plan(A, B)
    assert plan is not None
    lora_add(native, plan, routing_plan(rows, segments, scale), x, fused)
    if not (
        torch.allclose(hidden, want_hidden, atol=1e-4) and torch.allclose(y, want_y, atol=1e-4)
    ):
        raise NativeKernelError(f"{native.path} failed its self-check against torch")
    if not torch.equal(fused, y):
        raise NativeKernelError(
            f"{native.path}: lf_lora_add differs from lf_shrink + lf_expand_add"
        )
