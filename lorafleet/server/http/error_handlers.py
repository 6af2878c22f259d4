"""Every error leaves as JSON `{"error", "category"}` with a 4xx/5xx status, never as an empty
400 (which the SDK would mistake for a proxy glitch and retry). Exception handlers belong to the
app, not to a router, hence a function that installs them."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lorafleet.server.errors import ApiError, internal_error

log = logging.getLogger(__name__)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

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
        body = {"error": internal_error("answering the request", exc), "category": "server"}
        return JSONResponse(body, status_code=500)
