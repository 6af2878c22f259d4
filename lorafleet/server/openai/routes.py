"""The OpenAI-compatible routes (`/v1/...`, errors in OpenAI's shape) and the aliases they
resolve (`/api/v1/lorafleet/aliases`, errors in the Tinker shape like the rest of that API).
The key arrives as `Authorization: Bearer` on `/v1/` paths (app.KeyGate)."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lorafleet.server.errors import ApiError, NotFound
from lorafleet.server.http import API
from lorafleet.server.http.aliases import Aliases
from lorafleet.server.http.bodies import BodyReader, tenant
from lorafleet.server.http.disconnect import ClientGone, WatchedStream, unless_disconnected
from lorafleet.server.openai.errors import body as error_body
from lorafleet.server.openai.service import Completions

V1 = "/v1"
ALIASES_ROUTE = f"{API}/lorafleet/aliases"


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers())


async def _openai(answer: Callable[[], Awaitable[Any]]) -> Any:
    try:
        return await answer()
    except ApiError as exc:
        return error_response(exc)
    except ClientGone:  # nobody reads it; its sample was cancelled
        return Response(status_code=499)


def add_routes(
    app: FastAPI, completions: Completions, aliases: Aliases, bodies: BodyReader
) -> None:
    """Call before `unknown.add_routes`, whose catch-all would take the alias routes."""

    @app.get(f"{V1}/models")
    async def list_models(request: Request) -> Any:
        async def answer() -> Any:
            return completions.models.listing(tenant(request))

        return await _openai(answer)

    @app.get(f"{V1}/models/{{model:path}}")
    async def get_model(model: str, request: Request) -> Any:
        async def answer() -> Any:
            return completions.models.describe(tenant(request), model)

        return await _openai(answer)

    async def complete(request: Request, chat: bool) -> Any:
        async def answer() -> Any:
            raw = await bodies.json(request)
            cancel = threading.Event()  # set when the client hangs up: the sample stops
            if isinstance(raw, dict) and raw.get("stream") is True:
                events = completions.stream(tenant(request), raw, chat, cancel)
                return WatchedStream(
                    events,
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                    on_gone=cancel.set,
                )
            return await unless_disconnected(
                request, completions.answer(tenant(request), raw, chat, cancel), cancel.set
            )

        return await _openai(answer)

    @app.post(f"{V1}/completions")
    async def create_completion(request: Request) -> Any:
        return await complete(request, chat=False)

    @app.post(f"{V1}/chat/completions")
    async def create_chat_completion(request: Request) -> Any:
        return await complete(request, chat=True)

    @app.api_route(V1 + "/{route:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unknown_v1(request: Request, route: str) -> JSONResponse:
        return error_response(
            NotFound(f"this server does not implement {request.method} {V1}/{route}")
        )

    @app.get(ALIASES_ROUTE)
    async def list_aliases(request: Request) -> dict[str, Any]:
        return aliases.list(tenant(request))

    @app.get(f"{ALIASES_ROUTE}/{{alias}}")
    async def get_alias(alias: str, request: Request) -> dict[str, Any]:
        return aliases.get(tenant(request), alias)

    @app.put(f"{ALIASES_ROUTE}/{{alias}}")
    async def put_alias(alias: str, request: Request) -> dict[str, Any]:
        return aliases.put(tenant(request), alias, await bodies.json(request))

    @app.delete(f"{ALIASES_ROUTE}/{{alias}}")
    async def delete_alias(alias: str, request: Request) -> dict[str, Any]:
        return aliases.delete(tenant(request), alias)
