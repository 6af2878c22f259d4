"""Which items of a training call run at all, and which read another item's rows (nested prefixes).

Multi-turn RL data repeats itself as a trie: each turn's datum is the whole conversation so far
(turn 1 ⊂ turn 2 ⊂ ... of an episode), and episodes may share a system prompt or a group prompt
before they diverge. Under causal attention a position's hidden state depends only on the tokens
up to it, so an item whose tokens are a prefix of another item of the same slot needs no forward
of its own: its positions are the first positions of the longer item (a *rider* on a *host*).
Its loss is still its own (its targets, weights and advantages, at its own positions), and the
gradients of all items meeting at one hidden row add up there exactly as their separate runs
would.

The trie runs in the engine's two forwards (a first one over whole rows, a second over rows
that continue a first-forward row's KV cache, with autograd through it), in three parts:
- chains: every item that is a prefix of another rides on a leaf of its slot's trie (an item
  that prefixes no other), so a chain of turns runs as its longest member alone;
- stems: when the leaves of a branch each share more with the longest of them than with one
  another (a conversation whose renderer re-tokenizes each past action, so turn k diverges from
  turn k + 1 only at its own action), the longest runs whole and each other leaf runs only
  what follows the part it shares with it, against its cache at its own depth;
- groups: leaves that share one common part (a group prompt, a system prompt) run it once and
  their suffixes against its cache (`layout.find_groups` picks, per sorted run of leaves, the
  level, and group or stem, that saves the most).

Why not tree attention (every trie node's tokens once, in one row, under a mask of ancestors):
the mask is per token, so each row's attention becomes quadratic in all of its trie's tokens
and must go through the model's explicit-mask attention path; rows of very different tries no
longer pad together; and the micro-batch planner would have to cut tries by hand. Riders and
stems need no kernel and no new mask: every row stays a causal sequence or a continuation of one
cached row (the existing second forward), riders add no token, and a stem or group over the
token budget is cut into pieces that each re-run only the shared part they need. Deeper
branching than two levels (branches of branches of a stem) recomputes the lower shared parts
once per branch.

Equal token lists of different slots never share (the KV depends on the adapter); equal lists
of one slot share entirely. Nothing shares by accident: a rider is a token-for-token prefix,
and a stem member or group member reads cached positions only up to the tokens it has in common.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from lorafleet.train.layout import MIN_SHARED_PREFIX, Unit, find_groups


def _is_prefix(short: torch.Tensor, long: torch.Tensor) -> bool:
    n = short.numel()
    return n <= long.numel() and bool(torch.equal(short, long[:n]))


def find_hosts(slots: Sequence[int], tokens: Sequence[torch.Tensor]) -> dict[int, int]:
    """rider -> host: every item whose tokens are a prefix of another item of its slot, mapped
    to a leaf (an item that is a prefix of no other) that it is a prefix of.

    Sorted by (slot, tokens), an item that prefixes any other item prefixes its successor (every
    item between a prefix and its extension starts with that prefix), and prefixes are
    transitive; so one pass from the end resolves each chain onto its leaf. Of two equal lists,
    the one sorted first rides on the other.
    """
    order = sorted(range(len(tokens)), key=lambda i: (slots[i], tokens[i].tolist()))
    hosts: dict[int, int] = {}
    for a, b in reversed(list(itertools.pairwise(order))):
        if slots[a] == slots[b] and _is_prefix(tokens[a], tokens[b]):
            hosts[a] = hosts.get(b, b)
    return hosts


def plan_sharing(
    slots: Sequence[int], tokens: Sequence[torch.Tensor], min_prefix: int = MIN_SHARED_PREFIX
) -> list[Unit]:
    """Units covering every item once: the leaves grouped by common prefix (`find_groups`),
    each carrying the items that ride on its members."""
    hosts = find_hosts(slots, tokens)
    leaves = [i for i in range(len(tokens)) if i not in hosts]
    riders: dict[int, list[int]] = {}
    for rider, host in sorted(hosts.items()):
        riders.setdefault(host, []).append(rider)
    units = find_groups([slots[i] for i in leaves], [tokens[i] for i in leaves], min_prefix)
    planned = []
    for unit in units:
        items = tuple(leaves[j] for j in unit.items)
        rides = tuple((r, host) for host in items for r in riders.get(host, ()))
        planned.append(Unit(items, unit.prefix, rides, unit.depths))
    return planned
