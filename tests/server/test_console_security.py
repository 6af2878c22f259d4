"""The console's security model, over HTTP without a browser: no cookie, no data; no cross-site
writes; one tenant's session reaches nothing of another's through any console route (the
routes are enumerated from the app, so a new one is covered the day it is added); the key
never comes back in a response or a log line."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator

import httpx
import pytest
import tinker
from starlette.routing import Route

from lorafleet.server.app import create_app
from lorafleet.server.console.routes import CONSOLE, CONSOLE_API
from lorafleet.server.console.sessions import COOKIE
from lorafleet.server.main import ServerThread
from tests.server.conftest import KEY_A, KEY_B, TRAIN_DATA, connect, wait_pending

PARAM = re.compile(r"\{(\w+)(?::path)?\}")


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def logs() -> Iterator[_Capture]:
    """Every log record of the module's requests, at DEBUG, uvicorn's included."""
    capture = _Capture()
    capture.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s %(exc_text)s"))
    root = logging.getLogger()
    before = root.level
    root.addHandler(capture)
    root.setLevel(logging.DEBUG)
    yield capture
    root.removeHandler(capture)
    root.setLevel(before)


class Recorder:
    """An httpx client that keeps every response body, to check none holds a key."""

    def __init__(self, base_url: str):
        self.bodies: list[bytes] = []
        self.client = httpx.Client(base_url=base_url, event_hooks={"response": [self._keep]})

    def _keep(self, response: httpx.Response) -> None:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return  # streams are read (and recorded) by `first_event`
        response.read()
        self.bodies.append(response.content)
        self.bodies.extend(v.encode() for v in response.headers.values())


def sign_in(rec: Recorder, key: str) -> str:
    r = rec.client.post(f"{CONSOLE_API}/session", json={"key": key})
    assert r.status_code == 200, r.text
    return str(r.json()["csrf"])


@pytest.fixture(scope="module")
def world(server: ServerThread, logs: _Capture) -> Iterator[dict[str, str]]:
    """A run of tenant B with a sampler checkpoint and a posted metric; one run of A with one."""
    ids: dict[str, str] = {}
    clients: list[tinker.ServiceClient] = []
    for who, key in (("a", KEY_A), ("b", KEY_B)):
        sc = connect(server, key)
        clients.append(sc)
        tc = sc.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=3).result()
        tc.forward_backward(TRAIN_DATA, "cross_entropy").result()
        path = tc.save_weights_for_sampler(f"console-{who}").result().path
        ids[f"{who}_run"] = tc.model_id
        ids[f"{who}_ckpt"] = path.split(tc.model_id + "/", 1)[1]
        ids[f"{who}_path"] = path
        r = httpx.post(
            f"{server.base_url}/api/v1/lorafleet/runs/{tc.model_id}/metrics",
            headers={"X-API-Key": key},
            json={"points": [{"name": f"secret_metric_{who}", "step": 0, "value": 1.5}]},
        )
        assert r.status_code == 200, r.text
    ids["b_tenant"] = server.service.authenticate(KEY_B).id
    ids["a_tenant"] = server.service.authenticate(KEY_A).id
    yield ids
    for sc in clients:
        sc.close("success").result(timeout=30)


def console_routes(server: ServerThread) -> list[tuple[str, str]]:
    """(method, path template) of every route under /console/api."""
    found = []
    for route in create_app(server.service).routes:  # the same routes the server's app has
        if isinstance(route, Route) and route.path.startswith(CONSOLE_API):
            found.extend((m, route.path) for m in sorted(route.methods or ()) if m != "HEAD")
    assert len(found) >= 10, found  # the enumeration itself works
    return found


def fill(template: str, values: dict[str, str]) -> str:
    return PARAM.sub(lambda m: values[m.group(1)], template)


def first_event(rec: Recorder, url: str) -> tuple[int, bytes]:
    """The status and the first event (or error body) of an event stream."""
    with rec.client.stream("GET", url, timeout=30) as r:
        data = b""
        for chunk in r.iter_bytes():
            data += chunk
            if (b"event:" in data and data.endswith(b"\n\n")) or r.status_code != 200:
                break
    rec.bodies.append(data)
    return r.status_code, data


def test_no_cookie_is_401_on_every_console_route(server: ServerThread, world: dict[str, str]):
    rec = Recorder(server.base_url)
    values = {"run_id": world["a_run"], "checkpoint_id": world["a_ckpt"]}
    for method, template in console_routes(server):
        url = fill(template, values)
        for cookies in ({}, {COOKIE: "forged-session-id"}):
            rec.client.cookies.clear()
            rec.client.cookies.update(cookies)
            r = rec.client.request(method, url, json={"ttl_seconds": 5})
            assert r.status_code == 401, (method, url, cookies, r.status_code, r.text)
            assert "error" in r.json()
    # the page and its assets hold no data and need no cookie
    assert rec.client.get(CONSOLE).status_code == 200
    assert rec.client.get(f"{CONSOLE}/static/app.js").status_code == 200
    assert rec.client.get(f"{CONSOLE}/static/..%2Fsessions.py").status_code == 404
    # A's checkpoint was not touched by the refused PUT/DELETE
    row = server.service.store.checkpoints.get(world["a_path"])
    assert row is not None and row.expires_at is None


def test_cookie_attributes(server: ServerThread, world: dict[str, str]):
    r = httpx.post(f"{server.base_url}{CONSOLE_API}/session", json={"key": KEY_A})
    cookie = r.headers["set-cookie"].lower()
    for part in ("httponly", "samesite=strict", "path=/console", "max-age="):
        assert part in cookie, cookie
    assert "secure" not in cookie  # plain http here; over TLS it is Secure:
    r = httpx.post(
        f"{server.base_url}{CONSOLE_API}/session",
        json={"key": KEY_A},
        headers={"X-Forwarded-Proto": "https"},  # uvicorn trusts it from loopback
    )
    assert "secure" in r.headers["set-cookie"].lower()
    assert "content-security-policy" in r.headers


def test_cross_site_writes_are_refused(server: ServerThread, world: dict[str, str]):
    rec = Recorder(server.base_url)
    csrf = sign_in(rec, KEY_A)
    url = f"{CONSOLE_API}/runs/{world['a_run']}/checkpoints/{world['a_ckpt']}/ttl"
    evil = [
        {},  # the cookie alone (what a cross-site form would carry, were SameSite ignored)
        {"X-CSRF-Token": "guessed"},
        {"X-CSRF-Token": csrf, "Origin": "http://evil.example"},
        {"X-CSRF-Token": csrf, "Sec-Fetch-Site": "cross-site"},
        {"X-CSRF-Token": csrf, "Sec-Fetch-Site": "same-site"},
    ]
    for headers in evil:
        r = rec.client.put(url, json={"ttl_seconds": 60}, headers=headers)
        assert r.status_code == 403, (headers, r.text)
        r = rec.client.delete(url.removesuffix("/ttl"), headers=headers)
        assert r.status_code == 403, (headers, r.text)
    assert server.service.store.checkpoints.get(world["a_path"]).expires_at is None
    # a cross-site sign-in (login CSRF) is refused too
    r = httpx.post(
        f"{server.base_url}{CONSOLE_API}/session",
        json={"key": KEY_A},
        headers={"Origin": "http://evil.example"},
    )
    assert r.status_code == 403 and "set-cookie" not in r.headers
    # the same request from the page itself goes through
    own = {"X-CSRF-Token": csrf, "Origin": server.base_url, "Sec-Fetch-Site": "same-origin"}
    r = rec.client.put(url, json={"ttl_seconds": 7200}, headers=own)
    assert r.status_code == 200, r.text
    expires = server.service.store.checkpoints.get(world["a_path"]).expires_at
    assert expires is not None and abs(expires - (time.time() + 7200)) < 60
    r = rec.client.put(url, json={"ttl_seconds": None}, headers=own)
    assert (
        r.status_code == 200
        and server.service.store.checkpoints.get(world["a_path"]).expires_at is None
    )
    # signed out: the cookie is dead
    assert rec.client.delete(f"{CONSOLE_API}/session", headers=own).status_code == 200
    rec.client.cookies.clear()
    assert rec.client.get(f"{CONSOLE_API}/overview").status_code == 401


def test_tenant_a_reaches_nothing_of_b(server: ServerThread, world: dict[str, str]):
    rec = Recorder(server.base_url)
    csrf = sign_in(rec, KEY_A)
    headers = {"X-CSRF-Token": csrf}
    foreign = {"run_id": world["b_run"], "checkpoint_id": world["b_ckpt"]}
    # what A may not learn; a 404 may echo the ids A itself sent, nothing else of B's
    secrets = [world["b_run"], world["b_tenant"], "secret_metric_b", world["b_ckpt"]]
    unsent = [world["b_tenant"], "secret_metric_b"]
    routes = console_routes(server)
    for method, template in routes:
        if template == f"{CONSOLE_API}/session":
            continue  # sign-in/out: no tenant data in or out (checked below)
        url = fill(template, foreign)
        if template.endswith("/events"):
            for query in (f"?view=tenant&run={world['b_run']}", "?view=tenant", "?view=operator"):
                status, body = first_event(rec, url + query)
                assert status in (200, 403, 404), (url, query, status)
                if "run=" in query:
                    assert status == 404, body
                for secret in unsent if "run=" in query else secrets:
                    assert secret.encode() not in body, (query, secret)
            continue
        r = rec.client.request(method, url, json={"ttl_seconds": 5}, headers=headers)
        if PARAM.search(template):
            assert r.status_code == 404, (method, url, r.status_code, r.text)
        else:
            assert r.status_code in (200, 403), (method, url, r.status_code)
        for secret in unsent if PARAM.search(template) else secrets:
            assert secret not in r.text, (method, url, secret)
    # A's own data is there (the checks above are not vacuous)
    overview = rec.client.get(f"{CONSOLE_API}/overview").json()
    # (the shared server may hold A's runs from other tests; never B's)
    listed = [r["id"] for r in overview["runs"]]
    assert world["a_run"] in listed and world["b_run"] not in listed
    series = rec.client.get(f"{CONSOLE_API}/runs/{world['a_run']}").json()["series"]
    assert {s["name"] for s in series} == {"loss", "secret_metric_a"}
    # B's checkpoint survived A's PUT and DELETE
    row = server.service.store.checkpoints.get(world["b_path"])
    assert row is not None and row.expires_at is None
    # and B posting to A's run is a 404 too
    r = httpx.post(
        f"{server.base_url}/api/v1/lorafleet/runs/{world['a_run']}/metrics",
        headers={"X-API-Key": KEY_B},
        json={"points": [{"name": "x", "step": 0, "value": 1}]},
    )
    assert r.status_code == 404


def test_run_metrics_post_is_bounded(server: ServerThread, world: dict[str, str]):
    url = f"{server.base_url}/api/v1/lorafleet/runs/{world['a_run']}/metrics"
    auth = {"X-API-Key": KEY_A}
    bad = [
        ({"points": []}, "points"),
        ({"points": [{"name": "r", "step": 0, "value": 1}] * 257}, "points"),
        ({"points": [{"name": "../x", "step": 0, "value": 1}]}, "points[0].name"),
        ({"points": [{"name": "r", "step": -1, "value": 1}]}, "points[0].step"),
        ({"points": [{"name": "r", "step": 0, "value": "1"}]}, "points[0].value"),
        ({"values": []}, "body must be"),
    ]
    for body, named in bad:
        r = httpx.post(url, headers=auth, json=body)
        assert r.status_code == 400 and named in r.json()["error"], (body, r.text)
    many = [{"name": f"m{i}", "step": 0, "value": 1.0} for i in range(40)]
    r = httpx.post(url, headers=auth, json={"points": many})
    assert r.status_code == 400 and "metric names" in r.json()["error"]
    names, _, _ = server.service.store.run_metrics.stats(world["a_tenant"], world["a_run"])
    assert "m0" not in names  # refused whole: nothing written


def test_key_in_no_response_and_no_log(server: ServerThread, world: dict[str, str], logs):
    rec = Recorder(server.base_url)
    # sign-ins that fail and succeed, by JSON and by form (the page without JS)
    assert rec.client.post(f"{CONSOLE_API}/session", json={"key": KEY_A + "x"}).status_code == 401
    r = rec.client.post(f"{CONSOLE_API}/session", data={"key": KEY_B})
    assert r.status_code == 303 and r.headers["location"] == CONSOLE
    csrf = rec.client.get(f"{CONSOLE_API}/session").json()["csrf"]
    for method, template in console_routes(server):
        url = fill(template, {"run_id": world["b_run"], "checkpoint_id": world["b_ckpt"]})
        if template.endswith("/events"):
            first_event(rec, url + "?view=tenant")
        elif method == "GET":
            rec.client.get(url, headers={"X-CSRF-Token": csrf})
    bodies = b"\n".join(rec.bodies)
    assert world["b_run"].encode() in bodies  # B's own data did come back
    for key in (KEY_A, KEY_B):
        assert key.encode() not in bodies
        for line in logs.lines:
            assert key not in line, line
    assert any("lorafleet" in line for line in logs.lines)  # the capture did capture


def test_run_state_shows_queued_work_of_own_runs_only(server: ServerThread, world: dict[str, str]):
    """A run's queued operations and tier come from the scheduler and the live runs, per
    tenant: B's queued work shows on B's run and nowhere in A's view."""
    sc = connect(server, KEY_B)
    try:
        tc = sc.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=4).result()
        server.service.scheduler.pause()
        try:
            futures = [tc.forward_backward(TRAIN_DATA, "cross_entropy") for _ in range(2)]
            wait_pending(server, 2)
            views = server.service.console.views
            b = server.service.authenticate(KEY_B)
            runs = {r["id"]: r for r in views.overview(b)["runs"]}
            assert runs[tc.model_id]["queued"] == 2 and runs[tc.model_id]["in_flight"] == 0
            assert runs[tc.model_id]["state"] == "hot"
            a_runs = views.overview(server.service.authenticate(KEY_A))["runs"]
            assert all(r["queued"] == 0 for r in a_runs)
            assert tc.model_id not in {r["id"] for r in a_runs}
        finally:
            server.service.scheduler.resume()
        for f in futures:
            f.result()
        assert {r["id"]: r for r in views.overview(b)["runs"]}[tc.model_id]["queued"] == 0
    finally:
        sc.close("success").result(timeout=30)
