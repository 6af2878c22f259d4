"""How a training call's items become model inputs: shared-prefix groups, micro-batches, rows.

RL batches repeat each prompt once per sample of its group, and prompts are most of the tokens.
Items of one adapter slot that start with the same tokens form a `Unit` that runs its shared
prefix once: a first forward over group prefixes (and over items that share nothing, whole),
then a second forward over each member's suffix against its group's KV cache. The cache keeps
autograd, so every member's loss reaches the adapter through the one shared prefix, and each
slot's gradient is exactly what running its items one by one would give (up to rounding).

A unit can also be a *stem*: its longest item runs whole in the first forward, and each other
member continues that row's cache from where its own tokens leave it (the turns of one
conversation, see prefix_trie.py). Every position of every item maps to one row of the
flattened final hidden states (`Layout.positions`); members of a group or stem point at the same
rows for the positions they share, and an item nested in another (a turn inside a later turn)
rides on it: it runs nothing and points at its host's first rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIN_SHARED_PREFIX = 16
"""Shortest prefix worth sharing (a heuristic): a second forward has a fixed cost per layer that
a few shared tokens do not repay."""


@dataclass(frozen=True)
class Unit:
    """Items of one slot that run together, in one of three forms:

    - one item alone (`prefix` 0, no `depths`);
    - a group (`prefix` > 0): a first-forward row of the first `prefix` tokens of `items[0]`,
      which every member continues in the second forward after its first `depths[k]` tokens
      (all `prefix` when `depths` is empty; each member keeps at least one token of its own);
    - a stem (`prefix` 0, `depths` given): `items[0]` runs whole in the first forward, and each
      other item continues its row after the `depths[k]` tokens it shares with it (the turns of
      a conversation whose history was re-rendered: each shares most of the next turn).

    `riders` are (item, host) pairs: items whose tokens are a prefix of their host's (one of
    `items`, same slot), which run nothing and read the host's first rows (prefix_trie.py)."""

    items: tuple[int, ...]
    prefix: int = 0
    riders: tuple[tuple[int, int], ...] = ()
    depths: tuple[int, ...] = ()

    @property
    def members(self) -> tuple[int, ...]:
        """Every item whose loss this unit computes: those it runs, then its riders."""
        return self.items + tuple(rider for rider, _ in self.riders)

    def attached(self) -> tuple[tuple[int, int], ...]:
        """(item, depth) for each item of the second forward: it runs its tokens from `depth`
        on, against the first-forward row's cache of its first `depth` positions."""
        if self.prefix:
            depths = self.depths or (self.prefix,) * len(self.items)
            return tuple(zip(self.items, depths, strict=True))
        return tuple(zip(self.items[1:], self.depths, strict=True))

    def riders_of(self, hosts: Sequence[int]) -> tuple[tuple[int, int], ...]:
        return tuple(pair for pair in self.riders if pair[1] in hosts)


def singles(count: int) -> list[Unit]:
    return [Unit((i,)) for i in range(count)]


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


def find_groups(
    slots: Sequence[int], tokens: Sequence[torch.Tensor], min_prefix: int = MIN_SHARED_PREFIX
) -> list[Unit]:
    """Splits items into units that maximise the prompt tokens saved (`_saved`).

    Items sorted by (slot, tokens) put every set of items with a common prefix next to each
    other. A run of sorted items either shares as one unit, or splits where its neighbours'
    common prefix is shortest (e.g. a system prompt common to every item) into runs that share
    longer ones (each sampling group's whole prompt); whichever saves more. A run shares as a
    group (the prefix common to all of it, once), or as a stem (its longest item whole, each
    other item from where it leaves it) where that saves at least `min_prefix` more tokens: the
    turns of one conversation, each sharing more of the last turn than of the first.
    """
    order = sorted(range(len(tokens)), key=lambda i: (slots[i], tokens[i].tolist()))
    lengths = [int(t.numel()) for t in tokens]
    # lcp[j]: common prefix of order[j] and order[j + 1]; 0 across slots, so runs never mix them
    lcp = [
        _common_prefix(tokens[a], tokens[b]) if slots[a] == slots[b] else 0
        for a, b in itertools.pairwise(order)
    ]
    # Spans [lo, hi) of `order`, parents before children; then resolved children first.
    spans: list[tuple[int, int]] = []
    children: dict[tuple[int, int], list[tuple[int, int]]] = {}
    todo = [(0, len(order))]
    while todo:
        lo, hi = todo.pop()
        spans.append((lo, hi))
        if hi - lo < 2:
            continue
        low = min(lcp[lo : hi - 1])
        cuts = [lo] + [j + 1 for j in range(lo, hi - 1) if lcp[j] == low] + [hi]
        children[lo, hi] = list(itertools.pairwise(cuts))
        todo.extend(children[lo, hi])
    best: dict[tuple[int, int], list[Unit]] = {}
    for lo, hi in reversed(spans):
        members = tuple(order[lo:hi])
        if hi - lo < 2:
            best[lo, hi] = [Unit(members)]
            continue
        prefix = min(min(lcp[lo : hi - 1]), min(lengths[i] for i in members) - 1)
        split = [unit for child in children[lo, hi] for unit in best[child]]
        whole: list[Unit] = []
        if prefix >= min_prefix:
            group, stem = Unit(members, prefix), _stem(order, lcp, lengths, lo, hi)
            # the stem where members share more with the longest one than the common part
            deeper = _saved([stem]) - _saved([group]) >= min_prefix
            whole = [stem if deeper else group]
        best[lo, hi] = whole if _saved(whole) > _saved(split) else split
    return best[0, len(order)] if order else []


def _stem(
    order: Sequence[int], lcp: Sequence[int], lengths: Sequence[int], lo: int, hi: int
) -> Unit:
    """The span `order[lo:hi]` as a stem unit on its longest item: each other item's depth is
    its common prefix with the stem (the least `lcp` between them in sorted order), less one
    token if it would leave the item none of its own."""
    at = max(range(lo, hi), key=lambda j: (lengths[order[j]], -j))
    depth: dict[int, int] = {}
    common = lengths[order[at]]
    for j in range(at - 1, lo - 1, -1):  # lcp[j]: order[j] with order[j + 1]
        common = min(common, lcp[j])
        depth[order[j]] = min(common, lengths[order[j]] - 1)
    common = lengths[order[at]]
    for j in range(at + 1, hi):
        common = min(common, lcp[j - 1])
        depth[order[j]] = min(common, lengths[order[j]] - 1)
    others = [order[j] for j in range(lo, hi) if j != at]
    return Unit((order[at], *others), depths=tuple(depth[i] for i in others))


def _saved(units: Sequence[Unit]) -> int:
    """Tokens not run thanks to sharing, before padding: every attached item's shared depth,
    less the group's prefix row, which runs once."""
    return sum(sum(depth for _, depth in u.attached()) - u.prefix for u in units)


def tokens_run(units: Sequence[Unit], lengths: Sequence[int]) -> int:
    """Padded tokens the model runs for these units in one micro-batch (both forwards)."""
    first = [u.prefix or lengths[u.items[0]] for u in units]
    second = [lengths[i] - depth for u in units for i, depth in u.attached()]
    return len(first) * max(first, default=0) + len(second) * max(second, default=0)


def resolve(units: Sequence[Unit], lengths: Sequence[int]) -> list[Unit]:
    """The units as they will run: groups dissolve into single items when padding makes sharing
    cost more tokens than not (prefixes of very different lengths side by side). So a
    micro-batch never runs more tokens than the plain layout of its items."""
    plain = [Unit((i,), riders=u.riders_of((i,))) for u in units for i in u.items]
    return list(units) if tokens_run(units, lengths) < tokens_run(plain, lengths) else plain


def plan_units(
    units: Sequence[Unit], lengths: Sequence[int], token_budget: int
) -> list[list[Unit]]:
    """Micro-batches of whole units, each running <= token_budget padded tokens.

    Longest first, so rows of similar length pad together; a group too large for the budget is
    cut into smaller groups; a single item longer than the budget runs alone. With no group this
    is exactly `plan_microbatches`.
    """
    pieces = [piece for unit in units for piece in _fit(unit, lengths, token_budget)]
    pieces.sort(key=lambda u: -max(lengths[i] for i in u.items))
    batches: list[list[Unit]] = []
    current: list[Unit] = []
    for unit in pieces:
        if current and tokens_run(resolve([*current, unit], lengths), lengths) > token_budget:
            batches.append(resolve(current, lengths))
            current = []
        current.append(unit)
    if current:
        batches.append(resolve(current, lengths))
    return batches


def _fit(unit: Unit, lengths: Sequence[int], token_budget: int) -> list[Unit]:
    """A unit over the budget, cut into pieces that fit where they can: a stem keeps its first
    piece; every other piece is a group on the stem's first tokens (as deep as its deepest
    member needs), or a single item."""
    if len(unit.items) < 2 or tokens_run([unit], lengths) <= token_budget:
        return [unit]
    stem = () if unit.prefix else unit.items[:1]
    chunks: list[list[tuple[int, int]]] = [[]]
    for pair in sorted(unit.attached(), key=lambda p: -lengths[p[0]]):
        head = stem if len(chunks) == 1 else ()
        if (chunks[-1] or head) and tokens_run(
            [_piece(head, [*chunks[-1], pair], unit)], lengths
        ) > token_budget:
            chunks.append([])
        chunks[-1].append(pair)
    return [_piece(stem if k == 0 else (), chunk, unit) for k, chunk in enumerate(chunks)]


def _piece(stem: tuple[int, ...], pairs: Sequence[tuple[int, int]], unit: Unit) -> Unit:
    """Part of `unit`: its stem (if given) with attached `pairs`, or `pairs` as a group whose
    first row is the deepest member's shared tokens (the others share fewer of the same)."""
    items = [item for item, _ in pairs]
    riders = unit.riders_of([*stem, *items])
    if stem:
        return Unit((*stem, *items), 0, riders, tuple(d for _, d in pairs))
    if len(pairs) == 1:
        return Unit((items[0],), 0, riders)
    pairs = sorted(pairs, key=lambda p: -p[1])  # stable: a uniform group keeps its order
    prefix = pairs[0][1]
    depths = tuple(d for _, d in pairs)
    uniform = all(d == prefix for d in depths)
    return Unit(tuple(i for i, _ in pairs), prefix, riders, () if uniform else depths)


def plan_microbatches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Groups item indices so that rows x longest row <= token_budget per micro-batch (no
    prefix sharing). Longest first; an item longer than the budget gets a micro-batch alone."""
    return [
        [u.items[0] for u in batch]
        for batch in plan_units(singles(len(lengths)), lengths, token_budget)
    ]


@dataclass(frozen=True)
class Rows:
    """One forward's inputs: right-padded rows, each routed to its item's slot (padding too,
    so tokens arrive in slot order and the LoRA layers skip their gather/scatter)."""

    input_ids: torch.Tensor  # int64 [rows, width]
    attention_mask: torch.Tensor  # int64 [rows, cached + width]
    slot_ids: torch.Tensor  # int64 [rows, width]

    @property
    def real(self) -> torch.Tensor:
        """Bool [rows, width]: positions holding tokens (row-major order = hidden-state order)."""
        return self.attention_mask[:, -self.input_ids.shape[1] :].bool()


@dataclass(frozen=True)
class CachedRows(Rows):
    """Rows that extend the first forward's KV cache, so their positions do not start at 0."""

    position_ids: torch.Tensor  # int64 [rows, width]
    cache_rows: torch.Tensor  # int64 [rows]: the first-forward row whose cache each extends


@dataclass(frozen=True)
class Layout:
    """One micro-batch: the first forward (prefixes and lone items), the second (group members'
    suffixes, None when nothing is shared), and where each item's positions land among the
    flattened real positions of both (first forward's rows, then the second's)."""

    first: Rows
    second: CachedRows | None
    positions: dict[int, torch.Tensor]  # item index -> int64 [length]: hidden row per position
    hidden_slots: torch.Tensor  # int64 [hidden rows]: the slot of each hidden row
    tokens_run: int


def build_layout(
    slots: Sequence[int], tokens: Sequence[torch.Tensor], units: Sequence[Unit]
) -> Layout:
    """Rows for `units` (indices into `slots`/`tokens`), slot by slot."""
    units = sorted(units, key=lambda u: slots[u.items[0]])
    first = [tokens[u.items[0]][: u.prefix or None] for u in units]
    first_rows = _rows(first, [slots[u.items[0]] for u in units])
    attached = [(row, i, depth) for row, u in enumerate(units) for i, depth in u.attached()]
    members = [(row, i) for row, i, _ in attached]
    second = [tokens[i][depth:] for _, i, depth in attached]
    second_rows = None
    if members:
        second_rows = _cached_rows(
            second,
            [slots[i] for _, i in members],
            cache_width=first_rows.input_ids.shape[1],
            prefixes=[depth for _, _, depth in attached],
            cache_rows=[row for row, _ in members],
        )
    # Hidden rows: each first-forward row's real positions, then each second-forward row's.
    row_lengths = [s.numel() for s in first + second]
    starts = [0]
    for n in row_lengths:
        starts.append(starts[-1] + n)
    positions: dict[int, torch.Tensor] = {}
    for row, u in enumerate(units):
        if not u.prefix:
            positions[u.items[0]] = torch.arange(starts[row], starts[row + 1])
    for k, (row, i, depth) in enumerate(attached):
        shared = torch.arange(starts[row], starts[row] + depth)
        own = torch.arange(starts[len(units) + k], starts[len(units) + k + 1])
        positions[i] = torch.cat([shared, own])
    for u in units:
        for rider, host in u.riders:
            positions[rider] = positions[host][: tokens[rider].numel()]
    row_slots = [slots[u.items[0]] for u in units] + [slots[i] for _, i in members]
    hidden_slots = torch.repeat_interleave(torch.tensor(row_slots), torch.tensor(row_lengths))
    run = sum(rows.input_ids.numel() for rows in (first_rows, second_rows) if rows is not None)
    return Layout(first_rows, second_rows, positions, hidden_slots, run)


def _rows(
    seqs: Sequence[torch.Tensor],
    row_slots: Sequence[int],
    *,
    cache_width: int = 0,
    prefixes: Sequence[int] | None = None,
) -> Rows:
    """Right-pads `seqs`. Rows that extend a cache (`cache_width` columns, of which row r's first
    `prefixes[r]` are real) attend to its real prefix, never to its padding, and continue its
    positions."""
    width = max(s.numel() for s in seqs)
    input_ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    mask = torch.zeros(len(seqs), cache_width + width, dtype=torch.int64)
    for row, seq in enumerate(seqs):
        input_ids[row, : seq.numel()] = seq
        mask[row, cache_width : cache_width + seq.numel()] = 1
        if prefixes is not None:
            mask[row, : prefixes[row]] = 1
    slot_ids = (
        torch.tensor(list(row_slots), dtype=torch.int64)[:, None].expand(-1, width).contiguous()
    )
    return Rows(input_ids, mask, slot_ids)


def _cached_rows(
    seqs: Sequence[torch.Tensor],
    row_slots: Sequence[int],
    *,
    cache_width: int,
    prefixes: Sequence[int],
    cache_rows: Sequence[int],
) -> CachedRows:
    """`_rows` for rows that extend the cache rows `cache_rows`, positioned after their prefix."""
    rows = _rows(seqs, row_slots, cache_width=cache_width, prefixes=prefixes)
    width = rows.input_ids.shape[1]
    positions = torch.tensor(list(prefixes))[:, None] + torch.arange(width)
    return CachedRows(
        rows.input_ids,
        rows.attention_mask,
        rows.slot_ids,
        positions,
        torch.tensor(list(cache_rows)),
    )
