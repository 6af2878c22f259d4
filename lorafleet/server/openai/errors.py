"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, which the
`openai` package reads into its exception classes; the statuses are the server's own."""

from __future__ import annotations

import json
from typing import Any

from lorafleet.server.errors import ApiError, UserError

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
_CODES = {401: "invalid_api_key", 429: "rate_limit_exceeded"}


class OpenAIError(UserError):
    """A bad request whose `param` names the field at fault (OpenAI's `error.param`)."""

    def __init__(
        self, message: str, param: str | None, *, code: str | None = None, status: int = 400
    ):
        super().__init__(message, status=status)
        self.param = param
        self.code = code


def unsupported(field: str, why: str) -> OpenAIError:
    """A field whose meaning this server cannot honour: refused, never silently ignored."""
    return OpenAIError(f"{field} is not supported by this server: {why}", field, code="unsupported")


def model_not_found(model: object) -> OpenAIError:
    """The same answer for a model that does not exist and one of another tenant's."""
    return OpenAIError(
        f"The model {model!r} does not exist or you do not have access to it.",
        "model",
        code="model_not_found",
        status=404,
    )


def body(exc: ApiError) -> dict[str, Any]:
    status = exc.status
    if status >= 500:
        kind = "server_error"
    elif status == 429:
        kind = "rate_limit_error"
    else:
        kind = _TYPES.get(status, "invalid_request_error")
    return {
        "error": {
            "message": exc.message,
            "type": kind,
            "param": getattr(exc, "param", None),
            "code": getattr(exc, "code", None) or _CODES.get(status),
        }
    }


def from_failed_result(raw: bytes) -> ApiError:
    """A failed sample's future holds the Tinker error JSON (`{"error", "category"}`): a user
    error is a 400, anything else the server's fault."""
    try:
        data = json.loads(raw)
        message = str(data["error"])
        category = data.get("category")
    except (ValueError, KeyError, TypeError):
        return ApiError("the sample failed (its error could not be read)", status=500)
    if category == "user":
        return UserError(message)
    return ApiError(message, status=500, category="server")
