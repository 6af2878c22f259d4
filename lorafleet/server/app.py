"""FastAPI routes for the Tinker API (SDK 0.38): thin wrappers that authenticate, read the body
and call `Service`. Every error leaves as JSON `{"error", "category"}` with a 4xx/5xx status,
never as an empty 400 (which the SDK would mistake for a proxy glitch and retry).

The API key is checked by `KeyGate` before routing, so a caller without a valid key learns
nothing: not which routes exist, not how a route validates its parameters, and it cannot make
the server read a body. Only `GET /api/v1/healthz` (which answers `{"status": "ok"}` and
nothing else) is open, for liveness probes. Bodies are read incrementally under a size limit
(protobuf and JSON have their own) and a deadline, so an oversized or trickled body costs the
server at most the limit in memory and the deadline in time.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from lorafleet.server import schemas, views
from lorafleet.server.auth import Tenant
from lorafleet.server.errors import ApiError, UserError
from lorafleet.server.service import Service

log = logging.getLogger(__name__)
API = "/api/v1"
PUBLIC_PATHS = frozenset({f"{API}/healthz"})


class KeyGate:
    """ASGI middleware: every HTTP request but the public paths must carry a valid X-API-Key;
    the tenant is left in `request.state.tenant` for the routes."""

    def __init__(self, app: ASGIApp, service: Service):
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            key = next(
                (v.decode("latin-1") for k, v in scope["headers"] if k == b"x-api-key"), None
            )
            try:
                who = self.service.authenticate(key)
            except ApiError as exc:
                await JSONResponse(exc.body(), status_code=exc.status)(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = who
        await self.app(scope, receive, send)


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="lorafleet", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.add_middleware(KeyGate, service=service)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse({"error": message, "category": "user"}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _bad_params(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5]
        )
        return JSONResponse(
            {"error": f"{request.url.path}: {problems}", "category": "user"}, status_code=400
        )

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        body = {
            "error": f"internal server error: {type(exc).__name__}: {exc}",
            "category": "server",
        }
        return JSONResponse(body, status_code=500)

    def tenant(request: Request) -> Tenant:
        """The caller as `KeyGate` authenticated it: the gate runs before every route but the
        public ones, which never ask."""
        who: Tenant = request.state.tenant
        return who

    async def raw_body(request: Request, limit: int) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise UserError(
                f"request body of {declared} bytes is larger than this server's limit of {limit} for {request.url.path}",
                status=413,
            )
        chunks: list[bytes] = []
        size = 0
        timeout = service.config.body_timeout_s
        try:
            async with asyncio.timeout(timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise UserError(
                            f"request body is larger than this server's limit of {limit} bytes for {request.url.path}",
                            status=413,
                        )
                    chunks.append(chunk)
        except TimeoutError:
            raise UserError(
                f"the request body did not arrive within {timeout:g} s ({size} bytes received)",
                status=408,
            ) from None
        except ClientDisconnect:
            raise UserError(
                f"the client disconnected while sending the body ({size} bytes received)"
            ) from None
        return b"".join(chunks)

    async def body(request: Request) -> Any:
        return schemas.parse_json(await raw_body(request, service.config.max_json_bytes))

    # ------------------------------------------------------------------ service
    @app.get(f"{API}/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post(f"{API}/client/config")
    async def client_config(request: Request) -> dict[str, Any]:
        tenant(request)
        return views.client_config()

    @app.post(f"{API}/client/dynamic_config")
    async def dynamic_config(request: Request) -> dict[str, Any]:
        tenant(request)
        return views.dynamic_config()

    @app.get(f"{API}/get_server_capabilities")
    async def capabilities(request: Request) -> dict[str, Any]:
        tenant(request)
        return views.capabilities(service.served)

    @app.post(f"{API}/telemetry")
    async def telemetry(request: Request) -> dict[str, str]:
        tenant(request)
        return {"status": "accepted"}

    @app.get(f"{API}/lorafleet/stats")
    async def stats(request: Request) -> dict[str, Any]:
        tenant(request)
        return service.stats()

    # ------------------------------------------------------------------ sessions
    @app.post(f"{API}/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        return service.sessions.create(tenant(request), await body(request))

    @app.post(f"{API}/session_heartbeat")
    async def session_heartbeat(request: Request) -> dict[str, Any]:
        return service.sessions.heartbeat(tenant(request), await body(request))

    @app.post(f"{API}/sessions/{{session_id}}/finish")
    async def finish_session(session_id: str, request: Request) -> dict[str, Any]:
        return service.sessions.finish(tenant(request), session_id, await body(request))

    # ------------------------------------------------------------------ training
    @app.post(f"{API}/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        return service.training.create_model(tenant(request), await body(request))

    @app.post(f"{API}/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        return service.rest.get_info(tenant(request), await body(request))

    @app.post(f"{API}/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        who = tenant(request)
        raw = await raw_body(request, service.config.max_body_bytes)
        return service.training.forward_backward(who, raw, request.headers.get("content-encoding"))

    @app.post(f"{API}/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        return service.training.optim_step(tenant(request), await body(request))

    @app.post(f"{API}/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        return service.training.save_weights(tenant(request), await body(request))

    @app.post(f"{API}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
        return service.training.save_for_sampler(tenant(request), await body(request))

    @app.post(f"{API}/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        return service.training.load_weights(tenant(request), await body(request))

    # ------------------------------------------------------------------ sampling
    @app.post(f"{API}/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        return service.sampling.create_session(tenant(request), await body(request))

    @app.get(f"{API}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str, request: Request) -> dict[str, Any]:
        return service.rest.get_sampler(tenant(request), sampler_id)

    @app.post(f"{API}/asample")
    async def asample(request: Request) -> dict[str, Any]:
        return service.sampling.sample(tenant(request), await body(request))

    # ------------------------------------------------------------------ futures
    @app.post(f"{API}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        who = tenant(request)
        data = await body(request)
        result = await service.retrieve(who, data)
        if result is None:
            request_id = data.get("request_id") if isinstance(data, dict) else None
            return JSONResponse(
                {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            )
        return Response(result.body, media_type=result.content_type)

    # ------------------------------------------------------------------ REST
    @app.get(f"{API}/training_runs")
    async def list_training_runs(
        request: Request, limit: int = 20, offset: int = 0
    ) -> dict[str, Any]:
        return service.rest.list_training_runs(tenant(request), limit, offset)

    @app.get(f"{API}/training_runs/{{run_id}}")
    async def get_training_run(run_id: str, request: Request) -> dict[str, Any]:
        return service.rest.get_training_run(tenant(request), run_id)

    @app.get(f"{API}/training_runs/{{run_id}}/checkpoints")
    async def list_run_checkpoints(run_id: str, request: Request) -> dict[str, Any]:
        return service.rest.list_checkpoints(tenant(request), run_id)

    @app.put(f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/ttl")
    async def set_ttl(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        return service.rest.set_checkpoint_ttl(
            tenant(request), run_id, checkpoint_id, await body(request)
        )

    @app.delete(f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete_checkpoint(
        run_id: str, checkpoint_id: str, request: Request
    ) -> dict[str, Any]:
        await asyncio.wrap_future(
            service.rest.delete_checkpoint(tenant(request), run_id, checkpoint_id)
        )
        return {}

    @app.get(f"{API}/checkpoints")
    async def list_user_checkpoints(
        request: Request, limit: int = 100, offset: int = 0
    ) -> dict[str, Any]:
        return service.rest.list_checkpoints(tenant(request), None, limit, offset)

    @app.post(f"{API}/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        return service.rest.weights_info(tenant(request), await body(request))

    return app
