"""The canary's rules on plain tensors: every engine (embedded sampler, vLLM, SGLang, Ray
replicas) is held to these, so they are tested once, here, without an engine."""

from __future__ import annotations

import pytest
import torch

from lorafleet.canary import (
    ZERO_ADAPTER_SKIP,
    SyncVerificationError,
    canary_tokens,
    check_tokens,
    compare,
    compare_base,
    layers_are_zero,
    tolerance_for,
)

BASE = torch.tensor([-1.0, -2.0, -3.0])
ADAPTED = torch.tensor([-1.5, -2.0, -2.5])


def test_tolerances_by_dtype_and_implementation():
    assert tolerance_for(torch.float32, same_implementation=True) == 1e-4
    assert tolerance_for(torch.bfloat16, same_implementation=True) == 0.02
    assert tolerance_for(torch.float32) == 1e-3
    assert tolerance_for(torch.bfloat16) == 0.5


@pytest.mark.parametrize("same", [True, False])
def test_an_unknown_dtype_has_no_tolerance(same):
    with pytest.raises(ValueError, match="no canary tolerance"):
        tolerance_for(torch.float64, same_implementation=same)
    with pytest.raises(ValueError, match="no canary tolerance"):
        tolerance_for(torch.int8, same_implementation=same)


def test_canary_tokens_are_fixed_and_in_the_vocabulary():
    tokens = canary_tokens(100)
    assert tokens == canary_tokens(100) and len(tokens) == 16
    assert all(0 <= t < 100 for t in tokens)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        check_tokens([5])


def check(engine_lp, *, expected=ADAPTED, adapter_zero=False, tolerance=1e-4, served_by=None):
    """The canary for version "a@1" served under that name, against BASE."""
    return compare(
        ("a", 1),
        engine_lp,
        name="a@1",
        expected=expected,
        engine_base=BASE,
        adapter_zero=adapter_zero,
        tolerance=tolerance,
        served_by=served_by,
    )


def test_a_faithful_copy_passes():
    report = check(ADAPTED + 1e-5, served_by="a@1")
    assert report.version == ("a", 1) and report.served_by == "a@1"
    assert report.differs_check == "passed" and report.max_abs_diff <= 1e-4
    assert report.base_diff == pytest.approx(0.5, abs=1e-4)


@pytest.mark.parametrize("bad", [ADAPTED + 1e-3, ADAPTED * float("nan")])
def test_a_copy_outside_the_tolerance_fails(bad):
    with pytest.raises(SyncVerificationError, match="canary mismatch"):
        check(bad)


def test_a_non_zero_adapter_must_differ_from_the_base():
    # The trainer's adapter is below the tolerance, and the engine serves the base exactly.
    with pytest.raises(SyncVerificationError, match="equal its base"):
        check(BASE.clone(), expected=BASE + 1e-6)


def test_a_zero_adapter_equals_the_base_and_the_report_says_so():
    report = check(BASE.clone(), expected=BASE, adapter_zero=True)
    assert report.differs_check == ZERO_ADAPTER_SKIP and report.base_diff == 0.0


def test_the_engine_must_say_it_served_the_version_asked_for():
    with pytest.raises(SyncVerificationError, match="'a@0' served"):
        check(ADAPTED, served_by="a@0")


def test_a_wrong_number_of_logprobs_fails():
    with pytest.raises(SyncVerificationError, match="2 log-probs"):
        check(ADAPTED[:2], tolerance=1.0)


def test_the_engine_must_run_the_trainers_base():
    assert compare_base(BASE, BASE, tolerance=1e-4, engine="vllm") == 0.0
    with pytest.raises(SyncVerificationError, match="not running the trainer's base model"):
        compare_base(ADAPTED, BASE, tolerance=1e-4, engine="vllm")


def test_zero_layers():
    A, B = torch.ones(2, 3), torch.zeros(4, 2)
    assert layers_are_zero([(A, B), (torch.zeros(2, 3), torch.ones(4, 2))])
    assert not layers_are_zero([(A, B), (A, torch.ones(4, 2))])
