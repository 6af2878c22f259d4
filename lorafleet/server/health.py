"""What `GET /api/v1/healthz` answers: whether the server can do its work, for probes and load
balancers that hold no key, so the answer is states only (no paths, tenants or versions).

200 while the engine works, even with a full disk (training and sampling still run; saves get
507 until space is freed, see disk.py); 503 when the engine is dead or stalled, which only a
restart mends, so a probe that restarts on non-200 does the right thing.
"""

from __future__ import annotations

OK = 200
UNAVAILABLE = 503


def report(engine: str, disk: str) -> tuple[int, dict[str, str]]:
    """`engine`: "ok" | "stalled" | "dead" (Scheduler.liveness); `disk`: "ok" | "full"."""
    if engine != "ok":
        return UNAVAILABLE, {"status": "unavailable", "engine": engine, "disk": disk}
    status = "ok" if disk == "ok" else "degraded"
    return OK, {"status": status, "engine": engine, "disk": disk}
