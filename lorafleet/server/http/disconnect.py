"""Noticing a client that hung up while its request waits, so the work it asked for stops.

uvicorn tells an application that its client is gone only through `receive()`
(`http.disconnect`), and with ASGI 2.4 Starlette no longer listens for it while a response
streams: a dropped stream is noticed at its next write, and a waiting handler (a long-poll, a
non-streamed completion) not at all. Both helpers here listen while the work runs; the
caller says what "gone" means for it (`on_gone`: set the sample's cancel event, or mark a
long-poll abandoned). The request body must have been read already: after it, `receive()`
answers only at a disconnect (or once the response is complete).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready (nobody reads what follows)."""


async def _until_disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(
    request: Request, work: Awaitable[T], on_gone: Callable[[], None]
) -> T:
    """`work`'s value; if the client disconnects first, `on_gone()` runs, `work` is cancelled
    and ClientGone is raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        on_gone()
        task.cancel()
        raise ClientGone()
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()


class WatchedStream(StreamingResponse):
    """A StreamingResponse that listens for the client's disconnect while it streams (as
    Starlette did before ASGI 2.4), then runs `on_gone` and closes the body iterator at once,
    so the generator's cleanup (cancelling the sample) does not wait for the next write."""

    def __init__(self, *args: object, on_gone: Callable[[], None], **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.on_gone = on_gone

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(_until_disconnected(receive))
        try:
            await asyncio.wait({streaming, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not streaming.done():
                self.on_gone()
                streaming.cancel()
                await asyncio.gather(streaming, return_exceptions=True)
            else:
                streaming.result()  # an error of the stream's own is raised
        except OSError:  # the client went away under a write
            self.on_gone()
        finally:
            watcher.cancel()
            if not streaming.done():  # this task itself was cancelled (shutdown)
                streaming.cancel()
                await asyncio.gather(streaming, return_exceptions=True)
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
