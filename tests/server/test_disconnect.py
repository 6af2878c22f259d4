"""http/disconnect.py at the ASGI level: a client's disconnect is noticed while a response
streams or a handler waits, `on_gone` runs, and the stream's generator is closed at once (its
cleanup cancels the sample); a request that completes never calls `on_gone`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import Request

from lorafleet.server.http.disconnect import ClientGone, WatchedStream, unless_disconnected


class _Client:
    """ASGI receive/send of a client that hangs up once `hang_up` is set."""

    def __init__(self) -> None:
        self.hang_up = asyncio.Event()
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        await self.hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if message.get("body") == b"first":
            self.hang_up.set()  # the client reads one chunk and goes


def test_a_dropped_stream_calls_on_gone_and_closes_its_generator() -> None:
    closed: list[str] = []
    gone: list[bool] = []

    async def events() -> AsyncIterator[bytes]:
        try:
            yield b"first"
            await asyncio.Event().wait()  # the next token never comes
            yield b"never"
        finally:
            closed.append("generator")

    async def main() -> None:
        client = _Client()
        response = WatchedStream(events(), on_gone=lambda: gone.append(True))
        await asyncio.wait_for(response({"type": "http"}, client.receive, client.send), 5)

    asyncio.run(main())
    assert gone == [True] and closed == ["generator"]


def test_a_complete_stream_does_not_call_on_gone() -> None:
    gone: list[bool] = []

    async def events() -> AsyncIterator[bytes]:
        yield b"only"

    async def main() -> None:
        client = _Client()
        response = WatchedStream(events(), on_gone=lambda: gone.append(True))
        await response({"type": "http"}, client.receive, client.send)

    asyncio.run(main())
    assert gone == []


def test_a_waiting_handler_whose_client_hangs_up() -> None:
    gone: list[bool] = []
    cancelled: list[bool] = []

    async def work() -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return "never"

    async def main() -> None:
        client = _Client()
        request = Request({"type": "http", "method": "POST", "headers": []}, client.receive)
        asyncio.get_running_loop().call_later(0.05, client.hang_up.set)
        with pytest.raises(ClientGone):
            await unless_disconnected(request, work(), lambda: gone.append(True))
        await asyncio.sleep(0)

    asyncio.run(main())
    assert gone == [True] and cancelled == [True]


def test_a_handler_that_answers_first_never_calls_on_gone() -> None:
    gone: list[bool] = []

    async def work() -> str:
        return "answer"

    async def main() -> str:
        client = _Client()
        request = Request({"type": "http", "method": "POST", "headers": []}, client.receive)
        return await unless_disconnected(request, work(), lambda: gone.append(True))

    assert asyncio.run(main()) == "answer" and gone == []
