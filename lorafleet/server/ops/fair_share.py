"""Which forward(_backward) work one engine round runs: weighted deficit round-robin over
tenants, counted in tokens.

Running every ready call as one batch lets one tenant's 2,000-datum call make every other
tenant's 4-datum step wait for all of it, however long that takes. Instead a round runs at most
`budget` tokens, and tenants take turns (deficit round-robin, Shreedhar and Varghese): at the
start of its turn a tenant's deficit grows by `quantum` times its weight (relative to the
heaviest tenant waiting, so the heaviest gets the whole quantum), and it runs datums, in its
order, while their tokens fit in its deficit. The rest of a call waits for the tenant's next
turn, so a large call runs in chunks over several rounds.

- Deficits and the turn order persist across rounds: a round that fills up ends mid-turn and the
  next round resumes that turn, so splitting work into rounds changes no one's share.
- A tenant whose ready work runs out loses its deficit and leaves the turn order (credit is not
  banked while idle); it rejoins at the back when it has work again.
- One datum bigger than the whole budget runs alone, as the first work of a round, once the
  tenant's deficit covers it (a datum is never split).
- A round also ends at the end of a cycle of turns in which some tenant's ready work all ran
  (that tenant now waits on the round's results) and more than one tenant ran: the round does
  not fill the rest of its budget from the backlogged tenants' queues. A tenant stepping one
  small call at a time beside a flooder then waits for one turn of each tenant (the flooder's
  quantum), not for a whole budget of the flooder's tokens; while every tenant stays
  backlogged, rounds still fill up. Shares are unchanged (deficits carry over as always).
- `max_models` caps the distinct models in one round (the bank slots a round may use): a tenant
  whose next work is for another model passes its turn, but keeps the turn's credit (up to one
  round's budget in all). It is blocked, not idle: without that credit, with more backlogged
  tenants than slots, the lighter tenants lost most of their turns (weights 1:2:4 on two slots
  were served 0.08 / 0.25 / 0.67).

While tenants stay backlogged, each one's served tokens stay within one credit plus one datum of
its weighted share; a tenant that arrives waits for at most one turn of each tenant ahead of it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Work:
    """One op's datums still to run: datums `start`.. of an op whose datum `i` has `sizes[i]`
    tokens. A tenant's works are served in the order given."""

    key: str  # the op (its request id)
    model: str
    start: int
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Take:
    """Datums [start, stop) of the op `key` run in this round."""

    key: str
    start: int
    stop: int
    tokens: int


SHARING_WINDOW = 16
"""How many earlier datums of a call `datum_costs` compares each datum with: the turns of an
episode and the samples of a group come next to each other in the cookbook's and our RL job's
batches, and a bound keeps measuring a call linear in its tokens."""


def datum_costs(tokens: Sequence[torch.Tensor]) -> list[int]:
    """What fair share counts for each datum of a forward(_backward) call, given each datum's
    token ids: its tokens past the longest prefix it shares with one of the call's previous
    `SHARING_WINDOW` datums (at least one). The trainer runs a shared prefix once
    (train/prefix_trie.py), but only among datums of one round: counting raw tokens cut a
    multi-turn call into rounds of one or two turns each, and each turn recomputed the whole
    history. Metering still counts every token.

    Runs once per request as it is parsed (off the event loop, but on the request's path): on
    numpy arrays, and only against earlier datums that start with the same token (a datum
    whose first token differs shares no prefix), so a 1000-datum call of unrelated rows costs
    milliseconds, not the third of a second a tensor comparison per pair took."""
    costs: list[int] = []
    previous: list[np.ndarray] = []
    for datum in tokens:
        flat = np.asarray(datum.reshape(-1).cpu())
        shared = 0
        if flat.size:
            first = flat[0]
            for other in previous:
                if other.size and other[0] == first:
                    shared = max(shared, _common_prefix(flat, other))
        costs.append(max(1, int(flat.size) - shared))
        previous = [*previous[-(SHARING_WINDOW - 1) :], flat]
    return costs


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(int(a.size), int(b.size))
    if n == 0:
        return 0
    differ = a[:n] != b[:n]
    at = int(differ.argmax())
    return at if differ[at] else n


def check_weight(tenant: str, weight: float) -> float:
    if not (isinstance(weight, int | float) and math.isfinite(weight) and weight > 0):
        raise ValueError(
            f"the fair-share weight of tenant {tenant!r} must be a positive finite number, got {weight!r}"
        )
    return float(weight)


class DeficitRoundRobin:
    """The deficits and turn order across rounds; `plan` picks one round's work. Not
    thread-safe: the scheduler calls it under its lock."""

    def __init__(self, quantum: int, weight_of: Callable[[str], float]):
        if not isinstance(quantum, int) or quantum < 1:
            raise ValueError(
                f"the fair-share quantum must be a positive number of tokens, got {quantum!r}"
            )
        self.quantum = quantum
        self.weight_of = weight_of
        self.deficits: dict[str, float] = {}
        self._order: deque[str] = deque()  # the tenant whose turn it is, first
        self._credited: str | None = None  # the first tenant, when its turn was already credited

    def order(self) -> list[str]:
        return list(self._order)

    def plan(
        self, ready: Mapping[str, Sequence[Work]], budget: int, max_models: int | None = None
    ) -> list[Take]:
        """The datums to run this round, at most `budget` tokens (or one oversize datum), for
        tenant -> its ready work (in the order it is to be served)."""
        if budget < 1:
            raise ValueError(f"the round token budget must be >= 1, got {budget}")
        self._sync({t for t, works in ready.items() if works}, ready)
        if not self._order:
            return []
        weights = {t: check_weight(t, self.weight_of(t)) for t in self._order}
        heaviest = max(weights.values())
        credit = {t: self.quantum * w / heaviest for t, w in weights.items()}
        cursor = {t: (0, ready[t][0].start) for t in self._order}  # (work index, datum)
        takes: dict[str, Take] = {}
        models: set[str] = set()
        remaining = budget
        idle_turns = 0  # turns in a row that ran nothing
        cycle_left = len(self._order)  # turns until the current cycle of turns ends
        drained = False  # a tenant's ready work all runs in this round: it waits on the round
        ran_for: set[str] = set()  # tenants with work in this round

        def cycle_done() -> bool:
            """Counts a turn; True when it ended a cycle that should end the round too."""
            nonlocal cycle_left
            cycle_left -= 1
            if cycle_left > 0:
                return False
            cycle_left = len(self._order)
            return drained and len(ran_for) > 1

        def capped(model: str) -> bool:
            return max_models is not None and model not in models and len(models) >= max_models

        while self._order and remaining > 0:
            tenant = self._order[0]
            works = ready[tenant]
            index, datum = cursor[tenant]
            if capped(works[index].model):
                if self._credited != tenant:
                    self._bank(tenant, credit[tenant], budget)
                self._pass_turn()
                idle_turns += 1
                if idle_turns >= len(self._order) and self._all_capped(ready, cursor, capped):
                    break
                if cycle_done():
                    break
                continue
            if self._credited != tenant:
                self.deficits[tenant] = self.deficits.get(tenant, 0.0) + credit[tenant]
                self._credited = tenant
            ran, full = False, False
            while index < len(works):
                work = works[index]
                if capped(work.model):
                    break
                size = max(1, work.sizes[datum])
                if size > self.deficits[tenant]:
                    break
                if size > remaining and takes:
                    full = True
                    break
                self.deficits[tenant] -= size
                remaining -= size
                models.add(work.model)
                earlier = takes.get(work.key)
                takes[work.key] = (
                    Take(work.key, datum, datum + 1, size)
                    if earlier is None
                    else Take(work.key, earlier.start, datum + 1, earlier.tokens + size)
                )
                ran = True
                ran_for.add(tenant)
                datum += 1
                if datum == len(work.sizes):
                    index += 1
                    datum = ready[tenant][index].start if index < len(works) else 0
                if remaining <= 0:
                    break
            cursor[tenant] = (index, datum)
            if index == len(works):  # its ready work ran out: no credit kept
                self._leave(tenant)
                drained = True
            elif full or remaining <= 0:
                break  # the round is full; the next one resumes this turn
            else:
                self._pass_turn()
            if cycle_done():
                break
            idle_turns = 0 if ran else idle_turns + 1
            if idle_turns >= len(self._order) > 0:
                self._fast_forward(ready, cursor, credit, capped)
                idle_turns = 0
        return list(takes.values())

    # ------------------------------------------------------------------ helpers
    def _sync(self, waiting: set[str], ready: Mapping[str, Sequence[Work]]) -> None:
        """Tenants without ready work leave (and lose their deficit); new ones join at the back,
        in the order `ready` lists them."""
        for tenant in [t for t in self._order if t not in waiting]:
            self._leave(tenant)
        for tenant in ready:
            if tenant in waiting and tenant not in self._order:
                self._order.append(tenant)
                self.deficits[tenant] = 0.0

    def _bank(self, tenant: str, amount: float, budget: int) -> None:
        """Credit for a turn the slot cap kept the tenant from using, banked up to one round's
        budget, so a tenant blocked for long catches up without then holding whole rounds."""
        deficit = self.deficits.get(tenant, 0.0)
        self.deficits[tenant] = max(deficit, min(deficit + amount, float(budget)))

    def _leave(self, tenant: str) -> None:
        self._order.remove(tenant)
        self.deficits.pop(tenant, None)
        if self._credited == tenant:
            self._credited = None

    def _pass_turn(self) -> None:
        self._order.rotate(-1)
        self._credited = None

    def _all_capped(
        self,
        ready: Mapping[str, Sequence[Work]],
        cursor: Mapping[str, tuple[int, int]],
        capped: Callable[[str], bool],
    ) -> bool:
        return all(capped(ready[t][cursor[t][0]].model) for t in self._order)

    def _fast_forward(
        self,
        ready: Mapping[str, Sequence[Work]],
        cursor: Mapping[str, tuple[int, int]],
        credit: Mapping[str, float],
        capped: Callable[[str], bool],
    ) -> None:
        """A whole cycle of turns ran nothing: every next datum is bigger than its tenant's
        deficit. Adds at once the credit of the turns that would still run nothing (the
        cycles are cheap, but a light tenant's big datum could need thousands of them)."""
        cycles: list[int] = []
        for tenant in self._order:
            index, datum = cursor[tenant]
            work = ready[tenant][index]
            if capped(work.model):
                continue
            short = max(1, work.sizes[datum]) - self.deficits[tenant]
            cycles.append(max(0, math.ceil(short / credit[tenant]) - 1))
        skip = min(cycles, default=0)
        if skip > 0:
            for tenant in self._order:
                if not capped(ready[tenant][cursor[tenant][0]].model):
                    self.deficits[tenant] += skip * credit[tenant]
