"""The paging policy every cached bank shares: least recently used among what may leave, and
counters that add up (what a tier holds is what went in minus what went out)."""

from __future__ import annotations

from lorafleet.model.paging import PagingCounters, Recency


def test_oldest_is_the_least_recently_used_candidate():
    recency: Recency[str] = Recency()
    for key in "abcd":
        recency.touch(key)
    recency.touch("a")  # used again: now the newest
    assert recency.order() == ["b", "c", "d", "a"]
    assert recency.oldest(["a", "c", "d"]) == "c"
    assert recency.oldest(["a"]) == "a"
    assert recency.oldest([]) is None
    recency.forget("c")
    assert "c" not in recency and len(recency) == 3
    assert recency.oldest(["c", "b"]) == "c"  # never touched (or forgotten): oldest of all


def test_counters_follow_entries_across_tiers():
    counters = PagingCounters()
    counters.added("hot", 100)
    counters.added("hot", 100)
    counters.moved("hot", "warm", released=100, held=80)
    counters.moved("warm", "cold", released=80, held=120)
    counters.miss()
    counters.moved("cold", "hot", released=120, held=100)
    counters.hit()
    counters.removed("hot", 100)
    report = counters.as_dict()
    assert report["hits"] == 1 and report["misses"] == 1
    assert report["page_outs"] == {"warm": 1, "cold": 1}
    assert report["page_ins"] == {"warm": 0, "cold": 1}
    assert report["bytes_out"] == {"warm": 80, "cold": 120}
    assert report["bytes_in"] == {"warm": 0, "cold": 120}
    assert report["bytes_held"] == {"hot": 100, "warm": 0, "cold": 0}
