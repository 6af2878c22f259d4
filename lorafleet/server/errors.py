"""Errors that cross the HTTP boundary, each with the status and Tinker error category it maps to.

The SDK treats a 400 with an empty body as a proxy glitch and retries it 16 times, and retries
5xx for minutes; so every user mistake is a 4xx with a JSON body `{"error", "category"}`
whose message names the field and value, and failed operations are futures whose result is
that same JSON (the SDK raises `RequestFailedError` with the message).
"""

from __future__ import annotations

from typing import Literal

Category = Literal["user", "server", "unknown"]


class ApiError(Exception):
    """An error with an HTTP status and a Tinker error category."""

    status: int = 400
    category: Category = "user"

    def __init__(
        self, message: str, *, status: int | None = None, category: Category | None = None
    ):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if category is not None:
            self.category = category

    def body(self) -> dict[str, str]:
        return {"error": self.message, "category": self.category}

    def headers(self) -> dict[str, str]:
        """Response headers besides the body (Retry-After on a 429, say)."""
        return {}


class UserError(ApiError):
    """Bad input: the client must change the request."""


class NotFound(UserError):
    """Unknown id, or one owned by another tenant (indistinguishable on purpose)."""

    status = 404


class Unauthorized(UserError):
    status = 401


class Conflict(UserError):
    """A seq_id reused with a different payload. 400 rather than 409: the SDK retries 409."""


class ServerFault(ApiError):
    """Our failure (engine crash, restart); the request itself may be fine."""

    status = 500
    category = "server"


class DiskFull(ServerFault):
    """The server's data disk is full: nothing is wrong with the request, and it can succeed
    once space is freed (deleting checkpoints frees it, without a restart)."""

    status = 507
