"""One paging policy for every bank whose slots are a cache.

Two banks hold more entries than they have slots: the trainer's (training runs: hot in a slot,
warm in host memory, cold on disk; `lorafleet.server.engine.live_models`) and the sampler's (published
versions: resident in a slot, or reloaded from their files; `lorafleet.sample.versions`). Both
ask the same question when a slot is needed (which entry leaves: the least recently used one
that nothing is using) and report the same counters, so that an operator reads one set of
numbers for both. The policy knows keys and recency only; which entries may leave (pinned by
running sequences, queued work) is the caller's to say, since only the caller knows.

Not thread-safe on its own: each user calls it under the lock that guards its own table.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

__all__ = ["TIERS", "PagingCounters", "Recency", "Tier"]

Tier = Literal["hot", "warm", "cold"]
TIERS: tuple[Tier, ...] = ("hot", "warm", "cold")
"""hot: in a bank slot; warm: in host memory; cold: on disk (a sampler version's files count as
cold: it reloads from them)."""

K = TypeVar("K", bound=Hashable)


class Recency(Generic[K]):
    """Keys in order of last use. An entry touched on every use (and on creation) makes
    `oldest` the least recently used of any set of candidates."""

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def touch(self, key: K) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def forget(self, key: K) -> None:
        self._order.pop(key, None)

    def oldest(self, candidates: Iterable[K]) -> K | None:
        """The least recently used of `candidates` (one never touched counts as oldest of
        all); None when there are none."""
        wanted = set(candidates)
        if not wanted:
            return None
        for key in wanted:
            if key not in self._order:
                return key
        for key in self._order:
            if key in wanted:
                return key
        raise AssertionError("unreachable: every candidate is in the order")

    def order(self) -> list[K]:
        """Oldest first."""
        return list(self._order)


def _tier_counter() -> Counter[str]:
    return Counter({tier: 0 for tier in TIERS})


@dataclass
class PagingCounters:
    """What a paged bank did since the process started, and what it holds now.

    `hits`/`misses`: uses that found the entry in a slot / had to page it in first.
    `page_ins[tier]`: entries brought into a slot from `tier`; `page_outs[tier]`: entries moved
    out to `tier` ("cold" for a sampler version means "reloadable from its files"; `dropped`
    counts versions evicted with nothing to reload from). `bytes_in`/`bytes_out` are the bytes
    those moves carried, and `held[tier]` the bytes each tier holds now."""

    hits: int = 0
    misses: int = 0
    page_ins: Counter[str] = field(default_factory=_tier_counter)
    page_outs: Counter[str] = field(default_factory=_tier_counter)
    bytes_in: Counter[str] = field(default_factory=_tier_counter)
    bytes_out: Counter[str] = field(default_factory=_tier_counter)
    held: Counter[str] = field(default_factory=_tier_counter)
    dropped: int = 0

    def hit(self) -> None:
        self.hits += 1

    def miss(self) -> None:
        self.misses += 1

    def added(self, tier: Tier, nbytes: int) -> None:
        """A new entry now lives in `tier` (created, published, registered)."""
        self.held[tier] += nbytes

    def removed(self, tier: Tier, nbytes: int) -> None:
        """An entry left `tier` for good (unloaded, dropped)."""
        self.held[tier] -= nbytes

    def moved(self, source: Tier, dest: Tier, *, released: int, held: int) -> None:
        """An entry went from `source`, where it held `released` bytes, to `dest`, where it
        holds `held` (a slot, host copies and files differ in size). A page-in carried what the
        source held; a page-out, what the destination now holds."""
        if dest == "hot":
            self.page_ins[source] += 1
            self.bytes_in[source] += released
        else:
            self.page_outs[dest] += 1
            self.bytes_out[dest] += held
        self.removed(source, released)
        self.added(dest, held)

    def as_dict(self) -> dict[str, Any]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "page_ins": {tier: self.page_ins[tier] for tier in TIERS if tier != "hot"},
            "page_outs": {tier: self.page_outs[tier] for tier in TIERS if tier != "hot"},
            "bytes_in": {tier: self.bytes_in[tier] for tier in TIERS if tier != "hot"},
            "bytes_out": {tier: self.bytes_out[tier] for tier in TIERS if tier != "hot"},
            "bytes_held": {tier: self.held[tier] for tier in TIERS},
            "dropped": self.dropped,
        }
