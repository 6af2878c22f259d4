"""Errors that cross the HTTP boundary, each with the status and Tinker error category it maps to.

The SDK treats a 400 with an empty body as a proxy glitch and retries it 16 times, and retries
5xx for minutes; so every user mistake is a 4xx with a JSON body `{"error", "category"}`
whose message names the field and value, and failed operations are futures whose result is
that same JSON (the SDK raises `RequestFailedError` with the message).
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
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


# --------------------------------------------------------------------------- error text
# Exception text made fit for a tenant's eyes.
#
# Errors raised below the server (checkpoint readers, the filesystem, the engines) name absolute
# paths, and a server path holds the data dir, the model cache and the tenant's id. A tenant
# needs the reason, not where the file lives, so every such text that reaches a response goes
# through here: an absolute path keeps only its last component (the file the reason is about).
# An unexpected failure of a shared batch may be about any request in it, so only its type
# reaches the tenants; the server log has the rest.

# an absolute path: '/' not preceded by a word, a dot, '~', ':' or '/' (so URLs and
# tinker://run/segment/name stay whole), up to whitespace, a quote, a bracket or ':'
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~:/-])/[^\s'\"()\[\]{},:]*")


def _last_component(match: re.Match[str]) -> str:
    name = PurePosixPath(match.group()).name
    return name or "/"


def strip_paths(text: str) -> str:
    return _ABSOLUTE_PATH.sub(_last_component, text)


def exception_text(exc: BaseException) -> str:
    """The reason an error from below the server gives, without server paths. An OSError's
    str() leads with the path it failed on, so only its file name and reason are kept."""
    if isinstance(exc, OSError) and exc.strerror:
        name = PurePosixPath(str(exc.filename)).name if exc.filename is not None else ""
        return f"{name}: {exc.strerror}" if name else exc.strerror
    return strip_paths(str(exc))


def internal_error(doing: str, exc: BaseException) -> str:
    """The message for a failure that is the server's, not the request's."""
    return f"internal error while {doing}: {type(exc).__name__} (the server log has the details)"
