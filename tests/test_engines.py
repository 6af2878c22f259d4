"""The engine factory and the engine set the server holds (lorafleet.engines, lorafleet.interfaces)."""

from __future__ import annotations

import pytest

from lorafleet.distributed.ray_samplers import RaySamplerPool, RayVersionStore
from lorafleet.distributed.remote import DistTrainEngine
from lorafleet.engines import EngineConfig, build_engines
from lorafleet.interfaces import EngineSet, Sampler, Trainer, VersionStore
from lorafleet.model.loader import load_base
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample.engine import SampleEngine
from lorafleet.sample.versions import VersionStore as SampleVersions
from lorafleet.sync.pool import PoolVersions, RolloutPool
from lorafleet.train.engine import TrainEngine


class _Part:
    def __init__(self, name: str, log: list[str], fail: bool = False):
        self.name, self.log, self.fail = name, log, fail

    def close(self) -> None:
        self.log.append(self.name)
        if self.fail:
            raise RuntimeError(f"{self.name} failed to stop")


def test_an_engine_set_stops_its_parts_in_order_even_when_one_fails():
    log: list[str] = []
    engines = EngineSet(
        trainer=None,  # closing never touches the engines
        sampler=None,
        owned=(_Part("samplers", log, fail=True), _Part("trainer ranks", log)),
    )
    with pytest.raises(RuntimeError, match="samplers failed to stop"):
        engines.close()
    assert log == ["samplers", "trainer ranks"]


def test_colocated_engines_share_one_base_and_take_the_configured_sizes():
    base = load_base("tiny-qwen3")
    targets = resolve_tinker_targets(base.model)
    config = EngineConfig(
        base_model="tiny-qwen3", max_adapters=3, sampler_slots=5, max_lora_rank=8, token_budget=77
    )
    engines = build_engines(config, base, targets)
    assert isinstance(engines.trainer, TrainEngine)
    assert isinstance(engines.sampler, SampleEngine)
    assert engines.versions is engines.sampler.versions
    assert engines.trainer.token_budget == 77
    assert engines.trainer.bank.num_slots == 4 and engines.trainer.bank.r_max == 8
    assert engines.sampler.versions.capacity == 5
    assert engines.trainer.adapted is engines.sampler.adapted  # one wrapped base
    assert engines.owned == ()
    engines.close()  # nothing to stop in one process


# What each engine declares about itself through the seams: required members, not optional
# capabilities probed at run time (mypy checks every signature where `EngineSet` is built; this
# names the implementations, so a new one is added here too).
DECLARED = {
    Sampler: ("features", "health", "rollout_stats", "prefix_cache_stats"),
    VersionStore: ("paging", "verified"),
    Trainer: ("pager",),
}
IMPLEMENTATIONS = {
    Sampler: (SampleEngine, RolloutPool, RaySamplerPool),
    VersionStore: (SampleVersions, PoolVersions, RayVersionStore),
    Trainer: (TrainEngine, DistTrainEngine),
}


@pytest.mark.parametrize("seam", list(DECLARED), ids=lambda seam: seam.__name__)
def test_every_engine_declares_what_its_seam_requires(seam):
    for member in DECLARED[seam]:
        assert member in vars(seam), f"{seam.__name__}.{member} is no longer part of the seam"
        missing = [cls.__name__ for cls in IMPLEMENTATIONS[seam] if not hasattr(cls, member)]
        assert not missing, f"{missing} do not declare {seam.__name__}.{member}"


def test_a_trainer_says_whether_it_pages():
    """The sharded trainer keeps hard slots, declared (the server holds a run per slot); the
    colocated one pages its slots itself."""
    assert DistTrainEngine.pager.fget(None) is None
    base = load_base("tiny-qwen3")
    engines = build_engines(
        EngineConfig(base_model="tiny-qwen3"), base, resolve_tinker_targets(base.model)
    )
    assert engines.trainer.pager is engines.trainer
