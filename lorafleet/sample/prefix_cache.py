"""KV blocks of prompt prefixes, kept across requests so a prompt that repeats one computes only
its new tokens.

Multi-turn and agentic sampling resends the whole conversation every turn, and every tenant
repeats its system prompt: without a cache the sampler prefills the same prefixes again and
again. As in vLLM, a sequence's tokens are cut into fixed blocks of `block_tokens`; a block is
found by its parent block and its own token ids, so a block stands for its whole prefix (a chain
hashed over the token ids; the dict compares the ids themselves, so two prefixes never collide).

The chain starts at a root per (adapter, version) record: KV computed under one version is never
used for another, nor for the base model (its own root). A version that is dropped and
published again under the same key is a new record of the version store, so it gets a new root
(roots are never reused), and the old root's blocks are dropped with it. Records are held
weakly: a version dropped for good (retired, past retention: a new key every save) leaves no
entry behind, and its blocks, which can never match again, are dropped when the next version's
root is made, so neither the roots nor dead KV grow with the number of versions ever sampled.

Blocks are private to whoever computed them. A request carries a `cache_salt` (the server
sets it to the tenant, as vLLM's `cache_salt`), and a block is found by its salt as well as its
parent and tokens, so a tenant's prompt never hits another tenant's blocks, and the time a
request takes, or the counters it moves, say nothing about what others sent: the side channel
is closed by construction, not by noise. The one exception is a declared public prefix (an
operator's system prompt, `public` on the request): the full blocks of a prompt that lie
within a public prefix are kept under the empty salt and shared; the blocks after them go back
to the request's own salt. The counters are kept per salt too (`PrefixCacheStats.tenants`),
so a tenant reads its own hits and nobody else's.

Only full blocks are cached. The engine never looks up a prompt's last token (its logits are
needed to sample), nor any position whose logits a request reads (prompt log-probs, top-k,
targets, alternatives): those requests hit at most up to their first scored position.

Bounded by bytes and evicted least recently used, leaves first: each lookup or insert touches
its chain from the leaf up, so a parent is always more recently used than its children, the
oldest block is always a leaf, and eviction never leaves a chain with a hole.

Used by the engine's step (one thread at a time); the lock keeps `stats` (read by the server's
stats thread) consistent.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lorafleet.sample.types import VersionKey

DEFAULT_BLOCK_TOKENS = 16
DEFAULT_TOKENS_PER_ROW = 512  # default budget: this many tokens of KV per sampler row

# Reads the KV of positions [start, stop) of the row just computed: (keys, values), each
# [layers, kv_heads, stop - start, head_dim].
KVReader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
PUBLIC = ""  # the salt of blocks anyone may hit: unsalted requests, declared public prefixes


def public_length(tokens: Sequence[int], public: Sequence[Sequence[int]], block: int) -> int:
    """How many leading tokens of `tokens` lie within a declared public prefix, in full
    blocks: the longest common prefix with any of `public`, rounded down to `block`. Any
    prefix of a public text is public too, so a prompt whose tokenization departs from the
    declared one near its end still shares the blocks before that."""
    best = 0
    for prefix in public:
        n = min(len(prefix), len(tokens))
        same = 0
        while same < n and tokens[same] == prefix[same]:
            same += 1
        best = max(best, same)
    return best - best % block


@dataclass(frozen=True)
class TenantPrefixCounters:
    """One salt's (tenant's) own use of the cache: what its prefills hit and computed, and the
    blocks it added."""

    lookups: int = 0
    hit_tokens: int = 0
    missed_tokens: int = 0
    inserts: int = 0

    def plus(self, other: TenantPrefixCounters) -> TenantPrefixCounters:
        return TenantPrefixCounters(
            self.lookups + other.lookups,
            self.hit_tokens + other.hit_tokens,
            self.missed_tokens + other.missed_tokens,
            self.inserts + other.inserts,
        )

    def as_dict(self) -> dict[str, object]:
        total = self.hit_tokens + self.missed_tokens
        return {
            "lookups": self.lookups,
            "hit_tokens": self.hit_tokens,
            "missed_tokens": self.missed_tokens,
            "hit_rate": self.hit_tokens / total if total else 0.0,
            "inserts": self.inserts,
        }


@dataclass(frozen=True)
class PrefixCacheStats:
    """A prefix cache's counters and size (`Sampler.prefix_cache_stats`, read by the server's
    stats and /metrics); `combined` adds up several replicas' caches."""

    enabled: bool
    block_tokens: int
    max_bytes: int
    bytes: int
    blocks: int
    lookups: int
    hit_tokens: int
    missed_tokens: int
    inserts: int
    evictions: int
    invalidated: int
    # per salt (the server's tenants; "" for unsalted use): what a tenant's own view shows
    tenants: dict[str, TenantPrefixCounters] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        total = self.hit_tokens + self.missed_tokens
        return self.hit_tokens / total if total else 0.0

    @classmethod
    def combined(cls, parts: Sequence[PrefixCacheStats]) -> PrefixCacheStats | None:
        """The sum over `parts` (e.g. one per Ray sampler replica); None when there is none.
        Enabled when any part is; `block_tokens` is the parts' own when they agree, else 0."""
        if not parts:
            return None
        sizes = {p.block_tokens for p in parts}
        tenants: dict[str, TenantPrefixCounters] = {}
        for part in parts:
            for salt, counts in part.tenants.items():
                tenants[salt] = tenants.get(salt, TenantPrefixCounters()).plus(counts)
        return cls(
            enabled=any(p.enabled for p in parts),
            block_tokens=sizes.pop() if len(sizes) == 1 else 0,
            max_bytes=sum(p.max_bytes for p in parts),
            bytes=sum(p.bytes for p in parts),
            blocks=sum(p.blocks for p in parts),
            lookups=sum(p.lookups for p in parts),
            hit_tokens=sum(p.hit_tokens for p in parts),
            missed_tokens=sum(p.missed_tokens for p in parts),
            inserts=sum(p.inserts for p in parts),
            evictions=sum(p.evictions for p in parts),
            invalidated=sum(p.invalidated for p in parts),
            tenants=tenants,
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "enabled": self.enabled,
            "block_tokens": self.block_tokens,
            "max_bytes": self.max_bytes,
            "bytes": self.bytes,
            "blocks": self.blocks,
            "lookups": self.lookups,
            "hit_tokens": self.hit_tokens,
            "missed_tokens": self.missed_tokens,
            "hit_rate": self.hit_rate,
            "inserts": self.inserts,
            "evictions": self.evictions,
            "invalidated": self.invalidated,
            "tenants": {salt: c.as_dict() for salt, c in sorted(self.tenants.items())},
        }

    def tenant_view(self, salt: str) -> dict[str, object]:
        """What one tenant may read: whether the cache is on, its block size and its own
        counters; nothing about the cache's contents or other tenants' use (bytes, blocks and
        evictions move with what others send)."""
        own = self.tenants.get(salt, TenantPrefixCounters())
        return {"enabled": self.enabled, "block_tokens": self.block_tokens, **own.as_dict()}


@dataclass(eq=False)
class Block:
    """`block_tokens` positions of KV, valid only after its parent's prefix."""

    id: int
    root: int
    parent: int  # the parent block's id, or the root for a chain's first block
    tokens: tuple[int, ...]
    salt: str  # who may hit it (PUBLIC: anyone)
    keys: torch.Tensor  # [layers, kv_heads, block_tokens, head_dim]
    values: torch.Tensor
    children: int = 0

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + (
            self.values.numel() * self.values.element_size()
        )


@dataclass
class PrefixCacheCounters:
    lookups: int = 0
    hit_tokens: int = 0
    missed_tokens: int = 0  # prompt tokens computed by prefills
    inserts: int = 0  # blocks added
    evictions: int = 0  # blocks dropped for the byte budget
    invalidated: int = 0  # blocks of versions dropped or published again


class PrefixCache:
    """Full KV blocks of seen prefixes, per (adapter, version) record, bounded by `max_bytes`
    (0 disables: nothing is kept, every lookup misses, the counters still count prefills)."""

    def __init__(self, max_bytes: int, *, block_tokens: int = DEFAULT_BLOCK_TOKENS):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be an integer >= 0, got {max_bytes!r}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens!r}")
        self.max_bytes = max_bytes
        self.block_tokens = block_tokens
        self.counters = PrefixCacheCounters()
        self._tenants: dict[str, TenantPrefixCounters] = {}
        self._lock = threading.Lock()
        self._next_id = 1
        self._base_root = self._new_id()
        # key -> (the version store's record it was computed under, held weakly; its root)
        self._roots: dict[VersionKey, tuple[weakref.ref[object], int]] = {}
        self._table: dict[tuple[str, int, tuple[int, ...]], Block] = {}
        self._lru: OrderedDict[int, Block] = OrderedDict()  # oldest first
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    # ------------------------------------------------------------------ roots
    def root(self, key: VersionKey | None, record: object | None) -> int:
        """The chain seed for version `key` as the store holds it now (`record`: its record
        object, compared by identity and held weakly; None for the base model)."""
        if key is None:
            return self._base_root
        if record is None:
            raise ValueError(f"prefix cache: version {key!r} needs its version-store record")
        with self._lock:
            entry = self._roots.get(key)
            if entry is not None and entry[0]() is record:
                return entry[1]
            root = self._new_id()
            self._roots[key] = (weakref.ref(record), root)
            # A new version: forget the roots of versions the store let go of since (their
            # records are gone), and the one this key had before, with their blocks.
            dead = {r for k, (ref, r) in self._roots.items() if ref() is None}
            for k in [k for k, (_, r) in self._roots.items() if r in dead]:
                del self._roots[k]
            if entry is not None:
                dead.add(entry[1])
            if dead:
                self._drop_roots(dead)
            return root

    def _drop_roots(self, roots: set[int]) -> None:
        stale = [b for b in self._lru.values() if b.root in roots]
        for block in sorted(stale, key=lambda b: -b.id):  # children were created after parents
            self._remove(block)
            self.counters.invalidated += 1

    # ------------------------------------------------------------------ lookups
    def lookup(
        self,
        root: int,
        tokens: Sequence[int],
        limit: int,
        salt: str = PUBLIC,
        public: Sequence[Sequence[int]] = (),
    ) -> list[Block]:
        """The cached blocks covering the longest cached prefix of `tokens[:limit]` (full
        blocks only) that `salt` may hit (its own, and public ones within a `public` prefix),
        touched as used. Counts nothing: the engine counts what it prefills."""
        if not self.enabled or limit < self.block_tokens:
            return []
        size = self.block_tokens
        shared = public_length(tokens, public, size) if salt != PUBLIC else 0
        found: list[Block] = []
        parent = root
        with self._lock:
            for start in range(0, limit - size + 1, size):
                owner = PUBLIC if start + size <= shared else salt
                block = self._table.get((owner, parent, tuple(tokens[start : start + size])))
                if block is None:
                    break
                found.append(block)
                parent = block.id
            self._touch(found)
        return found

    def record(self, hit_tokens: int, missed_tokens: int, salt: str = PUBLIC) -> None:
        """One prefill of a prompt: `hit_tokens` came from the cache, the rest were computed."""
        with self._lock:
            self.counters.lookups += 1
            self.counters.hit_tokens += hit_tokens
            self.counters.missed_tokens += missed_tokens
            self._count(salt, TenantPrefixCounters(1, hit_tokens, missed_tokens, 0))

    def _count(self, salt: str, counts: TenantPrefixCounters) -> None:
        self._tenants[salt] = self._tenants.get(salt, TenantPrefixCounters()).plus(counts)

    # ------------------------------------------------------------------ inserts
    def insert(
        self,
        root: int,
        tokens: Sequence[int],
        read: KVReader,
        salt: str = PUBLIC,
        public: Sequence[Sequence[int]] = (),
    ) -> int:
        """Caches the full blocks of `tokens` (whose KV `read` gives) that are not cached yet,
        under `salt` (PUBLIC within a `public` prefix); returns how many were added. Reads the
        KV of the new blocks only, in one span."""
        if not self.enabled:
            return 0
        size = self.block_tokens
        full = len(tokens) // size
        shared = public_length(tokens, public, size) if salt != PUBLIC else 0

        def owner(i: int) -> str:
            return PUBLIC if (i + 1) * size <= shared else salt

        with self._lock:
            chain: list[Block] = []
            parent = root
            first_new = full
            for i in range(full):
                key = (owner(i), parent, tuple(tokens[i * size : (i + 1) * size]))
                block = self._table.get(key)
                if block is None:
                    first_new = i
                    break
                chain.append(block)
                parent = block.id
            if first_new < full:
                keys, values = read(first_new * size, full * size)
                for i in range(first_new, full):
                    span = slice((i - first_new) * size, (i - first_new + 1) * size)
                    block = Block(
                        id=self._new_id(),
                        root=root,
                        parent=parent,
                        tokens=tuple(tokens[i * size : (i + 1) * size]),
                        salt=owner(i),
                        keys=keys[:, :, span].clone(),
                        values=values[:, :, span].clone(),
                    )
                    self._add(block)
                    chain.append(block)
                    parent = block.id
            self._touch(chain)
            self._evict()
            self._count(salt, TenantPrefixCounters(inserts=full - first_new))
            return full - first_new

    def _add(self, block: Block) -> None:
        parent = self._lru.get(block.parent)
        if parent is not None:
            parent.children += 1
        self._table[(block.salt, block.parent, block.tokens)] = block
        self._lru[block.id] = block
        self._bytes += block.nbytes
        self.counters.inserts += 1

    def _remove(self, block: Block) -> None:
        del self._table[(block.salt, block.parent, block.tokens)]
        del self._lru[block.id]
        self._bytes -= block.nbytes
        parent = self._lru.get(block.parent)
        if parent is not None:
            parent.children -= 1

    def _touch(self, chain: list[Block]) -> None:
        """Leaf first, so each parent ends up more recent than its children."""
        for block in reversed(chain):
            self._lru.move_to_end(block.id)

    def _evict(self) -> None:
        while self._bytes > self.max_bytes and self._lru:
            oldest = next(iter(self._lru.values()))
            if oldest.children:  # cannot happen (see the module docstring); never leave a hole
                raise RuntimeError("prefix cache: the least recently used block has children")
            self._remove(oldest)
            self.counters.evictions += 1

    def clear(self) -> None:
        """Drops every block (the counters stay): e.g. a benchmark's fresh start."""
        with self._lock:
            self._table.clear()
            self._lru.clear()
            self._bytes = 0

    # ------------------------------------------------------------------ report
    def report(self) -> PrefixCacheStats:
        with self._lock:
            c = self.counters
            return PrefixCacheStats(
                enabled=self.enabled,
                block_tokens=self.block_tokens,
                max_bytes=self.max_bytes,
                bytes=self._bytes,
                blocks=len(self._lru),
                lookups=c.lookups,
                hit_tokens=c.hit_tokens,
                missed_tokens=c.missed_tokens,
                inserts=c.inserts,
                evictions=c.evictions,
                invalidated=c.invalidated,
                tenants=dict(self._tenants),
            )

    def stats(self) -> dict[str, object]:
        return self.report().as_dict()

    def blocks(self) -> list[Block]:
        """Every cached block, least recently used first (tests, operator views)."""
        with self._lock:
            return list(self._lru.values())
