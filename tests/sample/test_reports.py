"""What the embedded sampler reports about itself through the `Sampler` seam (features, health,
its one replica, its prefix cache), and the report types every sampler shares."""

from __future__ import annotations

import pytest

from lorafleet.model.banks import AdapterSpec
from lorafleet.sample import SampleRequest
from lorafleet.sample.prefix_cache import PrefixCacheStats
from lorafleet.sample.reports import ReplicaStats, SamplerFeatures, health_of
from tests.sample.test_versions import PARAMS, PROMPT, make, nudge

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_embedded_engine_reports_itself_one_replica_in_process():
    stack = make()
    engine = stack.sampler
    assert engine.features == SamplerFeatures(
        engine="embedded", stop_strings=True, top_logprobs=True, token_streaming=True
    )
    assert engine.health() == "ok"
    assert engine.rollout_stats().as_dict() == {
        "engine": "embedded",
        "sync": "tensor",
        "replicas": [
            {
                "name": "embedded",
                "url": "in-process",
                "state": "healthy",
                "versions": [],
                "last_canary": None,
                "restarts": 0,
                "error": None,
            }
        ],
    }
    slot = stack.trainer.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=1))
    nudge(stack, slot, 1)
    key = stack.versions.publish("tenant/run", stack.trainer.bank, slot)
    other = stack.versions.publish("tenant/run", stack.trainer.bank, slot)
    (replica,) = engine.rollout_stats().replicas
    assert replica.versions == ("tenant/run@0", "tenant/run@1")  # what its slots hold now
    stack.versions.drop(other)
    (replica,) = engine.rollout_stats().replicas
    assert replica.versions == ("tenant/run@0",)
    # its prefix cache, typed, is what the cache itself counts
    engine.generate([SampleRequest(PROMPT * 8, PARAMS, adapter=key)])
    stats = engine.prefix_cache_stats()
    assert isinstance(stats, PrefixCacheStats) and stats.enabled and stats.missed_tokens > 0
    assert stats.as_dict() == engine.prefix_cache.stats()


def test_a_failed_step_shows_as_the_replicas_error_until_a_step_succeeds(monkeypatch):
    stack = make()
    engine = stack.sampler

    def broken(step: int) -> None:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine, "_advance", broken)
    (future,) = engine.submit([SampleRequest(PROMPT, PARAMS)])
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.step()
    # its request fails with the step's error, and with the work it did (for metering)
    failed = future.result(timeout=1)
    assert failed.error is not None and failed.error.code == "internal_error"
    assert "RuntimeError: out of memory" in failed.error.message and failed.sampled_tokens == 0
    (replica,) = engine.rollout_stats().replicas
    assert replica.error == "step 1 failed: RuntimeError: out of memory"
    # its own requests failed; the engine still serves, so it stays in rotation
    assert replica.state == "healthy" and engine.health() == "ok"
    monkeypatch.undo()
    (result,) = engine.generate([SampleRequest(PROMPT, PARAMS)])
    assert result.ok
    assert engine.rollout_stats().replicas[0].error is None


def _cache(**counts: int) -> PrefixCacheStats:
    fields = dict.fromkeys(
        (
            "max_bytes",
            "bytes",
            "blocks",
            "lookups",
            "hit_tokens",
            "missed_tokens",
            "inserts",
            "evictions",
            "invalidated",
        ),
        0,
    )
    return PrefixCacheStats(enabled=True, block_tokens=16, **(fields | counts))


def test_prefix_caches_of_several_replicas_add_up():
    a = _cache(max_bytes=100, bytes=40, blocks=2, lookups=3, hit_tokens=32, missed_tokens=16)
    b = _cache(max_bytes=100, bytes=20, blocks=1, lookups=5, hit_tokens=0, missed_tokens=48)
    both = PrefixCacheStats.combined([a, b])
    assert both is not None
    assert (both.max_bytes, both.bytes, both.blocks, both.lookups) == (200, 60, 3, 8)
    assert both.hit_rate == 32 / 96  # over the tokens, not the mean of the two rates
    assert both.as_dict()["hit_rate"] == both.hit_rate and both.block_tokens == 16
    assert PrefixCacheStats.combined([]) is None
    odd = PrefixCacheStats(**(a.__dict__ | {"block_tokens": 32, "enabled": False}))
    mixed = PrefixCacheStats.combined([a, odd])
    assert mixed is not None and mixed.block_tokens == 0 and mixed.enabled


def test_health_follows_the_replicas_states():
    assert health_of(["healthy", "healthy"]) == "ok"
    assert health_of(["healthy", "restarting"]) == "degraded"
    assert health_of(["unhealthy", "starting"]) == "unavailable"
    assert health_of([]) == "unavailable"  # nothing serves
    replica = ReplicaStats("r", "in-process", "healthy", ("a@0",), None, 0, None)
    assert replica.as_dict()["versions"] == ["a@0"]  # JSON: a list
