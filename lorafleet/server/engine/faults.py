"""Test-only crash points: named places in the engine where a crash test can catch the server.

The reliability battery kills the server with SIGKILL "during" an operation (forward_backward,
optim_step, save_state, save_weights_for_sampler, the ephemeral export). Tiny models finish
those in milliseconds, so a kill at a random wall-clock moment would almost never land inside
one; instead the engine announces each named point and, when asked, stops there until it is
killed. Off by default: unless `LORAFLEET_FAULT_FILE` is set when the server starts, `point()`
is a no-op (one `None` check) and nothing else changes. Even when on, it only appends a line to
a file and, at the one requested hit, blocks the engine thread; it never alters a result.

- `LORAFLEET_FAULT_FILE=PATH`: append `<point> <hit> <unix time>` to PATH (flushed) each time
  a point is reached (`<hit>` counts that point's hits since start-up, from 1), so the test can
  watch where the engine is;
- at each hit, if `PATH.pause` exists and holds `<point> <n>` matching this hit, the line is
  written with ` paused` appended and the engine thread blocks for good (until the SIGKILL).
  The test writes that file when it has chosen where to kill, after reading how many hits
  there were so far, so that its own set-up requests do not count.

Points (each `<op>.begin` is reached before the work starts, `<op>.end` after it is done but
before its result is recorded or reported):
`forward_backward.begin|end`, `optim_step.begin|end`, `save_state.begin|end`,
`save_sampler.begin|end`, `export.begin|end` (for saves, `.end` means the files are published
and the database row is not yet written).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

FILE_ENV = "LORAFLEET_FAULT_FILE"

POINTS = tuple(
    f"{op}.{when}"
    for op in ("forward_backward", "optim_step", "save_state", "save_sampler", "export")
    for when in ("begin", "end")
)


class _Recorder:
    def __init__(self, path: str):
        self.path = path
        self.pause_path = path + ".pause"
        self.hits: Counter[str] = Counter()
        self.lock = threading.Lock()

    def _pause_target(self) -> tuple[str, int] | None:
        try:
            with open(self.pause_path, encoding="utf-8") as spec:
                name, count = spec.read().split()
            return name, int(count)
        except FileNotFoundError:
            return None
        except ValueError:
            raise ValueError(f"{self.pause_path}: expected '<point> <n>'") from None

    def hit(self, name: str) -> None:
        with self.lock:
            self.hits[name] += 1
            count = self.hits[name]
            pause = self._pause_target() == (name, count)
            with open(self.path, "a", encoding="utf-8") as out:
                out.write(f"{name} {count} {time.time():.6f}{' paused' if pause else ''}\n")
                out.flush()
        while pause:  # until the test's SIGKILL arrives
            time.sleep(3600)


def _from_env() -> _Recorder | None:
    path = os.environ.get(FILE_ENV)
    return _Recorder(path) if path else None


_recorder = _from_env()


def point(name: str) -> None:
    """Announces `name` when crash points are on; otherwise does nothing."""
    if _recorder is not None:
        _recorder.hit(name)


def enabled() -> bool:
    return _recorder is not None
