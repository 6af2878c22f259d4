"""The canary's rules on plain tensors: every engine (embedded sampler, vLLM, SGLang, Ray
replicas) is held to these, so they are tested once, here, without an engine."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lorafleet.canary import (
    ZERO_ADAPTER_SKIP,
    Reference,
    ReferenceCache,
    ReplicaLogprobs,
    SyncVerificationError,
    canary_tokens,
    check_replicas,
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
    assert tolerance_for(torch.bfloat16, same_implementation=True, invariant=True) == 1e-3
    assert tolerance_for(torch.float32, same_implementation=True, invariant=True) == 1e-5
    with pytest.raises(ValueError, match="our own sampler only"):
        tolerance_for(torch.bfloat16, invariant=True)


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


# ---------------------------------------------------------------- several replicas, one version


class Trainer:
    """The trainer's side: counts how often it is computed, optionally slowly."""

    def __init__(self, expected=ADAPTED, delay_s: float = 0.0):
        self.expected, self.delay_s, self.calls = expected, delay_s, 0
        self._lock = threading.Lock()

    def __call__(self) -> Reference:
        with self._lock:
            self.calls += 1
        time.sleep(self.delay_s)
        return Reference(self.expected, adapter_zero=False)


def replica(served=ADAPTED, delay_s: float = 0.0, gone: bool = False):
    def probe():
        time.sleep(delay_s)
        return None if gone else ReplicaLogprobs(served.clone(), BASE.clone(), "a@1")

    return probe


def check_all(probes, reference, **kw):
    return check_replicas(("a", 1), probes, reference, name="a@1", tolerance=1e-4, **kw)


def test_the_trainer_side_is_computed_once_per_version_for_every_replica():
    cache: ReferenceCache[tuple[str, int]] = ReferenceCache()
    trainer, other = Trainer(), Trainer(expected=ADAPTED + 1.0)
    probes = {f"replica {i}": replica() for i in range(3)}
    reports = check_all(probes, lambda: cache.get(("a", 1), trainer))
    assert sorted(reports) == ["replica 0", "replica 1", "replica 2"]
    assert all(r.differs_check == "passed" and r.served_by == "a@1" for r in reports.values())
    # checked again (a replica re-synced after a restart): the recorded reference, though the
    # trainer's slot has moved on since
    check_all({"replica 3": replica()}, lambda: cache.get(("a", 1), other))
    assert (trainer.calls, other.calls, cache.computed) == (1, 0, 1)
    assert cache.recorded(("a", 1)) is not None and cache.recorded(("a", 2)) is None
    # another version gets its own; a forgotten one is computed again
    cache.get(("a", 2), other)
    cache.forget(("a", 1))
    cache.get(("a", 1), trainer)
    assert (trainer.calls, other.calls, cache.computed) == (2, 1, 3)


def test_concurrent_checks_of_one_version_compute_its_reference_once():
    cache: ReferenceCache[tuple[str, int]] = ReferenceCache()
    trainer = Trainer(delay_s=0.2)
    got: list[Reference] = []
    threads = [
        threading.Thread(target=lambda: got.append(cache.get(("a", 1), trainer))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert trainer.calls == 1 and len(got) == 4 and all(r is got[0] for r in got)


def test_a_failed_reference_is_not_recorded():
    cache: ReferenceCache[tuple[str, int]] = ReferenceCache()

    def broken() -> Reference:
        raise RuntimeError("trainer rank died")

    with pytest.raises(RuntimeError, match="rank died"):
        check_all({"replica 0": replica()}, lambda: cache.get(("a", 1), broken))
    assert cache.recorded(("a", 1)) is None and cache.computed == 0
    assert cache.get(("a", 1), Trainer()).expected is ADAPTED


def test_replicas_are_probed_in_parallel_while_the_trainer_computes():
    delay = 0.5
    probes = {f"replica {i}": replica(delay_s=delay) for i in range(4)}
    trainer = Trainer(delay_s=delay)
    start = time.perf_counter()
    reports = check_all(probes, trainer)
    elapsed = time.perf_counter() - start
    assert len(reports) == 4 and trainer.calls == 1
    # one sleep, not five (serial would be 2.5 s): generous for a loaded machine
    assert elapsed < 2 * delay, elapsed


def test_every_failing_replica_is_named_after_all_have_answered():
    finished: list[str] = []

    def slow_good():
        time.sleep(0.3)
        finished.append("slow")
        return ReplicaLogprobs(ADAPTED.clone(), BASE.clone())

    def cannot_run():
        raise SyncVerificationError("canary: the engine could not run 'a@1'")

    probes = {
        "replica 0": replica(served=ADAPTED + 1e-2),  # a stale copy
        "replica 1": slow_good,
        "replica 2": replica(served=BASE),  # the base under the adapter's name
        "replica 3": cannot_run,
    }
    with pytest.raises(SyncVerificationError) as err:
        check_all(probes, Trainer())
    message = str(err.value)
    assert "the replica 0 engine's log-probs differ" in message
    assert "replica 2" in message and "replica 3: canary: the engine could not run" in message
    assert "replica 1" not in message and finished == ["slow"]


def test_a_replica_that_went_away_is_left_out_and_the_trainer_side_still_runs():
    trainer = Trainer()
    reports = check_all({"replica 0": replica(), "replica 1": replica(gone=True)}, trainer)
    assert list(reports) == ["replica 0"]
    assert check_all({}, trainer) == {} and trainer.calls == 2
