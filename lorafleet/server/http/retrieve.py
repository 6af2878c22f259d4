"""The long poll every operation ends in: a finished future's stored body as it was recorded
(JSON or protobuf), or `try_again` when it is not done within the poll."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lorafleet.server.http import API
from lorafleet.server.http.bodies import BodyReader, tenant
from lorafleet.server.ops.futures import Result
from lorafleet.server.state.keys import Tenant

Retrieve = Callable[[Tenant, Any], Awaitable[Result | None]]
"""`Service.retrieve`: waits for the future a body names; None when the poll ran out."""


def add_routes(app: FastAPI, retrieve: Retrieve, bodies: BodyReader) -> None:

    @app.post(f"{API}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        who = tenant(request)
        data = await bodies.json(request)
        result = await retrieve(who, data)
        if result is None:
            request_id = data.get("request_id") if isinstance(data, dict) else None
            return JSONResponse(
                {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            )
        return Response(result.body, media_type=result.content_type)
