"""One small JSON-over-HTTP client for the engines and the staging receiver.

Engine URLs come from configuration and API keys travel with every request, so the URL is
validated before the first byte leaves: http or https only, a host, no user:password part
(it would end up in logs), no query or fragment (they would be silently dropped or mangled
when paths are appended). Errors always name the URL and the status and quote the body,
because "load failed" without vLLM's own message is undebuggable.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import httpx

from lorafleet.sync.base import EngineHTTPError

__all__ = ["JsonClient", "validate_api_key", "validate_base_url"]

DEFAULT_TIMEOUT_S = 300.0


def validate_base_url(url: str, field: str = "base_url") -> str:
    """Returns `url` without a trailing slash, or raises ValueError naming the problem."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"{field} must be a non-empty string, got {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{field} must use http or https, got {url!r}")
    if not parts.hostname:
        raise ValueError(f"{field} has no host: {url!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            f"{field} must not carry credentials (pass api_key instead): {parts.scheme}://...@{parts.hostname}"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"{field} must not have a query or fragment: {url!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ValueError(f"{field} has an invalid port: {url!r}") from exc
    return url.rstrip("/")


def validate_api_key(key: str | None, field: str = "api_key") -> str | None:
    """None (no auth) or a printable token without whitespace (it goes into a header)."""
    if key is None:
        return None
    if not isinstance(key, str) or not key:
        raise ValueError(f"{field} must be a non-empty string or None")
    if any(c.isspace() or not c.isprintable() for c in key):
        raise ValueError(f"{field} must not contain whitespace or control characters")
    return key


class JsonClient:
    """httpx.Client bound to one base URL, sending `Authorization: Bearer <api_key>` if set."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        what: str = "engine",
        verify: bool | str = True,
    ):
        self.base_url = validate_base_url(base_url)
        self.what = what
        headers = {"Accept": "application/json"}
        key = validate_api_key(api_key)
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        self.http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, verify=verify
        )

    def close(self) -> None:
        self.http.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict[str, Any] | None = None,
        expect_json: bool = True,
        ok_statuses: tuple[int, ...] = (200,),
        **kwargs: Any,
    ) -> Any:
        url = f"{self.base_url}{path}"
        try:
            response = self.http.request(method, path, json=json_body, params=params, **kwargs)
        except httpx.HTTPError as exc:
            raise EngineHTTPError(
                f"{self.what} at {url}: {type(exc).__name__}: {exc}", url=url
            ) from exc
        if response.status_code not in ok_statuses:
            raise EngineHTTPError(
                f"{self.what} at {url} answered HTTP {response.status_code}: {_excerpt(response.text)}",
                status=response.status_code,
                url=url,
            )
        if not expect_json:
            return response.text
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EngineHTTPError(
                f"{self.what} at {url} answered HTTP {response.status_code} with a body that is not JSON: "
                f"{_excerpt(response.text)}",
                status=response.status_code,
                url=url,
            ) from exc

    def post(self, path: str, body: Any = None, **kwargs: Any) -> Any:
        return self.request("POST", path, json_body=body, **kwargs)

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.request("GET", path, **kwargs)


def _excerpt(text: str, limit: int = 500) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + " ..."
