"""What `GET /api/v1/healthz` answers: whether the server can do its work, for probes and load
balancers that hold no key, so the answer is states only (no paths, tenants or versions).

200 while the engine works, even with a full disk (training and sampling still run; saves get
507 until space is freed, see disk.py); 503 when the engine is dead or stalled, which only a
restart mends, so a probe that restarts on non-200 does the right thing.
"""

from __future__ import annotations

OK = 200
UNAVAILABLE = 503


def report(engine: str, disk: str, rollout: str | None = None) -> tuple[int, dict[str, str]]:
    """`engine`: "ok" | "stalled" | "dead" (Scheduler.liveness); `disk`: "ok" | "full";
    `rollout`: "ok" | "degraded" | "unavailable", the sampler's replicas (`Sampler.health`:
    degraded while some are out of rotation, unavailable when none serves, which samples
    cannot get past until one comes back); None: not reported (unit tests of the rest)."""
    states = {"engine": engine, "disk": disk}
    if rollout is not None:
        states["rollout"] = rollout
    if engine != "ok" or rollout == "unavailable":
        return UNAVAILABLE, {"status": "unavailable", **states}
    status = "ok" if disk == "ok" and rollout in (None, "ok") else "degraded"
    return OK, {"status": status, **states}
