"""How a training call's items become model inputs: shared-prefix groups, micro-batches, rows.

RL batches repeat each prompt once per sample of its group, and prompts are most of the tokens.
Items of one adapter slot that start with the same tokens form a `Unit` that runs its shared
prefix once: a first forward over group prefixes (and over items that share nothing, whole),
then a second forward over each member's suffix against its group's KV cache. The cache keeps
autograd, so every member's loss reaches the adapter through the one shared prefix, and each
slot's gradient is exactly what running its items one by one would give (up to rounding).

Every position of every item maps to one row of the flattened final hidden states
(`Layout.positions`); members of a group point at the same rows for their prefix positions.
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
    """Items that run together: one item alone (`prefix` 0), or >= 2 items of one slot whose
    first `prefix` tokens are equal (each member keeps at least one token of its own)."""

    items: tuple[int, ...]
    prefix: int = 0


def singles(count: int) -> list[Unit]:
    return [Unit((i,)) for i in range(count)]


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


def find_groups(
    slots: Sequence[int], tokens: Sequence[torch.Tensor], min_prefix: int = MIN_SHARED_PREFIX
) -> list[Unit]:
    """Splits items into units that maximise the prompt tokens saved, (members - 1) x prefix.

    Items sorted by (slot, tokens) put every set of items with a common prefix next to each
    other. A run of sorted items either shares the longest prefix common to all of it, or splits
    where its neighbours' common prefix is shortest (e.g. a system prompt common to every item)
    into runs that share longer ones (each sampling group's whole prompt); whichever saves more.
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
        whole = (len(members) - 1) * prefix if prefix >= min_prefix else 0
        best[lo, hi] = [Unit(members, prefix)] if whole > _saved(split) else split
    return best[0, len(order)] if order else []


def _saved(units: Sequence[Unit]) -> int:
    return sum((len(u.items) - 1) * u.prefix for u in units)


def tokens_run(units: Sequence[Unit], lengths: Sequence[int]) -> int:
    """Padded tokens the model runs for these units in one micro-batch (both forwards)."""
    first = [u.prefix or lengths[u.items[0]] for u in units]
    second = [lengths[i] - u.prefix for u in units if u.prefix for i in u.items]
    return len(first) * max(first, default=0) + len(second) * max(second, default=0)


def resolve(units: Sequence[Unit], lengths: Sequence[int]) -> list[Unit]:
    """The units as they will run: groups dissolve into single items when padding makes sharing
    cost more tokens than not (prefixes of very different lengths side by side). So a
    micro-batch never runs more tokens than the plain layout of its items."""
    plain = [Unit((i,)) for u in units for i in u.items]
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
    if not unit.prefix or tokens_run([unit], lengths) <= token_budget:
        return [unit]
    chunks: list[list[int]] = [[]]
    for item in sorted(unit.items, key=lambda i: -lengths[i]):
        if (
            chunks[-1]
            and tokens_run([Unit((*chunks[-1], item), unit.prefix)], lengths) > token_budget
        ):
            chunks.append([])
        chunks[-1].append(item)
    return [Unit(tuple(c), unit.prefix if len(c) > 1 else 0) for c in chunks]


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
    members = [(row, i) for row, u in enumerate(units) if u.prefix for i in u.items]
    second = [tokens[i][units[row].prefix :] for row, i in members]
    second_rows = None
    if members:
        second_rows = _cached_rows(
            second,
            [slots[i] for _, i in members],
            cache_width=first_rows.input_ids.shape[1],
            prefixes=[units[row].prefix for row, _ in members],
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
    for k, (row, i) in enumerate(members):
        shared = torch.arange(starts[row], starts[row + 1])
        own = torch.arange(starts[len(units) + k], starts[len(units) + k + 1])
        positions[i] = torch.cat([shared, own])
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
