"""Staging: atomic private directories, the authenticated transfer, and input validation."""

from __future__ import annotations

import hashlib
import http.client
import io
import json
import stat
from pathlib import Path

import pytest

from lorafleet.sync.base import AdapterVersion, EngineHTTPError, OffloadLevel, SyncMode
from lorafleet.sync.files import LocalStaging, RemoteStaging
from lorafleet.sync.httpclient import validate_api_key, validate_base_url
from lorafleet.sync.staging_server import (
    MAGIC,
    StagingError,
    encode_directory,
    receive,
    serve_in_thread,
)

TOKEN = "a-staging-token-of-some-length"


def make_dir(path: Path, files: dict[str, bytes]) -> Path:
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def writer(files: dict[str, bytes]):
    def write(dest: Path) -> None:
        make_dir(dest, files)

    return write


def stream_of(
    files: list[tuple[str, bytes]], *, digest: str | None = None, count: int | None = None
) -> bytes:
    body = bytearray(MAGIC)
    for name, data in files:
        body += (json.dumps({"file": name, "size": len(data)}) + "\n").encode() + data
    sha = digest or hashlib.sha256(bytes(body)).hexdigest()
    body += (
        json.dumps({"end": True, "files": len(files) if count is None else count, "sha256": sha})
        + "\n"
    ).encode()
    return bytes(body)


def test_remote_upload_round_trip_is_private_and_complete(tmp_path):
    files = {
        "adapter_config.json": b'{"r": 4}',
        "adapter_model.safetensors": bytes(range(256)) * 5000,
    }
    with serve_in_thread(tmp_path / "remote", TOKEN) as server:
        staging = RemoteStaging(server.url, TOKEN, scratch=tmp_path / "scratch")
        path = Path(staging.stage("a@3", writer(files)))
        assert path == (tmp_path / "remote" / "a@3").resolve()
        assert {p.name: p.read_bytes() for p in path.iterdir()} == files
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in path.iterdir())
        assert not any((tmp_path / "scratch").iterdir())  # the local copy is gone once uploaded
        assert [p.name for p in (tmp_path / "remote").iterdir()] == ["a@3"]  # no temp leftovers
        with pytest.raises(EngineHTTPError, match="HTTP 409"):
            staging.stage("a@3", writer(files))  # versions are immutable
        staging.remove("a@3")
        assert not path.exists()
        staging.close()


@pytest.mark.parametrize("token", [None, "wrong-token-wrong-token"])
def test_the_receiver_needs_the_token(tmp_path, token):
    with serve_in_thread(tmp_path / "remote", TOKEN) as server:
        source = make_dir(tmp_path / "src", {"f.json": b"{}"})
        length, chunks = encode_directory(source)
        conn = http.client.HTTPConnection(
            server.server_address[0], server.server_address[1], timeout=10
        )
        headers = {"Content-Length": str(length)}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        conn.request("PUT", "/v1/staging/a@0", body=b"".join(chunks), headers=headers)
        assert conn.getresponse().status == 401
        assert not any((tmp_path / "remote").iterdir())


def test_the_receiver_requires_an_exact_length(tmp_path):
    with serve_in_thread(tmp_path / "remote", TOKEN) as server:
        conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
        conn.request(
            "PUT",
            "/v1/staging/a@0",
            body=iter([MAGIC]),
            headers={"Authorization": f"Bearer {TOKEN}"},
            encode_chunked=True,
        )
        assert conn.getresponse().status == 411


@pytest.mark.parametrize(
    "name", ["..", "../escape", ".hidden", "a/b", "a b", "", "x" * 200, "%2e%2e"]
)
def test_bad_directory_names_are_refused(tmp_path, name):
    (tmp_path / "root").mkdir()
    body = stream_of([("f", b"x")])
    with pytest.raises(StagingError):
        receive(tmp_path / "root", name, io.BytesIO(body), len(body))
    assert list((tmp_path / "root").iterdir()) == []


@pytest.mark.parametrize("file_name", ["../evil", "/etc/passwd", ".bashrc", "sub/file", ""])
def test_bad_file_names_are_refused_and_nothing_is_written(tmp_path, file_name):
    root = tmp_path / "root"
    root.mkdir()
    body = stream_of([("ok.json", b"{}"), (file_name, b"owned")])
    with pytest.raises(StagingError):
        receive(root, "a@1", io.BytesIO(body), len(body))
    assert list(root.iterdir()) == []
    assert not (tmp_path / "evil").exists()


@pytest.mark.parametrize("damage", ["truncated", "bad_digest", "wrong_count", "bad_magic"])
def test_damaged_uploads_publish_nothing(tmp_path, damage):
    root = tmp_path / "root"
    root.mkdir()
    files = [("a.bin", b"0123456789" * 100)]
    body = stream_of(files)
    if damage == "truncated":
        body = body[:-40]
    elif damage == "bad_digest":
        body = stream_of(files, digest="0" * 64)
    elif damage == "wrong_count":
        body = stream_of(files, count=2)
    else:
        body = b"NOTSTAGE" + body[8:]
    with pytest.raises(StagingError):
        receive(root, "a@1", io.BytesIO(body), len(body))
    assert list(root.iterdir()) == []


def test_only_flat_regular_files_are_sent(tmp_path):
    source = make_dir(tmp_path / "src", {"a.json": b"{}"})
    (source / "sub").mkdir()
    with pytest.raises(StagingError, match="only regular files"):
        encode_directory(source)
    (source / "sub").rmdir()
    (source / "link").symlink_to(source / "a.json")
    with pytest.raises(StagingError, match="only regular files"):
        encode_directory(source)


def test_local_staging_is_atomic_private_and_validated(tmp_path):
    with pytest.raises(ValueError, match="absolute"):
        LocalStaging("relative/dir")
    with pytest.raises(ValueError, match=r"'\.\.'"):
        LocalStaging(str(tmp_path) + "/a/../b")
    staging = LocalStaging(tmp_path / "stage")
    assert stat.S_IMODE((tmp_path / "stage").stat().st_mode) == 0o700
    for bad in ("../x", ".x", "a/b"):
        with pytest.raises(StagingError):
            staging.path(bad)

    def failing(dest: Path) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        staging.stage("a@0", failing)
    assert list((tmp_path / "stage").iterdir()) == []


@pytest.mark.parametrize(
    "url",
    [
        "ftp://host/x",
        "host:8000",
        "http://",
        "http://user:pw@host:1",
        "http://h:1/?q=1",
        "http://h:1/#f",
        "http://h:99999",
        "",
    ],
)
def test_engine_urls_are_validated(url):
    with pytest.raises(ValueError):
        validate_base_url(url)


def test_good_urls_and_keys_pass():
    assert validate_base_url("https://engine.internal:8000/") == "https://engine.internal:8000"
    assert validate_base_url("http://127.0.0.1:8000/prefix") == "http://127.0.0.1:8000/prefix"
    assert validate_api_key("sk-abc") == "sk-abc" and validate_api_key(None) is None
    for bad in ("", "has space", "new\nline"):
        with pytest.raises(ValueError):
            validate_api_key(bad)


def test_version_names_and_enums_are_validated():
    assert AdapterVersion.parse("run-1.a@12") == AdapterVersion("run-1.a", 12)
    assert AdapterVersion("a", 3).name == "a@3"
    for bad in ("a", "a@-1", "../a@1", "a@1@2", ".a@1"):
        with pytest.raises(ValueError):
            AdapterVersion.parse(bad)
    with pytest.raises(ValueError, match="adapter_id"):
        AdapterVersion("a/b", 0)
    with pytest.raises(ValueError, match="sync mode"):
        SyncMode.parse("rsync")
    with pytest.raises(ValueError, match="offload level"):
        OffloadLevel.parse(3)
