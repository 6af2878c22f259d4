"""The embedded sampler as a RolloutEngine: tensor and files sync, hot swap, verification."""

from __future__ import annotations

import stat

import pytest
import torch

from lorafleet.sync.base import (
    BASE,
    AdapterVersion,
    RolloutEngineError,
    RolloutParams,
    RolloutRequest,
    SyncMode,
    SyncVerificationError,
    UnsupportedSyncModeError,
)
from lorafleet.sync.embedded import EmbeddedEngine
from lorafleet.sync.files import LocalStaging
from lorafleet.sync.syncer import AdapterSyncer
from tests.sync._helpers import new_adapter, randomize, tiny_stack, train_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = RolloutParams(max_tokens=6, temperature=0.0, stop_token_ids=())


@pytest.mark.parametrize("mode", ["tensor", "files"])
def test_each_version_matches_the_trainer_and_the_old_one_is_unloaded(tmp_path, mode):
    stack = tiny_stack()
    engine = EmbeddedEngine(stack.sampler, staging=LocalStaging(tmp_path / "staging"))
    syncer = AdapterSyncer(engine, stack.trainer, mode=mode)
    slot = new_adapter(stack.trainer, 1, randomized=False)
    fresh = syncer.sync("a", slot)
    assert fresh.version == AdapterVersion("a", 0) and fresh.canary.differs_check.startswith(
        "skipped"
    )
    for step in range(1, 4):
        train_step(stack.trainer, slot, [3, 9, 27, 81, 50, 7, 11], lr=0.05)
        report = syncer.sync("a", slot)
        assert report.version == AdapterVersion("a", step)
        assert report.retired == AdapterVersion("a", step - 1)
        assert report.canary.differs_check == "passed"
        assert report.canary.max_abs_diff <= 1e-4 < report.canary.base_diff
        assert engine.current("a") == report.version
        assert stack.versions.resident() == [("a", step)]  # the previous version is gone
    staged = sorted(p.name for p in (tmp_path / "staging").iterdir()) if mode == "files" else []
    assert staged == (["a@3"] if mode == "files" else [])


def test_files_are_private_and_published_whole(tmp_path):
    stack = tiny_stack()
    engine = EmbeddedEngine(stack.sampler, staging=LocalStaging(tmp_path / "staging"))
    syncer = AdapterSyncer(engine, stack.trainer, mode="files")
    syncer.sync("a", new_adapter(stack.trainer, 2))
    root = tmp_path / "staging"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    version_dir = root / "a@0"
    assert stat.S_IMODE(version_dir.stat().st_mode) == 0o700
    files = sorted(p.name for p in version_dir.iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]  # no temp leftovers
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in version_dir.iterdir())


def test_requests_must_name_their_adapter():
    with pytest.raises(ValueError, match="adapter must be an AdapterVersion, or BASE"):
        RolloutRequest([1, 2, 3], None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        RolloutRequest([1, 2, 3])  # type: ignore[call-arg]


def test_rollouts_run_the_version_they_name_and_say_so():
    stack = tiny_stack()
    engine = EmbeddedEngine(stack.sampler)
    syncer = AdapterSyncer(engine, stack.trainer, mode="tensor")
    slot_a, slot_b = new_adapter(stack.trainer, 1), new_adapter(stack.trainer, 2)
    va, vb = syncer.sync("a", slot_a).version, syncer.sync("b", slot_b).version
    prompt = [5, 17, 33, 2, 71]
    results = engine.generate(
        [
            RolloutRequest(prompt, va, GREEDY),
            RolloutRequest(prompt, vb, GREEDY),
            RolloutRequest(prompt, BASE, GREEDY),
        ]
    )
    assert [r.served_by for r in results] == ["a@0", "b@0", None]
    assert results[0].tokens != results[2].tokens or results[1].tokens != results[2].tokens
    with pytest.raises(RolloutEngineError, match="unknown_version"):
        engine.generate([RolloutRequest(prompt, AdapterVersion("a", 7), GREEDY)])


def test_a_version_in_flight_is_unloaded_only_when_its_requests_finish():
    stack = tiny_stack()
    engine = EmbeddedEngine(stack.sampler)
    syncer = AdapterSyncer(engine, stack.trainer, mode="tensor")
    slot = new_adapter(stack.trainer, 1)
    v0 = syncer.sync("a", slot).version
    with engine._inflight.track([v0.name]):  # a rollout on v0 is still running
        randomize(stack.trainer, slot, 9)
        v1 = syncer.sync("a", slot).version
        assert engine.current("a") == v1
        assert set(stack.versions.resident()) == {v0.key, v1.key}  # v0 still served
        assert engine._inflight.pending() == ["a@0"]
    assert stack.versions.resident() == [v1.key]


@pytest.mark.parametrize("breakage", ["zeroed", "wrong_slot", "stale"])
def test_a_broken_sync_raises_and_is_withdrawn(breakage, monkeypatch):
    stack = tiny_stack()
    engine = EmbeddedEngine(stack.sampler)
    syncer = AdapterSyncer(engine, stack.trainer, mode="tensor")
    slot, other = new_adapter(stack.trainer, 1), new_adapter(stack.trainer, 2)
    good = syncer.sync("a", slot).version
    randomize(stack.trainer, slot, 5)
    store = stack.versions
    real_publish = store.publish

    def broken(adapter_id, source, source_slot, *, version=None, path=None):
        if breakage == "wrong_slot":
            return real_publish(adapter_id, source, other, version=version, path=path)
        if breakage == "stale":  # the sampler "loads" the previous version's weights again
            key = real_publish(adapter_id, source, source_slot, version=version, path=path)
            with torch.no_grad():
                store.bank.params[store.info(key).slot].copy_(
                    store.bank.params[store.info(good.key).slot]
                )
            return key
        key = real_publish(adapter_id, source, source_slot, version=version, path=path)
        with torch.no_grad():
            store.bank.params[store.info(key).slot].zero_()
        return key

    monkeypatch.setattr(store, "publish", broken)
    match = "equal its base" if breakage == "zeroed" else "canary mismatch"
    with pytest.raises(
        SyncVerificationError,
        match=match if breakage != "zeroed" else "canary mismatch|equal its base",
    ):
        syncer.sync("a", slot)
    assert engine.current("a") == good  # rollouts keep the last verified version
    assert store.resident() == [good.key]


def test_merged_is_refused_by_a_multi_adapter_sampler():
    stack = tiny_stack()
    with pytest.raises(UnsupportedSyncModeError, match="cannot sync by 'merged'"):
        AdapterSyncer(EmbeddedEngine(stack.sampler), stack.trainer, mode=SyncMode.MERGED)


def test_an_engine_on_another_base_model_is_refused():
    stack, other = tiny_stack(), tiny_stack()
    with torch.no_grad():
        for p in other.adapted.model.parameters():
            p.mul_(1.01)
    with pytest.raises(SyncVerificationError, match="not running the trainer's base model"):
        AdapterSyncer(EmbeddedEngine(other.sampler), stack.trainer, mode="tensor")


def test_offload_releases_the_cache_and_wake_reverifies():
    stack = tiny_stack()
    engine = EmbeddedEngine(stack.sampler)
    syncer = AdapterSyncer(engine, stack.trainer, mode="tensor")
    slot = new_adapter(stack.trainer, 1)
    syncer.sync("a", slot)
    randomize(stack.trainer, slot, 8)  # training moved on; the served version must not
    syncer.release(1)
    with pytest.raises(RuntimeError, match="offloaded"):
        syncer.sync("a", slot)
    reports = syncer.resume()
    assert [r.version.name for r in reports] == ["a@0"] and reports[0].differs_check == "passed"
    # Corrupt the served copy while offloaded: the wake-up canary must notice.
    syncer.release(2)
    with torch.no_grad():
        stack.versions.bank.params[stack.versions.info(("a", 0)).slot].mul_(0.5)
    with pytest.raises(SyncVerificationError, match="canary mismatch"):
        syncer.resume()
