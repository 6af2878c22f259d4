"""ops/abandoned.py: a sample whose client lost its poll and did not poll again within the
grace is cancelled; one whose client is polling (even a poll that began before the lost one
was noticed) or that finished is not."""

from __future__ import annotations

import asyncio
import threading

from lorafleet.server.ops.abandoned import AbandonedSamples


class _Futures:
    def __init__(self) -> None:
        self.pending = {"r1"}

    def is_pending(self, request_id: str) -> bool:
        return request_id in self.pending


def _run(steps) -> tuple[threading.Event, AbandonedSamples, _Futures]:
    futures = _Futures()
    abandoned = AbandonedSamples(futures, grace_s=0.05)  # type: ignore[arg-type]
    event = threading.Event()
    abandoned.register("r1", "alice", event)

    async def main() -> None:
        steps(abandoned, futures)
        await asyncio.sleep(0.2)

    asyncio.run(main())
    return event, abandoned, futures


def test_lost_poll_not_renewed_cancels() -> None:
    def steps(a, _f):
        a.poll_began("r1", "alice")
        a.poll_lost("r1", "alice")
        a.poll_ended("r1", "alice")

    event, abandoned, _ = _run(steps)
    assert event.is_set() and abandoned.cancelled == 1


def test_new_poll_that_began_before_the_loss_was_noticed_keeps_it() -> None:
    def steps(a, _f):
        a.poll_began("r1", "alice")  # the poll the client gives up on
        a.poll_began("r1", "alice")  # its next one, already waiting
        a.poll_lost("r1", "alice")
        a.poll_ended("r1", "alice")

    event, _, _ = _run(steps)
    assert not event.is_set()


def test_other_tenant_and_finished_requests_are_left_alone() -> None:
    def steps(a, f):
        a.poll_began("r1", "mallory")
        a.poll_lost("r1", "mallory")  # not theirs: ignored
        a.poll_began("r1", "alice")
        a.poll_lost("r1", "alice")
        a.poll_ended("r1", "alice")
        f.pending.clear()  # the result came in before the grace ran out

    event, _, _ = _run(steps)
    assert not event.is_set()
