"""The FastAPI app for the Tinker API (SDK 0.38), assembled from the route groups in `http/`
(thin wrappers that read the caller and the body and call one part of `Service`). Every error
leaves as JSON `{"error", "category"}` with a 4xx/5xx status (`http/error_handlers.py`).

The API key is checked by `KeyGate` before routing, so a caller without a valid key learns
nothing: not which routes exist, not how a route validates its parameters, and it cannot make
the server read a body. Only `GET /api/v1/healthz` (states only: the engine's liveness and the
data disk, see ops/health.py) is open, for liveness probes. Bodies are read under limits (`http/bodies.py`).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from lorafleet.server.console import routes as console_routes
from lorafleet.server.errors import ApiError
from lorafleet.server.http import (
    API,
    info,
    resources,
    retrieve,
    run_metric_routes,
    sampling,
    sessions,
    stats,
    training,
    unknown,
    usage,
)
from lorafleet.server.http.bodies import BodyReader
from lorafleet.server.http.error_handlers import install_error_handlers
from lorafleet.server.http.off_loop import OffLoop
from lorafleet.server.http.usage import METRICS_ROUTE
from lorafleet.server.openai import routes as openai_routes
from lorafleet.server.service import Service

PUBLIC_PATHS = frozenset({f"{API}/healthz"})
# Signed download links (rest.FILES_ROUTE, sessions.TRACES_ROUTE): fetched by the SDK with a plain
# GET and no key; the route checks the link's signature instead (signed_urls.py).
SIGNED_GET_PREFIXES = (f"{API}/lorafleet/files/", f"{API}/lorafleet/traces/")


def _console(path: str) -> bool:
    """The web console's page, assets and API: its routes check their own session cookie
    (console/routes.py), so a browser never holds the key."""
    return path == console_routes.CONSOLE or path.startswith(f"{console_routes.CONSOLE}/")


class KeyGate:
    """ASGI middleware: every HTTP request but the public paths must carry a valid X-API-Key;
    the tenant is left in `request.state.tenant` for the routes."""

    def __init__(self, app: ASGIApp, service: Service):
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        signed = scope.get("method") in ("GET", "HEAD") and scope.get("path", "").startswith(
            SIGNED_GET_PREFIXES
        )
        if (
            scope["type"] == "http"
            and scope["path"] not in PUBLIC_PATHS
            and not signed
            and not _console(scope["path"])
        ):
            key = next(
                (v.decode("latin-1") for k, v in scope["headers"] if k == b"x-api-key"), None
            )
            openai_path = scope["path"].startswith(f"{openai_routes.V1}/")
            if key is None and (scope["path"] == METRICS_ROUTE or openai_path):
                # what a Prometheus scrape config and the openai package send (`authorization`)
                key = _bearer(scope)
            try:
                who = self.service.authenticate(key)
            except ApiError as exc:
                reply = (
                    openai_routes.error_response(exc)
                    if openai_path
                    else JSONResponse(exc.body(), status_code=exc.status)
                )
                await reply(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = who
        await self.app(scope, receive, send)


def _bearer(scope: Scope) -> str | None:
    value = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def create_app(service: Service) -> FastAPI:
    """The app: the key gate first, the error handlers, then each group of routes from the
    part of `service` that answers it."""
    app = FastAPI(title="lorafleet", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.add_middleware(KeyGate, service=service)
    install_error_handlers(app)
    config = service.config
    bodies = BodyReader(config.max_body_bytes, config.max_json_bytes, config.body_timeout_s)
    # bodies are read on the loop; everything done with them runs in the caller's lane
    off = OffLoop(bodies, service.lanes)
    info.add_routes(app, service.served, health=service.health)
    stats.add_routes(app, service.stats, off)
    sessions.add_routes(app, service.sessions, off)
    training.add_routes(app, service.training, off)
    sampling.add_routes(app, service.sampling, off)
    retrieve.add_routes(app, service.futures, lambda: config.long_poll_s, off, service.abandoned)
    resources.add_routes(app, service.rest, off)
    usage.add_routes(app, service.usage, off)  # /api/v1/lorafleet/usage, /metrics (operators)
    run_metric_routes.add_routes(app, service.run_metrics, off)  # a client's curves (console)
    console_routes.add_routes(app, service.console, service.lanes)  # /console: cookie sessions
    openai_routes.add_routes(app, service.completions, service.aliases, off)  # /v1: OpenAI's API
    # LAST: the catch-all for POSTs to paths no route above serves
    unknown.add_routes(app, service.training, off)
    return app
