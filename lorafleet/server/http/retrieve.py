"""The long poll every operation ends in: a finished future's stored body as it was recorded
(JSON or protobuf), or `try_again` when it is not done within the poll.

The body is parsed and the future found (a result that left memory is read back from SQLite)
off the loop, in the caller's lane; the wait itself parks on the loop, holding no worker. The
poll's length is read per request (`long_poll_s()`), as the config says at that moment."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lorafleet.server.http import API, schemas
from lorafleet.server.http.bodies import tenant
from lorafleet.server.http.disconnect import ClientGone, unless_disconnected
from lorafleet.server.http.off_loop import OffLoop
from lorafleet.server.ops.abandoned import AbandonedSamples
from lorafleet.server.ops.futures import FutureEntry, FutureTable, Result
from lorafleet.server.state.keys import Tenant


def add_routes(
    app: FastAPI,
    futures: FutureTable,
    long_poll_s: Callable[[], float],
    off: OffLoop,
    abandoned: AbandonedSamples,
) -> None:

    def find(who: Tenant, body: Any) -> tuple[str, FutureEntry]:
        req = schemas.parse(schemas.RetrieveFuture, body)
        return req.request_id, futures.find(req.request_id, who.id)

    async def wait(request_id: str, tenant_id: str, entry: FutureEntry) -> Result | None:
        abandoned.poll_began(request_id, tenant_id)
        try:
            return await futures.wait_on(entry, long_poll_s())
        finally:
            abandoned.poll_ended(request_id, tenant_id)

    @app.post(f"{API}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        request_id, entry = await off.json(request, find)
        who = tenant(request).id
        try:
            # a client that hangs up mid-poll and does not poll again within the grace has
            # abandoned its sample (ops/abandoned.py)
            result = await unless_disconnected(
                request,
                wait(request_id, who, entry),
                lambda: abandoned.poll_lost(request_id, who),
            )
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        if result is None:
            return JSONResponse(
                {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            )
        return Response(result.body, media_type=result.content_type)
