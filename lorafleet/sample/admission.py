"""Which waiting sequence gets the next free row of the running batch.

First come, first served lets one caller's many rows (hundreds of long samples) make another
caller's single short sample wait until all of them have run. So waiting sequences queue per
share key (whatever the caller groups requests by: a tenant, a client), and a free row goes to
the waiting key that holds the fewest rows for its weight (rows held / weight: a key of weight
2 holds twice the rows of a key of weight 1 before either gives way), ties to the key served
least recently. Within a key the order stays first come, first served.

A key that holds no row at all may also take the last `reserved` free rows, which keys already
holding rows may not: a newcomer's first sequence then starts at the next engine step instead
of waiting for a running sequence to finish (the engine's pool has those rows on top of its
batch size, so a lone caller loses no parallelism).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator, Mapping
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class FairQueue(Generic[K, T]):
    """Waiting items per share key; `pop` picks the key (see the module docstring)."""

    def __init__(self) -> None:
        self._queues: dict[K, deque[T]] = {}  # insertion order = least recently served first
        self._weights: dict[K, float] = {}  # of the keys waiting: the latest push's weight

    def __bool__(self) -> bool:
        return bool(self._queues)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __iter__(self) -> Iterator[T]:
        for queue in self._queues.values():
            yield from queue

    def push(self, key: K, item: T, weight: float = 1.0) -> None:
        """`weight`: the key's share (> 0; callers validate it)."""
        self._queues.setdefault(key, deque()).append(item)
        self._weights[key] = weight

    def push_front(self, key: K, item: T, weight: float = 1.0) -> None:
        """Puts back an item `pop` returned (it keeps its place at the head of its key)."""
        self._weights[key] = weight
        queue = self._queues.get(key)
        if queue is None:
            # Back at the head of the turn order too: being put back is not being served.
            self._queues = {key: deque([item]), **self._queues}
        else:
            queue.appendleft(item)

    def pop(self, held: Mapping[K, int], *, free: int, reserved: int) -> tuple[K, T] | None:
        """The next item to admit into one of `free` rows, given the rows each key `held`;
        None when no waiting key may take a row."""
        candidates = [
            key for key in self._queues if held.get(key, 0) == 0 or free > reserved
        ]  # in turn order
        if not candidates:
            return None
        # the first of the fewest for their weight
        best = min(candidates, key=lambda key: held.get(key, 0) / self._weights[key])
        queue = self._queues.pop(best)
        item = queue.popleft()
        if queue:
            self._queues[best] = queue  # to the back of the turn order
        else:
            del self._weights[best]
        return best, item

    def drain(self) -> list[T]:
        """Every waiting item, in key order; the queue is empty afterwards."""
        items = list(self)
        self._queues.clear()
        self._weights.clear()
        return items
