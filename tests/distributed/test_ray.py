"""Ray placement on a local cluster: a trainer-rank actor and two sampler-replica actors.

Versions go from the trainer to every replica through the object store; each replica must
serve a published version exactly as the others do, and a replica killed in the middle of a
batch is replaced and re-synced without losing the batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from lorafleet.canary import SyncVerificationError
from lorafleet.distributed.protocol import RankSettings
from lorafleet.distributed.remote import DistTrainEngine
from lorafleet.model.banks import AdapterSpec
from lorafleet.sample.canary_probe import version_name
from lorafleet.sample.types import SampleRequest, SamplingParams
from lorafleet.sample.versions import UnknownVersionError
from lorafleet.train.engine import TrainItem
from lorafleet.train.optim import AdamHParams
from lorafleet.verification import publish_verified

ray = pytest.importorskip("ray")

from lorafleet.distributed.ray_samplers import RaySamplerPool, SamplerSettings  # noqa: E402
from lorafleet.distributed.ray_trainer import RayRanks  # noqa: E402
from lorafleet.distributed.wire import to_wire  # noqa: E402


@pytest.fixture(scope="module")
def fleet(ray_cluster, tiny_targets) -> Iterator[tuple[DistTrainEngine, RaySamplerPool]]:
    trainer = DistTrainEngine(
        RayRanks(
            RankSettings(
                base_model="tiny-qwen3", targets=tiny_targets, num_slots=5, r_max=8, torch_threads=1
            ),
            1,
        )
    )
    pool = RaySamplerPool(
        SamplerSettings(
            base_model="tiny-qwen3",
            targets=tiny_targets,
            slots=4,
            r_max=8,
            max_rows=8,
            torch_threads=1,
        ),
        2,
        trainer=trainer,
        health_interval_s=0.5,
    )
    yield trainer, pool
    pool.close()
    trainer.close()


def train_step(trainer: DistTrainEngine, slot: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 512, (24,), generator=g)
    trainer.forward_backward(
        [
            TrainItem(
                slot,
                tokens,
                "cross_entropy",
                {"target_tokens": torch.roll(tokens, -1), "weights": torch.ones(24)},
            )
        ]
    )
    trainer.optim_step({slot: AdamHParams(learning_rate=2e-2)})


def probe(key, max_tokens: int = 12, seed: int = 7, samples: int = 2) -> list[SampleRequest]:
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop=[])
    return [
        SampleRequest(
            [3, 14, 15, 92, 65], params, adapter=key, num_samples=samples, prompt_logprobs=True
        )
    ]


def served(pool: RaySamplerPool, index: int, key) -> tuple:
    (result,) = pool.generate_on(index, probe(key))
    assert result.error is None, result.error
    return result.prompt_logprobs, [(s.tokens, s.logprobs) for s in result.sequences]


def test_a_published_version_is_served_identically_by_every_replica(fleet, tmp_path):
    trainer, pool = fleet
    slot = trainer.create_adapter(AdapterSpec(rank=4, alpha=16, seed=3))
    train_step(trainer, slot, 1)
    key, check = publish_verified(pool, trainer, slot, "tenant-a/model", version=0)
    assert check.differs_check == "passed"
    assert all(key in pool.known_on(i) for i in range(2))
    first = served(pool, 0, key)
    assert first == served(pool, 1, key)
    assert first != served(pool, 0, None)  # not the base model
    # a newer version of the same adapter, and a saved one registered from the server's files:
    # both reach both replicas
    train_step(trainer, slot, 2)
    newer, _ = publish_verified(pool, trainer, slot, "tenant-a/model")
    assert newer == ("tenant-a/model", 1)
    saved = trainer.export_peft(slot, tmp_path / "peft")
    registered = pool.versions.register("tinker://model/sampler_weights/final", 0, saved)
    for index in range(2):
        assert {key, newer, registered} <= set(pool.known_on(index))
    assert served(pool, 0, newer) == served(pool, 1, newer) == served(pool, 0, registered)
    assert served(pool, 0, newer) != first
    # more versions than a replica holds (4 slots): its LRU evicts the older ones, and the pool
    # sends them again when asked, instead of answering "unavailable"
    newer_out = served(pool, 0, newer)
    for _ in range(4):
        publish_verified(pool, trainer, slot, "tenant-a/model")
    (evicted,) = pool.generate_on(0, probe(newer))
    assert evicted.error is not None and evicted.error.code == "version_unavailable"
    for _ in range(2):  # one call per replica (round robin)
        (again,) = pool.generate(probe(newer))
        assert again.error is None
        assert (
            again.prompt_logprobs,
            [(q.tokens, q.logprobs) for q in again.sequences],
        ) == newer_out
    # dropping reaches every replica too
    pool.versions.drop(key)
    with pytest.raises(UnknownVersionError):
        pool.versions.info(key)
    assert all(key not in pool.known_on(i) for i in range(2))
    trainer.free_adapter(slot)


def test_a_replica_killed_mid_batch_is_replaced_and_resynced_without_losing_the_batch(fleet):
    trainer, pool = fleet
    slot = trainer.create_adapter(AdapterSpec(rank=8, alpha=16, seed=4))
    train_step(trainer, slot, 3)
    keys = [publish_verified(pool, trainer, slot, "tenant-b/model", version=0)[0]]
    train_step(trainer, slot, 4)
    keys.append(publish_verified(pool, trainer, slot, "tenant-b/model", version=1)[0])
    restarts = pool.restarts
    # long enough to outlast the kill below on a fast machine (a batch that finished first
    # would leave nothing to replace mid-batch)
    long_batch = probe(keys[1], max_tokens=160, seed=11, samples=16)
    out: dict[str, object] = {}
    runner = threading.Thread(target=lambda: out.setdefault("results", pool.generate(long_batch)))
    runner.start()
    deadline = time.monotonic() + 60
    while not pool.busy():
        assert time.monotonic() < deadline, "the batch never started"
        time.sleep(0.02)
    victim = next(iter(pool.busy()))
    time.sleep(0.05)  # let it decode a little
    ray.kill(pool.replica_handle(victim), no_restart=True)
    runner.join(timeout=300)
    (result,) = out["results"]
    assert result.error is None
    assert [len(s.tokens) for s in result.sequences] == [160] * 16
    pool.wait_ready(timeout_s=300)
    assert pool.restarts == restarts + 1
    for index in range(2):
        assert set(keys) <= set(pool.known_on(index)), index
    for key in keys:
        assert served(pool, 0, key) == served(pool, 1, key)
    # the batch that was interrupted gives what an undisturbed replica gives (seeded sampling)
    (again,) = pool.generate_on(victim, long_batch)
    assert [s.tokens for s in again.sequences] == [s.tokens for s in result.sequences]
    trainer.free_adapter(slot)


def test_an_idle_replica_that_dies_is_noticed_replaced_and_reported(fleet):
    """The pool reports its real replicas (`rollout_stats`, `health`: what the server's stats
    and /healthz read): where each runs, the versions it holds, its canary; a replica whose
    actor is killed shows as not healthy, and the pool as degraded, until it is back."""
    trainer, pool = fleet
    slot = trainer.create_adapter(AdapterSpec(rank=2, alpha=4, seed=5))
    train_step(trainer, slot, 5)
    key, _ = publish_verified(pool, trainer, slot, "tenant-c/model", version=0)
    name = version_name(key)
    stats = pool.rollout_stats()
    assert (stats.engine, stats.sync, pool.health()) == ("ray", "tensor", "ok")
    assert [r.name for r in stats.replicas] == ["sampler replica 0", "sampler replica 1"]
    for replica in stats.replicas:
        assert replica.state == "healthy" and replica.error is None, replica
        assert name in replica.versions
        assert replica.url.startswith("ray actor on ") and ", pid " in replica.url
        assert replica.last_canary is not None and replica.last_canary.version == name
        assert replica.last_canary.ok and replica.last_canary.max_abs_diff is not None
    # each replica's own prefix cache and slot counters, as its last liveness check found them
    cache = pool.prefix_cache_stats()
    assert cache is not None and cache.max_bytes > 0
    assert set(pool.versions.paging()["replicas"]) == {"sampler replica 0", "sampler replica 1"}
    victim_before = stats.replicas[0]
    restarts = pool.restarts
    ray.kill(pool.replica_handle(0), no_restart=True)
    deadline = time.monotonic() + 120
    # the liveness check finds it without any request, and the report says so at once
    while (victim := pool.rollout_stats().replicas[0]).state == "healthy":
        assert time.monotonic() < deadline, "the killed replica still reports healthy"
        time.sleep(0.05)
    assert victim.state in ("restarting", "unhealthy") and victim.error, victim
    assert pool.health() == "degraded"
    assert pool.rollout_stats().replicas[1].state == "healthy"
    while pool.restarts == restarts:
        assert time.monotonic() < deadline, "the dead replica was not replaced"
        time.sleep(0.1)
    pool.wait_ready(timeout_s=300)
    assert key in pool.known_on(0)
    assert served(pool, 0, key) == served(pool, 1, key)
    back = pool.rollout_stats().replicas[0]
    assert back.state == "healthy" and back.error is None and pool.health() == "ok"
    assert back.restarts == victim_before.restarts + 1
    assert back.url != victim_before.url  # a new actor (another process)
    assert name in back.versions
    # verified again before it served: the re-sync's canary
    assert back.last_canary is not None and back.last_canary.ok
    assert back.last_canary.at > victim_before.last_canary.at
    trainer.free_adapter(slot)


class CountingTrainer:
    """The trainer as the publisher sees it, counting the canary references asked of it."""

    def __init__(self, trainer: DistTrainEngine):
        self.trainer, self.bank, self.calls = trainer, trainer.bank, 0

    def canary_logprobs(self, slot, tokens):
        self.calls += 1
        return self.trainer.canary_logprobs(slot, tokens)


def test_the_canary_runs_once_per_version_and_a_wrong_replica_copy_fails_it(fleet):
    trainer, pool = fleet
    store = pool.versions
    slot = trainer.create_adapter(AdapterSpec(rank=4, alpha=16, seed=6))
    other = trainer.create_adapter(AdapterSpec(rank=4, alpha=16, seed=7))
    train_step(trainer, slot, 6)
    train_step(trainer, other, 7)
    computed = store.references.computed
    publisher = CountingTrainer(trainer)
    key, report = publish_verified(pool, publisher, slot, "tenant-d/model", version=0)
    # both replicas were checked by the store while publishing, against one trainer reference;
    # the publisher does not check the version a second time
    assert store.references.computed == computed + 1 and publisher.calls == 0
    assert report == store.verified(key) and report.differs_check == "passed"
    # checking again (every replica) reuses the version's reference, though the slot moved on
    train_step(trainer, slot, 8)
    reports = store.verify_everywhere(key, slot)
    assert len(reports) == 2 and store.references.computed == computed + 1
    # replica 0 gets another adapter's weights under this version's name: the check against
    # the recorded reference (what a re-synced replica goes through) fails, naming it
    handle = pool.replica_handle(0)
    ray.get(handle.drop.remote(key))
    wrong = ray.put(to_wire(trainer.bank.check_slot(other).spec, trainer.bank.slot_weights(other)))
    assert ray.get(handle.load.remote(key, wrong))
    with pytest.raises(SyncVerificationError, match="canary mismatch for tenant-d/model@0"):
        store.verify_on("sampler replica 0", handle, key)
    with pytest.raises(SyncVerificationError, match="sampler replica 0") as err:
        store.verify_everywhere(key, slot)
    assert "sampler replica 1" not in str(err.value)
    assert err.value.replicas == ("sampler replica 0",)
    # the stats say which replica failed it, and that the other passed
    zero, one = pool.rollout_stats().replicas
    assert zero.last_canary is not None and not zero.last_canary.ok
    assert one.last_canary is not None and one.last_canary.ok
    assert zero.last_canary.version == one.last_canary.version == "tenant-d/model@0"
    store.drop(key)
    assert store.verified(key) is None and store.references.recorded(key) is None
    trainer.free_adapter(slot)
    trainer.free_adapter(other)
