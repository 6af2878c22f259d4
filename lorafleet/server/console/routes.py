"""The console's HTTP side, under `/console` on the API's own port: the page and its assets (no
key needed: they hold no data), and `/console/api/...`, where the session cookie is the only
credential (`app.KeyGate` lets `/console` through to this module's own check).

- Every `/console/api` route but sign-in needs the cookie, and answers 401 without it before it
  reads a parameter or a body.
- A state-changing request (POST, PUT, DELETE) also needs the session's CSRF token in
  `X-CSRF-Token`, and is refused when the browser says it is cross-site (`Sec-Fetch-Site`) or
  its `Origin` is not this server; sign-in checks the same headers (login CSRF).
- The cookie: HttpOnly, SameSite=Strict, Path=/console, Secure when the request came over TLS,
  with a Max-Age of the session's lifetime.
- Responses carry a Content-Security-Policy of `'self'` only and `Cache-Control: no-store`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request, Response
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from lorafleet.server.console.sessions import COOKIE, CSRF_HEADER, ConsoleSession, ConsoleSessions
from lorafleet.server.console.sse import EventStreams
from lorafleet.server.console.views import ConsoleViews
from lorafleet.server.errors import Unauthorized, UserError
from lorafleet.server.http.text_check import check_text
from lorafleet.server.ops.run_metrics import MAX_STEP
from lorafleet.server.state.keys import Tenant

CONSOLE = "/console"
CONSOLE_API = f"{CONSOLE}/api"
STATIC_DIR = Path(__file__).parent / "static"
MAX_BODY_BYTES = 4096
_TYPES = {
    ".js": "text/javascript",
    ".css": "text/css",
    ".html": "text/html",
    ".svg": "image/svg+xml",
}
ASSETS = {p.name: p for p in STATIC_DIR.iterdir() if p.is_file() and p.suffix in _TYPES}
"""The only files served: the static dir's own, by name (never a path from the URL)."""
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_SAFE_METHODS = frozenset({"GET", "HEAD"})


class Forbidden(UserError):
    status = 403


@dataclass(frozen=True)
class Console:
    """What the console's routes answer from."""

    sessions: ConsoleSessions
    views: ConsoleViews
    streams: EventStreams


def _cross_site(request: Request) -> str | None:
    """Why a state-changing request is refused as cross-site, or None."""
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site not in ("same-origin", "none"):
        return f"Sec-Fetch-Site: {fetch_site}"
    origin = request.headers.get("origin")
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin is not None and origin != own:
        return f"Origin {origin!r} is not this server ({own!r})"
    return None


def _signed_in(console: Console, request: Request) -> tuple[ConsoleSession, Tenant]:
    """The session (401 without one); for a state-changing method the CSRF checks too."""
    session, tenant = console.sessions.get(request.cookies.get(COOKIE))
    if request.method not in _SAFE_METHODS:
        reason = _cross_site(request)
        if reason is not None:
            raise Forbidden(f"cross-site request refused ({reason})")
        token = request.headers.get(CSRF_HEADER, "")
        if not hmac.compare_digest(token.encode(), session.csrf.encode()):
            raise Forbidden(f"missing or wrong {CSRF_HEADER} header: reload the console page")
    return session, tenant


def _json(body: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=HEADERS)


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    """A whole-number query parameter from `low` to `high` (SQLite holds 64 bits: a bigger
    number would reach the database as an OverflowError, a 500)."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise UserError(f"{name} must be a whole number from {low} to {high}, got {raw!r:.40}")
    return value


async def _small_body(request: Request) -> bytes:
    """The console's bodies are a key or a TTL: read up to MAX_BODY_BYTES, 413 past it."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise UserError(
                f"{request.url.path}: body larger than {MAX_BODY_BYTES} bytes", status=413
            )
    return body


async def _sign_in_key(request: Request) -> str:
    """The key from a JSON body `{"key"}` or a form field `key` (the page works without JS
    too: its form posts here, never a GET that would put the key in a URL). Anything else is
    401, as a request to any other route without credentials is."""
    body = await _small_body(request)
    kind = request.headers.get("content-type", "").split(";")[0].strip()
    key: object = None
    if kind == "application/json":
        try:
            data = json.loads(body or b"null")
        except ValueError:
            data = None
        check_text(body, data)  # a key that is not text: 400 naming it, not a 500 at hashing
        key = data.get("key") if isinstance(data, dict) else None
    elif kind == "application/x-www-form-urlencoded":
        values = parse_qs(body.decode("utf-8", "replace")).get("key")
        key = values[0] if values else None
    if not isinstance(key, str) or not key:
        raise Unauthorized(
            'sign in with a JSON body {"key": "tml-..."} or a form field "key" '
            "(application/json or application/x-www-form-urlencoded)"
        )
    return key


def add_routes(app: FastAPI, console: Console) -> None:
    views = console.views

    @app.get(CONSOLE)
    async def page() -> FileResponse:
        return FileResponse(ASSETS["index.html"], media_type="text/html", headers=HEADERS)

    @app.get(f"{CONSOLE}/static/{{name}}")
    async def asset(name: str) -> FileResponse:
        path = ASSETS.get(name)
        if path is None or name == "index.html":
            raise UserError(f"no console asset {name!r:.80}", status=404)
        return FileResponse(path, media_type=_TYPES[path.suffix], headers=HEADERS)

    @app.post(f"{CONSOLE_API}/session")
    async def sign_in(request: Request) -> Response:
        reason = _cross_site(request)
        if reason is not None:
            raise Forbidden(f"cross-site sign-in refused ({reason})")
        form = request.headers.get("content-type", "").startswith(
            "application/x-www-form-urlencoded"
        )
        session, tenant = console.sessions.sign_in(await _sign_in_key(request))
        response: Response
        if form:
            response = RedirectResponse(CONSOLE, status_code=303, headers=HEADERS)
        else:
            response = _json(
                {"tenant": tenant.id, "operator": tenant.operator, "csrf": session.csrf}
            )
        response.set_cookie(
            COOKIE,
            session.id,
            max_age=int(console.sessions.ttl_s),
            path=CONSOLE,
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        return response

    @app.get(f"{CONSOLE_API}/session")
    async def who(request: Request) -> JSONResponse:
        session, tenant = _signed_in(console, request)
        return _json(
            {
                "tenant": tenant.id,
                "operator": tenant.operator,
                "csrf": session.csrf,
                "expires_at": session.expires_at,
            }
        )

    @app.delete(f"{CONSOLE_API}/session")
    async def sign_out(request: Request) -> JSONResponse:
        session, _ = _signed_in(console, request)
        console.sessions.sign_out(session.id)
        response = _json({})
        response.delete_cookie(COOKIE, path=CONSOLE, httponly=True, samesite="strict")
        return response

    @app.get(f"{CONSOLE_API}/overview")
    async def overview(request: Request) -> JSONResponse:
        _, tenant = _signed_in(console, request)
        return _json(await run_in_threadpool(views.overview, tenant))

    @app.get(f"{CONSOLE_API}/usage")
    async def usage(request: Request) -> JSONResponse:
        _, tenant = _signed_in(console, request)
        return _json(await run_in_threadpool(views.usage, tenant))

    @app.get(f"{CONSOLE_API}/operator")
    async def operator(request: Request) -> JSONResponse:
        _, tenant = _signed_in(console, request)
        return _json(await run_in_threadpool(views.operator, tenant))

    @app.get(f"{CONSOLE_API}/runs/{{run_id}}")
    async def run(run_id: str, request: Request) -> JSONResponse:
        _, tenant = _signed_in(console, request)
        after = _int_param(request, "after_step", -1, -1, MAX_STEP)
        return _json(await run_in_threadpool(views.run, tenant, run_id, after))

    @app.get(f"{CONSOLE_API}/runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/zip")
    async def download(run_id: str, checkpoint_id: str, request: Request) -> Response:
        _, tenant = _signed_in(console, request)
        name, data = await run_in_threadpool(views.peft_zip, tenant, run_id, checkpoint_id)
        headers = {**HEADERS, "Content-Disposition": f'attachment; filename="{name}"'}
        return Response(data, media_type="application/zip", headers=headers)

    @app.put(f"{CONSOLE_API}/runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/ttl")
    async def set_ttl(run_id: str, checkpoint_id: str, request: Request) -> JSONResponse:
        _, tenant = _signed_in(console, request)
        body = await _small_body(request)
        try:
            parsed = json.loads(body or b"null")
        except ValueError:
            raise UserError('body must be JSON {"ttl_seconds": int | null}') from None
        check_text(body, parsed)
        views.set_ttl(tenant, run_id, checkpoint_id, parsed)
        return _json({})

    @app.delete(f"{CONSOLE_API}/runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete(run_id: str, checkpoint_id: str, request: Request) -> JSONResponse:
        _, tenant = _signed_in(console, request)
        await asyncio.wrap_future(views.delete(tenant, run_id, checkpoint_id))
        return _json({})

    shared = SharedRunViews()  # run views the streams on one run share (SharedRunViews)

    @app.get(f"{CONSOLE_API}/events")
    async def events(request: Request) -> StreamingResponse:
        session, tenant = _signed_in(console, request)
        # on a worker thread: checking the view builds it once (a run's curves, the fleet)
        snapshot = await run_in_threadpool(
            _snapshot, views, lambda: console.sessions.get(session.id)[1], request, shared
        )
        console.streams.check(session, tenant.operator)
        headers = {**HEADERS, "X-Accel-Buffering": "no"}
        return StreamingResponse(
            console.streams.stream(session, snapshot, tenant.operator),
            media_type="text/event-stream",
            headers=headers,
        )


def _snapshot(
    views: ConsoleViews,
    current: Callable[[], Tenant],
    request: Request,
    shared: SharedRunViews,
) -> Callable[[], dict[str, Any]]:
    """What one stream sends: `?view=tenant` (the overview, and `&run=<id>` that run's curves
    and checkpoints) or `?view=operator`. `current` gives the session's tenant as the tenants
    config has it now, asked again for every snapshot: an operator flag removed by a reload
    ends an open operator stream (a 403 `failure` event) instead of leaving it the fleet."""
    view = request.query_params.get("view", "tenant")
    run = request.query_params.get("run")
    if view == "operator":
        views.operator(current())  # refused now (403), not as the stream's first event
        return lambda: {"operator": views.operator(current())}
    if view != "tenant":
        raise UserError(f"view must be 'tenant' or 'operator', got {view!r:.40}")
    if run is None:
        return lambda: {"overview": views.overview(current())}
    views.check_run(current(), run)  # another tenant's run: 404 now (without building it)
    return RunSnapshot(views, current, run, shared)


class SharedRunViews:
    """Run views built in the last `max_age_s`, shared by the streams watching the same run
    from the same point: 64 tabs opened on one run build its 31,000 points once, not 64 times.
    Keyed by tenant, so a view is only ever handed to the tenant it was built for."""

    def __init__(self, max_age_s: float = 0.5, max_entries: int = 256):
        self.max_age_s = max_age_s
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._views: dict[tuple[str, str, int], tuple[float, dict[str, Any]]] = {}

    def get(self, views: ConsoleViews, tenant: Tenant, run: str, after: int) -> dict[str, Any]:
        key = (tenant.id, run, after)
        now = time.monotonic()
        with self._lock:
            hit = self._views.get(key)
            if hit is not None and now - hit[0] <= self.max_age_s:
                return dict(hit[1])
        view = views.run(tenant, run, after_step=after)
        with self._lock:
            if len(self._views) >= self.max_entries:
                self._views = {k: v for k, v in self._views.items() if now - v[0] <= self.max_age_s}
                if len(self._views) >= self.max_entries:
                    self._views.clear()
            self._views[key] = (time.monotonic(), view)
        return dict(view)


class RunSnapshot:
    """One stream's view of a run: the whole curves first, then only the points after those
    already sent (`series_delta`, which the page appends): a run with 31 curves of 1,000
    points costs each stream a few new points a look, not 31,000. Points are asked for after
    the lowest last step sent over the curves (the page drops what it already holds); a curve
    that was not there before, or is older than that, is sent whole again with the rest
    (`series`), so a late-posted curve is never missed."""

    def __init__(
        self,
        views: ConsoleViews,
        current: Callable[[], Tenant],
        run: str,
        shared: SharedRunViews | None = None,
    ):
        self.shared = shared or SharedRunViews(max_age_s=0.0)
        self.views = views
        self.current = current
        self.run = run
        self.last: dict[tuple[str, str], int] | None = None  # (name, source) -> last step sent

    def __call__(self) -> dict[str, Any]:
        tenant = self.current()
        after = -1 if not self.last else min(self.last.values())
        view = self.shared.get(self.views, tenant, self.run, after)
        series: list[dict[str, Any]] = view.pop("series")
        fresh = self.last is None or any(
            (curve["name"], curve["source"]) not in self.last for curve in series
        )
        if fresh and after >= 0:  # a new curve: its older points are needed too
            series = self.shared.get(self.views, tenant, self.run, -1)["series"]
        last = {} if fresh or self.last is None else dict(self.last)
        for curve in series:
            if curve["points"]:
                curve_key = (curve["name"], curve["source"])
                last[curve_key] = max(last.get(curve_key, -1), int(curve["points"][-1][0]))
        self.last = last
        field = "series" if fresh else "series_delta"
        return {"overview": self.views.overview(tenant), "run": {**view, field: series}}
