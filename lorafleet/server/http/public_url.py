"""The address this server's links and redirects name: the configured `--public-url`, never a
request's `Host` header.

A signed download link or an archive redirect built from `Host` points wherever the request
said the server was: a request sent with a forged `Host` (or through a proxy that passes one on)
gets a link to another machine, carrying a valid signature for one of the tenant's checkpoints.
The address comes from configuration instead: `--public-url` when the server sits behind a
proxy or a DNS name, else the address it listens on (a wildcard bind is named as loopback, and
start-up warns that links then only work on this machine)."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

_WILDCARDS = {"", "0.0.0.0", "::", "[::]"}


def check_public_url(value: str) -> str:
    """`value` as a base URL (http or https, a host, no query or fragment), without a trailing
    slash; ValueError naming what is wrong otherwise."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"--public-url must be an http(s) URL, got {value!r}")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"--public-url must be an http:// or https:// URL with a host, got {value!r}"
        )
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(
            f"--public-url must not carry a query, fragment or credentials, got {value!r}"
        )
    return value.rstrip("/")


def public_base_url(public_url: str | None, host: str, port: int) -> str:
    """The base every link and redirect starts with (see the module docstring)."""
    if public_url is not None:
        return check_public_url(public_url)
    if host in _WILDCARDS:
        log.warning(
            "no --public-url: download links and archive redirects name 127.0.0.1:%d, which only "
            "this machine reaches; pass --public-url with the address clients use",
            port,
        )
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal
    return f"http://{host}:{port}"
