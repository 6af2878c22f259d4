"""Samples whose Tinker client went away: cancelled after a grace period without a poll.

The Tinker SDK submits a sample and then long-polls `retrieve_future` for it, one poll after
another. A client that is killed, or whose caller cancels the call (an asyncio timeout), drops
the poll it has in flight: the route notices the disconnect (http/disconnect.py) and tells
`poll_lost`. If no new poll of that request begins within `grace_s` (the SDK re-polls at once
after a poll ends, and retries a failed one within a second or two), nobody is waiting for the
result any more, and the sample's cancel event is set: the sampler drops its rows at its next
step, and the tokens it produced are metered as usual. A request never polled at all is not
cancelled (a client may submit many and poll later).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from lorafleet.server.ops.futures import FutureTable

DEFAULT_GRACE_S = 5.0
_PRUNE_AT = 4096  # entries before finished requests are swept out


@dataclass
class _Entry:
    tenant: str
    event: threading.Event
    polls: int = 0  # polls begun so far: a poll lost is forgiven if a later one began
    active: int = 0  # polls waiting now (a new poll may begin before the lost one is noticed)
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)  # its grace, if running


class AbandonedSamples:
    def __init__(self, futures: FutureTable, grace_s: float = DEFAULT_GRACE_S):
        if not 0 < grace_s < float("inf"):
            raise ValueError(f"abandon_grace_s must be a positive number, got {grace_s!r}")
        self.futures = futures
        self.grace_s = grace_s
        self.cancelled = 0  # samples cancelled because their client went away
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}

    def register(self, request_id: str, tenant: str, event: threading.Event) -> None:
        """A sample's cancel event; a retry answered with the first request keeps the first's."""
        with self._lock:
            if len(self._entries) >= _PRUNE_AT:
                for rid in [r for r in self._entries if not self.futures.is_pending(r)]:
                    del self._entries[rid]
            self._entries.setdefault(request_id, _Entry(tenant, event))

    def poll_began(self, request_id: str, tenant: str) -> None:
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None and entry.tenant == tenant:
                entry.polls += 1
                entry.active += 1

    def poll_ended(self, request_id: str, tenant: str) -> None:
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None and entry.tenant == tenant:
                entry.active = max(0, entry.active - 1)

    def poll_lost(self, request_id: str, tenant: str) -> None:
        """The client hung up during a poll: cancel unless another poll begins in time. Called
        on the server's event loop, whose timer runs the grace (no thread per lost poll; at
        most one timer per request)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.tenant != tenant:
                return
            if entry.timer is not None:
                entry.timer.cancel()
            entry.timer = loop.call_later(self.grace_s, self._expire, request_id, entry.polls)

    def _expire(self, request_id: str, polls: int) -> None:
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.polls != polls or entry.active > 0:
                return  # polled again meanwhile, or polling now: the client is still there
            del self._entries[request_id]
        if self.futures.is_pending(request_id):
            entry.event.set()
            self.cancelled += 1

    def close(self) -> None:
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            if entry.timer is not None:
                entry.timer.cancel()
