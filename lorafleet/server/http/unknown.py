"""The catch-all for API paths no other route serves; registered after every other group, so
that every method the SDK may call answers with a 404 naming what this server lacks.

The SDK numbers a training client's call (its `seq_id`) before sending it, so a call to a route
this server lacks would leave a hole in the model's order that every later call waits on. Such
a request still takes its seq_id place, as a failed operation, and is answered with a 404 that
names the route."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from lorafleet.server.errors import ApiError, NotFound
from lorafleet.server.http import API, parse, schemas
from lorafleet.server.http.off_loop import OffLoop
from lorafleet.server.http.training import Training
from lorafleet.server.state.keys import Tenant


def add_routes(app: FastAPI, training: Training, off: OffLoop) -> None:
    """Call last: a route registered after this one would never be reached by a POST."""

    @app.post(API + "/{route:path}")
    async def unknown_route(request: Request, route: str) -> dict[str, Any]:
        error = NotFound(f"this server does not implement POST {API}/{route}")
        if getattr(request.state, "tenant", None) is None:
            raise error  # a public path (the key gate let it through): nothing more to read

        def refuse(who: Tenant, raw: bytes) -> None:
            try:
                body = schemas.parse_json(raw)
            except ApiError:
                raise error from None  # not JSON: no model or seq_id to account for
            fingerprint = parse.fingerprint(raw + route.encode())
            try:
                training.refuse_in_order(who, body, error, fingerprint)
            except ApiError as exc:
                raise NotFound(
                    f"{error.message}; its seq_id was not recorded: {exc.message}"
                ) from None

        await off.raw_json(request, refuse)
        raise error

    @app.api_route(API + "/{route:path}", methods=["GET", "PUT", "DELETE", "PATCH"])
    async def unknown_resource(request: Request, route: str) -> dict[str, Any]:
        raise NotFound(f"this server does not implement {request.method} {API}/{route}")
