"""Expiring, tenant-scoped download links that the server serves itself.

The SDK fetches external-weights files and session traces with a plain `urllib` GET that
carries no API key, so the link's signature is the whole authorization: an HMAC-SHA256 over
(tenant, resource, expiry) under a secret that never leaves the data dir. A link names exactly
one resource of one tenant, stops working at its expiry, and cannot be bent to another resource
or tenant without the secret. Signatures are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from lorafleet.fsio import atomic_write_bytes
from lorafleet.server.errors import ApiError

SECRET_FILE = "url_signing.key"
SECRET_BYTES = 32
DEFAULT_TTL_S = 3600


class Forbidden(ApiError):
    """A link whose signature does not hold (forged, altered, expired)."""

    status = 403


def load_or_create_secret(data_dir: Path) -> bytes:
    """The data dir's signing secret, created (0600) on first use. A secret file of the wrong
    size or readable by others is refused rather than replaced: replacing it would silently
    break every link handed out, and a readable one may already be known."""
    path = data_dir / SECRET_FILE
    if not path.exists():
        atomic_write_bytes(path, secrets.token_bytes(SECRET_BYTES))
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise RuntimeError(
            f"{path} has mode {mode:o}; the URL signing secret must be owner-only (0600)"
        )
    secret = path.read_bytes()
    if len(secret) != SECRET_BYTES:
        raise RuntimeError(
            f"{path} holds {len(secret)} bytes, not a {SECRET_BYTES}-byte URL signing secret; "
            "remove it to have a new one made (links handed out before stop working)"
        )
    return secret


@dataclass(frozen=True)
class SignedLink:
    query: dict[str, str]  # tenant, expires, sig: what the link carries besides its path
    expires: int  # unix seconds


class UrlSigner:
    def __init__(self, secret: bytes, ttl_s: int = DEFAULT_TTL_S):
        if len(secret) < 16:
            raise ValueError(f"the URL signing secret must be at least 16 bytes, got {len(secret)}")
        if ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1, got {ttl_s}")
        self._secret = secret
        self.ttl_s = ttl_s

    def _mac(self, tenant: str, resource: str, expires: int) -> str:
        message = f"{tenant}\n{resource}\n{expires}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def sign(self, tenant: str, resource: str, now: float | None = None) -> SignedLink:
        expires = int(time.time() if now is None else now) + self.ttl_s
        sig = self._mac(tenant, resource, expires)
        return SignedLink({"tenant": tenant, "expires": str(expires), "sig": sig}, expires)

    def verify(
        self,
        tenant: str | None,
        resource: str,
        expires: str | None,
        sig: str | None,
        now: float | None = None,
    ) -> str:
        """Returns the tenant the link was signed for; raises Forbidden otherwise. The message
        does not say which part failed beyond "expired", so a forger learns nothing."""
        if not tenant or not expires or not sig or not expires.isdigit() or len(expires) > 12:
            raise Forbidden(
                "this download link is not signed (tenant, expires and sig are required)"
            )
        expected = self._mac(tenant, resource, int(expires))
        if not hmac.compare_digest(expected.encode(), sig.encode()):
            raise Forbidden("this download link's signature does not match")
        if int(expires) <= (time.time() if now is None else now):
            raise Forbidden(
                "this download link has expired; ask for new ones (get_external_weights_urls)"
            )
        return tenant
