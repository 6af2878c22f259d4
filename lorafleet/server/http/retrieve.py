"""The long poll every operation ends in: a finished future's stored body as it was recorded
(JSON or protobuf), or `try_again` when it is not done within the poll."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lorafleet.server.http import API
from lorafleet.server.http.bodies import BodyReader, tenant
from lorafleet.server.http.disconnect import ClientGone, unless_disconnected
from lorafleet.server.ops.futures import Result
from lorafleet.server.state.keys import Tenant

Retrieve = Callable[[Tenant, Any], Awaitable[Result | None]]
"""`Service.retrieve`: waits for the future a body names; None when the poll ran out."""
PollLost = Callable[[Tenant, Any], None]
"""`Service.poll_lost`: the client hung up during the poll (its sample may be abandoned)."""


def add_routes(app: FastAPI, retrieve: Retrieve, bodies: BodyReader, lost: PollLost) -> None:

    @app.post(f"{API}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        who = tenant(request)
        data = await bodies.json(request)
        try:
            result = await unless_disconnected(
                request, retrieve(who, data), lambda: lost(who, data)
            )
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        if result is None:
            request_id = data.get("request_id") if isinstance(data, dict) else None
            return JSONResponse(
                {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            )
        return Response(result.body, media_type=result.content_type)
