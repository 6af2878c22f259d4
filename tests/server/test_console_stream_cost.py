"""Issue 34, item 7: console streams are shared fairly and cost a bounded amount. Tenants that
fill their own bounds leave the last places to tenants without a stream and to operators; the
snapshots of all streams together take at most `cpu_share` of the wall time (one build at a
time, each followed by its share of idle time); and a run's curves go out as deltas."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any

import pytest

from lorafleet.server.console.sessions import ConsoleSessions
from lorafleet.server.console.sse import EventStreams, TooManyStreams
from lorafleet.server.state.keys import Tenant, hash_key
from lorafleet.server.state.tenants import Tenancy, TenantsConfig, TenantSpec

KEYS = {name: f"tml-console-{name}-0123456789" for name in ("a", "b", "c", "op")}


def _sessions() -> ConsoleSessions:
    specs = [TenantSpec(n, (hash_key(k),), operator=n == "op") for n, k in KEYS.items()]
    tenancy = Tenancy(TenantsConfig.from_specs(specs, "t"))
    return ConsoleSessions(lambda: tenancy.current)


def test_full_tenants_leave_places_to_newcomers_and_operators():
    sessions = _sessions()
    streams = EventStreams(
        sessions, per_session=8, total=8, per_tenant=8, operator_reserve=1, newcomer_reserve=2
    )
    a, b, c, op = (sessions.sign_in(KEYS[n])[0] for n in ("a", "b", "c", "op"))

    async def scenario() -> None:
        opened = []
        while True:
            try:
                streams.check(a)
            except TooManyStreams as exc:
                assert "tenants without a stream" in str(exc)
                break
            opened.append(streams.stream(a, dict))
            await anext(opened[-1])
        assert len(opened) == 5  # 8 places less both reserves
        streams.check(b)  # b holds nothing: the newcomers' places are open to it
        opened.append(streams.stream(b, dict))
        await anext(opened[-1])
        with pytest.raises(TooManyStreams):
            streams.check(b)  # now b streams too: the remaining places are kept
        opened.append(streams.stream(c, dict))
        assert (await anext(opened[-1])).startswith(b"retry:")
        with pytest.raises(TooManyStreams, match="for operators"):
            streams.check(sessions.sign_in(KEYS["b"])[0])
        streams.check(op, operator=True)  # the operator's own place
        opened.append(streams.stream(op, dict, operator=True))
        assert (await anext(opened[-1])).startswith(b"retry:")
        assert streams.open_streams == 8
        for stream in opened:
            await stream.aclose()
        assert streams.open_streams == 0

    asyncio.run(scenario())


def test_snapshots_of_all_streams_take_a_bounded_share_of_time():
    sessions = _sessions()
    share = 0.25
    streams = EventStreams(
        sessions, per_session=8, total=16, per_tenant=16, interval_s=0.001, cpu_share=share
    )
    spans: list[tuple[float, float]] = []
    running = {"now": 0, "most": 0}
    lock = threading.Lock()

    def snapshot() -> dict[str, Any]:
        with lock:
            running["now"] += 1
            running["most"] = max(running["most"], running["now"])
        start = time.monotonic()
        time.sleep(0.005)
        spans.append((start, time.monotonic()))
        with lock:
            running["now"] -= 1
        return {"t": start}  # always new: every build is sent

    async def scenario() -> None:
        sess = [sessions.sign_in(KEYS["a"])[0] for _ in range(2)]
        opened = [streams.stream(sess[i % 2], snapshot) for i in range(12)]

        async def drain(stream: Any) -> None:
            for _ in range(4):
                await anext(stream)

        await asyncio.gather(*(drain(s) for s in opened))
        for stream in opened:
            await stream.aclose()

    asyncio.run(scenario())
    assert running["most"] == 1  # one build at a time, however many streams
    spans.sort()
    for (start, end), (following, _) in itertools.pairwise(spans):
        # each build is followed by (1 / share - 1) times its own length of idle time
        assert following - end >= (end - start) * (1 / share - 1) * 0.99
    assert streams.builds == len(spans)


class _Views:
    """A run's curves as ConsoleViews.run returns them, with points added between looks."""

    def __init__(self) -> None:
        self.points: dict[tuple[str, str], list[list[float]]] = {}
        self.calls: list[int] = []

    def run(self, tenant: Tenant, run: str, after_step: int = -1) -> dict[str, Any]:
        self.calls.append(after_step)
        series = [
            {"name": n, "source": s, "points": [p for p in pts if p[0] > after_step]}
            for (n, s), pts in self.points.items()
        ]
        return {"id": run, "series": [c for c in series if c["points"]], "checkpoints": []}

    def overview(self, tenant: Tenant) -> dict[str, Any]:
        return {}


def test_a_runs_curves_go_out_as_deltas():
    from lorafleet.server.console.routes import RunSnapshot

    views = _Views()
    views.points[("loss", "server")] = [[s, 1.0 / (s + 1)] for s in range(1000)]
    views.points[("reward", "client")] = [[s, float(s)] for s in range(1000)]
    tenant = Tenant(id="a")
    snap = RunSnapshot(views, lambda: tenant, "run-1")  # type: ignore[arg-type]
    first = snap()["run"]
    assert "series" in first and sum(len(c["points"]) for c in first["series"]) == 2000
    views.points[("loss", "server")].append([1000, 0.001])
    second = snap()["run"]
    assert "series" not in second
    assert second["series_delta"] == [
        {"name": "loss", "source": "server", "points": [[1000, 0.001]]}
    ]
    assert views.calls[-1] == 999  # asked for the points after those sent
    third = snap()["run"]
    assert [len(c["points"]) for c in third["series_delta"]] == [1]  # reward: 999 < its 1000
    # a curve posted late: sent whole, with the rest
    views.points[("eval", "client")] = [[s, 0.5] for s in range(0, 1001, 100)]
    fourth = snap()["run"]
    assert "series" in fourth and {c["name"] for c in fourth["series"]} == {
        "loss",
        "reward",
        "eval",
    }
