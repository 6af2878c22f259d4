"""`--dtype auto`: bf16 only where the CPU multiplies bf16 natively, confirmed by the probe."""

from __future__ import annotations

import pytest
import torch

from lorafleet import hardware
from lorafleet.hardware import choose_dtype, cpu_info_from, hardware_class, resolve_dtype

AVX2_FLAGS = frozenset(["fpu", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"])
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
BF16_FLAGS = AVX512_FLAGS | {"avx512_bf16"}
AMX_FLAGS = BF16_FLAGS | {"amx_bf16", "amx_tile", "amx_int8"}


def machine(flags: frozenset[str], aten: str = "AVX512", onednn: str | None = None):
    return cpu_info_from("test cpu", "x86_64", flags, aten, onednn)


def fast_probe() -> float:
    return 4.0


def slow_probe() -> float:
    return 0.01


def refuse_probe() -> float:
    raise AssertionError("the probe must not run where the flags rule bf16 out")


@pytest.mark.parametrize(
    "flags,want",
    [
        (frozenset({"sse2"}), "DEFAULT"),
        (AVX2_FLAGS, "AVX2"),
        (AVX512_FLAGS, "AVX512"),
        (BF16_FLAGS, "AVX512_BF16"),
        (AMX_FLAGS, "AMX"),
    ],
)
def test_hardware_class_from_flags(flags, want):
    assert hardware_class(flags, "x86_64") == want


def test_non_x86_is_default_class():
    assert hardware_class(frozenset({"asimd", "bf16"}), "aarch64") == "DEFAULT"


@pytest.mark.parametrize("probe", [fast_probe, slow_probe])
def test_auto_picks_fp32_on_avx2_whatever_the_probe_says(probe):
    for flags in (AVX2_FLAGS, AVX512_FLAGS):
        choice = choose_dtype("cpu", info=machine(flags), probe=refuse_probe)
        assert choice.dtype == "float32" and choice.auto
        assert "no native bf16" in choice.reason
    # a probe is never consulted there, so whatever it would say changes nothing
    assert choose_dtype("cpu", info=machine(AVX2_FLAGS), probe=probe).dtype == "float32"


@pytest.mark.parametrize("flags", [BF16_FLAGS, AMX_FLAGS])
def test_auto_picks_bf16_with_avx512_bf16_or_amx_when_the_probe_agrees(flags):
    choice = choose_dtype("cpu", info=machine(flags), probe=fast_probe)
    assert choice.dtype == "bfloat16"
    assert choice.bf16_speedup == 4.0
    assert "probe 4.0x fp32" in choice.reason


@pytest.mark.parametrize("flags", [BF16_FLAGS, AMX_FLAGS])
def test_a_slow_probe_vetoes_bf16_even_with_the_flags(flags):
    choice = choose_dtype("cpu", info=machine(flags), probe=slow_probe)
    assert choice.dtype == "float32"
    assert "100.0x slower than fp32" in choice.reason


@pytest.mark.parametrize(
    "aten,onednn", [("AVX2", None), ("AVX512", "AVX2"), ("AVX512", "avx512_core")]
)
def test_isa_caps_take_native_bf16_away(aten, onednn):
    """ATEN_CPU_CAPABILITY=avx2 / ONEDNN_MAX_CPU_ISA below BF16 hide AMX from this process."""
    info = machine(AMX_FLAGS, aten=aten, onednn=onednn)
    assert info.hardware_class == "AMX"
    assert not info.has("AVX512_BF16")
    choice = choose_dtype("cpu", info=info, probe=refuse_probe)
    assert choice.dtype == "float32"
    assert "the CPU has AMX" in choice.reason


def test_explicit_dtype_wins():
    assert resolve_dtype("float32") == hardware.DtypeChoice("float32", "given explicitly", False)
    assert resolve_dtype("BFloat16").dtype == "bfloat16"
    assert resolve_dtype("bf16").dtype == "bfloat16"
    assert resolve_dtype(" FP32 ").dtype == "float32"
    assert resolve_dtype(torch.bfloat16).dtype == "bfloat16"


def test_auto_on_this_machine_is_consistent_with_its_class():
    choice = resolve_dtype("auto")
    assert choice.auto
    if not hardware.cpu_info().has("AVX512_BF16"):
        assert choice.dtype == "float32"
    else:
        assert choice.bf16_speedup is not None
        want = "bfloat16" if choice.bf16_speedup >= hardware.MIN_BF16_SPEEDUP else "float32"
        assert choice.dtype == want
    assert choice.record()["reason"] == choice.reason


def test_the_probe_measures_both_dtypes():
    speedup = hardware.probe_bf16_speedup(budget_s=0.0)  # one round at least
    assert speedup > 0
