"""The download-link signer: the secret file's creation and checks, and what a signature covers."""

from __future__ import annotations

import os
import stat

import pytest

from lorafleet.server.http.signed_urls import (
    SECRET_BYTES,
    SECRET_FILE,
    Forbidden,
    UrlSigner,
    load_or_create_secret,
)


def test_secret_is_created_owner_only_and_kept(tmp_path):
    secret = load_or_create_secret(tmp_path)
    assert len(secret) == SECRET_BYTES
    assert stat.S_IMODE((tmp_path / SECRET_FILE).stat().st_mode) == 0o600
    assert load_or_create_secret(tmp_path) == secret  # a restart keeps handed-out links valid


def test_secret_readable_by_others_or_truncated_is_refused_not_replaced(tmp_path):
    path = tmp_path / SECRET_FILE
    load_or_create_secret(tmp_path)
    os.chmod(path, 0o644)
    with pytest.raises(RuntimeError, match="owner-only"):
        load_or_create_secret(tmp_path)
    os.chmod(path, 0o600)
    path.write_bytes(b"short")
    with pytest.raises(RuntimeError, match="5 bytes"):
        load_or_create_secret(tmp_path)
    assert path.read_bytes() == b"short"


def test_signature_covers_tenant_resource_and_expiry():
    signer = UrlSigner(b"k" * 32, ttl_s=60)
    link = signer.sign("tenant-a", "tinker://r/external_weights/n/f", now=1000.0)
    q = link.query
    assert link.expires == 1060 and q["expires"] == "1060"
    assert (
        signer.verify(
            q["tenant"], "tinker://r/external_weights/n/f", q["expires"], q["sig"], now=1059.0
        )
        == "tenant-a"
    )
    bad = [
        ("tenant-b", "tinker://r/external_weights/n/f", q["expires"], q["sig"], 1059.0),
        ("tenant-a", "tinker://r/external_weights/n/g", q["expires"], q["sig"], 1059.0),
        ("tenant-a", "tinker://r/external_weights/n/f", "1061", q["sig"], 1059.0),
        ("tenant-a", "tinker://r/external_weights/n/f", q["expires"], q["sig"], 1060.0),
        ("tenant-a", "tinker://r/external_weights/n/f", q["expires"], None, 1059.0),
        ("tenant-a", "tinker://r/external_weights/n/f", "-5", q["sig"], 1059.0),
    ]
    for tenant, resource, expires, sig, now in bad:
        with pytest.raises(Forbidden) as refused:
            signer.verify(tenant, resource, expires, sig, now=now)
        assert refused.value.status == 403
    other = UrlSigner(b"j" * 32, ttl_s=60)
    with pytest.raises(Forbidden):
        other.verify(
            q["tenant"], "tinker://r/external_weights/n/f", q["expires"], q["sig"], now=1059.0
        )
