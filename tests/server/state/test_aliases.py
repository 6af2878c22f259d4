"""The aliases table: a tenant's names for its sampler paths, bounded per tenant."""

from __future__ import annotations

from lorafleet.server.state.store import Store


def test_aliases_are_bounded_per_tenant_and_repointing_one_is_not_a_new_one(store: Store):
    assert store.aliases.put("t1", "a", "tinker://x", 1.0, 2)
    assert store.aliases.put("t1", "b", "tinker://y", 2.0, 2)
    assert not store.aliases.put("t1", "c", "tinker://z", 3.0, 2)  # a third: refused
    assert store.aliases.put("t1", "a", "tinker://z", 4.0, 2)  # repointed
    assert store.aliases.put("t2", "a", "tinker://w", 5.0, 2)  # another tenant's own bound
    assert store.aliases.get("t1", "a") == ("tinker://z", 4.0)
    assert store.aliases.get("t1", "c") is None
    assert store.aliases.of_tenant("t1", 10) == [("a", "tinker://z", 4.0), ("b", "tinker://y", 2.0)]
    assert store.aliases.delete("t1", "a") and not store.aliases.delete("t1", "a")
