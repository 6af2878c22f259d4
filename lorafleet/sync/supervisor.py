"""Keeps a rollout pool's replicas in rotation: finds the dead ones, brings them back re-synced.

Every `interval_s` the supervisor looks at each replica: a healthy one whose process exited
(spawned) or whose `/health` stopped answering (URL) is taken out of rotation. A replica out
of rotation is brought back on its own thread (`RolloutPool.bring_up`): a spawned vLLM is
stopped and started again, a URL replica is re-probed until it answers; then its base model is
checked, the versions in use are loaded and verified, and only then does it serve again. A
failed attempt is recorded on the replica and retried after `retry_s`.

The loop never dies silently: a failed round is logged with its traceback, counted in
`failures`, and the loop goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorafleet.sync.pool import RolloutPool
    from lorafleet.sync.replica import Replica

log = logging.getLogger(__name__)

__all__ = ["Supervisor"]


class Supervisor:
    def __init__(self, pool: RolloutPool, interval_s: float, *, retry_s: float = 5.0):
        self.pool = pool
        self.interval_s = interval_s
        self.retry_s = retry_s
        self.failures = 0
        self._stop = threading.Event()
        self._recovering: dict[int, threading.Thread] = {}
        self._next_try: dict[int, float] = {}
        self._thread = threading.Thread(
            target=self._loop, name="lorafleet-rollout-supervisor", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:
                self.failures += 1
                log.exception(
                    "rollout supervisor round failed; trying again in %.1f s", self.interval_s
                )

    def check(self) -> None:
        """One round (tests call it directly)."""
        pool = self.pool
        for index, replica in enumerate(pool.replicas):
            with pool.lock:
                state, incarnation = replica.state, replica.incarnation
            if state == "healthy":
                if not replica.source.alive():
                    what = (
                        "its process exited"
                        if replica.source.restartable
                        else "/health stopped answering"
                    )
                    pool.down(replica, incarnation, what)
                continue
            if state != "unhealthy" or self._stop.is_set():
                continue
            running = self._recovering.get(index)
            if running is not None and running.is_alive():
                continue
            if time.monotonic() < self._next_try.get(index, 0.0):
                continue
            if not replica.source.restartable and not replica.source.alive():
                continue  # a URL replica: wait until it answers again
            thread = threading.Thread(
                target=self._recover,
                args=(index, replica),
                name=f"lorafleet-rollout-recover-{replica.name}",
                daemon=True,
            )
            self._recovering[index] = thread
            thread.start()

    def _recover(self, index: int, replica: Replica) -> None:
        pool = self.pool
        with pool.lock:
            replica.state = "restarting"
            pool.changed.notify_all()
        log.warning("rollout replica %s: bringing it back (%s)", replica.name, replica.error)
        try:
            pool.bring_up(replica, restart=True)
        except Exception as exc:
            log.exception("rollout replica %s could not be brought back", replica.name)
            self._next_try[index] = time.monotonic() + self.retry_s
            with pool.lock:
                replica.mark_down(f"restart failed: {exc}")
                pool.changed.notify_all()
