"""The prefix cache's roots stay bounded by the versions that exist: every save of an RL run is a
new version key, so a cache that kept one root (and the version's record) per key ever sampled,
and the dead KV of dropped versions until the LRU reached it, would grow for the life of the
server."""

from __future__ import annotations

import gc
import weakref

import pytest

from lorafleet.model.banks import AdapterSpec
from lorafleet.sample import SampleEngine, SampleRequest, SamplingParams
from tests.sample.test_engine import make_stack, prompt, randomize

SEEDED = SamplingParams(max_tokens=6, temperature=1.0, seed=7, stop=[])

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_versions_dropped_for_good_leave_no_root_record_or_blocks_behind():
    stack, _ = make_stack(0)
    slot = stack.trainer.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=3))
    randomize(stack, slot, seed=11)
    e = SampleEngine(stack.adapted, stack.versions)
    records = []
    for version in range(3):  # each save a new key, retired once the next one exists
        key = stack.versions.publish("rl", stack.trainer.bank, slot, version=version)
        records.append(weakref.ref(stack.versions.info(key)))
        e.generate([SampleRequest(prompt(version, 40), SEEDED, adapter=key)])
        stack.versions.retire(key)  # unpinned: dropped at once
    live = stack.versions.publish("rl", stack.trainer.bank, slot, version=3)
    (result,) = e.generate([SampleRequest(prompt(9, 40), SEEDED, adapter=live)])
    assert result.ok
    gc.collect()
    assert all(ref() is None for ref in records)  # the cache does not keep dropped records alive
    stats = e.prefix_cache.stats()
    assert stats["inserts"] == 8  # 40 prompt + 5 sampled positions: 2 blocks per version
    assert stats["invalidated"] == 6 and stats["blocks"] == 2  # only the live version's KV
    assert stats["bytes"] == sum(block.nbytes for block in e.prefix_cache.blocks())
    # the live version still hits its own blocks
    e.generate([SampleRequest(prompt(9, 40), SEEDED, adapter=live)])
    assert e.prefix_cache.stats()["hit_tokens"] == 32


def test_a_version_key_without_its_record_is_refused():
    from lorafleet.sample.prefix_cache import PrefixCache

    with pytest.raises(ValueError, match=r"\('a', 0\)"):
        PrefixCache(1024).root(("a", 0), None)
