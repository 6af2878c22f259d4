"""What every route reads from its request: the authenticated caller and the body.

Bodies are read incrementally under a size limit and a deadline, so an oversized or trickled
body costs the server at most the limit in memory and the deadline in time."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from lorafleet.server.errors import UserError
from lorafleet.server.http import schemas
from lorafleet.server.state.keys import Tenant


def tenant(request: Request) -> Tenant:
    """The caller as `KeyGate` authenticated it: the gate runs before every route but the
    public ones, which never ask."""
    who: Tenant = request.state.tenant
    return who


@dataclass(frozen=True)
class BodyReader:
    """The server's body limits (`ServerConfig`): protobuf and JSON have their own size limit."""

    max_body_bytes: int
    max_json_bytes: int
    timeout_s: float

    async def raw(self, request: Request, limit: int) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise UserError(
                f"request body of {declared} bytes is larger than this server's limit of {limit} for {request.url.path}",
                status=413,
            )
        chunks: list[bytes] = []
        size = 0
        timeout = self.timeout_s
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

    async def protobuf(self, request: Request) -> bytes:
        return await self.raw(request, self.max_body_bytes)

    async def json(self, request: Request) -> Any:
        return schemas.parse_json(await self.raw(request, self.max_json_bytes))
