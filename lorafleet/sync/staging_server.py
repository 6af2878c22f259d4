"""Staging receiver: takes adapter (or merged-weight) directories over authenticated HTTP and
publishes them atomically on the engine's host, for engines that load from a local path.

A disaggregated engine (vLLM, SGLang on another machine) loads adapters from *its* filesystem,
and nothing says the trainer's files are visible there. So the trainer uploads each staged
directory to this small server, run next to the engine:

    python -m lorafleet.sync.staging_server --root /srv/lorafleet-staging --port 8471 \
        --token-file /etc/lorafleet/staging.token        # or env LORAFLEET_STAGING_TOKEN

It uses the standard library only (no torch import), so it runs in the engine's own venv, or
as `python path/to/staging_server.py`. It binds 127.0.0.1 unless told otherwise; across
hosts, put it on a trusted network or behind TLS: the token is a bearer secret.

Wire format of `PUT /v1/staging/<name>` (exact Content-Length required, so no chunked
decoding is needed on this side):

    LFSTAGE1\\n
    {"file": "<name>", "size": <n>}\\n  <n raw bytes>      (once per file, flat directory)
    {"end": true, "files": <count>, "sha256": "<hex>"}\\n  (SHA-256 of every byte before it)

Rules: Bearer token compared in constant time; directory and file names are single path
components from a strict alphabet (no '/', no leading '.', no '..'); regular files only;
the directory is written under a private temp name (0700, files 0600, fsynced) and renamed
into place only after the trailer checks out, so the engine never sees a partial upload;
an existing name is never overwritten (versions are immutable): 409. `DELETE` removes one.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

MAGIC = b"LFSTAGE1\n"
ROUTE = "/v1/staging/"
TOKEN_ENV = "LORAFLEET_STAGING_TOKEN"
MIN_TOKEN_CHARS = 16
DEFAULT_MAX_BYTES = 64 << 30
_HEADER_MAX = 4096
_CHUNK = 1 << 20
_LINGER_S = 2.0
_LINGER_BYTES = 64 << 20

DIR_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._@-]{0,127}")
FILE_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


class StagingError(ValueError):
    """A staging name, file or stream that breaks the rules above."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.status = status


def check_dir_name(name: str) -> str:
    if not isinstance(name, str) or not DIR_NAME_RE.fullmatch(name) or ".." in name:
        raise StagingError(
            f"staging name {name!r} must be one path component of letters, digits, '._@-', not starting with '.'"
        )
    return name


def check_file_name(name: object) -> str:
    if not isinstance(name, str) or not FILE_NAME_RE.fullmatch(name) or ".." in name:
        raise StagingError(
            f"staged file name {name!r} must be one path component of letters, digits, '._-', not starting with '.'"
        )
    return name


# ----------------------------------------------------------------------------- client side


def directory_files(directory: Path) -> list[Path]:
    """The regular files of a flat directory, sorted; anything else in it is an error."""
    files: list[Path] = []
    for entry in sorted(directory.iterdir()):
        if entry.is_symlink() or not entry.is_file():
            raise StagingError(
                f"{entry}: only regular files can be staged (no links or subdirectories)"
            )
        check_file_name(entry.name)
        files.append(entry)
    if not files:
        raise StagingError(f"{directory} holds no files to stage")
    return files


def encode_directory(directory: Path) -> tuple[int, Iterator[bytes]]:
    """(exact byte length, chunk iterator) of the upload body for `directory`."""
    files = directory_files(directory)
    headers = [
        (json.dumps({"file": f.name, "size": f.stat().st_size}, sort_keys=True) + "\n").encode()
        for f in files
    ]
    body_len = len(MAGIC) + sum(len(h) for h in headers) + sum(f.stat().st_size for f in files)
    trailer_len = len(_trailer(len(files), "0" * 64))

    def chunks() -> Iterator[bytes]:
        digest = hashlib.sha256()
        for piece in _pieces(files, headers):
            digest.update(piece)
            yield piece
        yield _trailer(len(files), digest.hexdigest())

    return body_len + trailer_len, chunks()


def _pieces(files: list[Path], headers: list[bytes]) -> Iterator[bytes]:
    yield MAGIC
    for path, header in zip(files, headers, strict=True):
        yield header
        expected = int(json.loads(header)["size"])
        sent = 0
        with open(path, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                sent += len(chunk)
                yield chunk
        if sent != expected:
            raise StagingError(
                f"{path} changed size while being uploaded ({expected} -> {sent} bytes)"
            )


def _trailer(count: int, hexdigest: str) -> bytes:
    return (
        json.dumps({"end": True, "files": count, "sha256": hexdigest}, sort_keys=True) + "\n"
    ).encode()


# ----------------------------------------------------------------------------- server side


class _Body:
    """Reads exactly Content-Length bytes from the socket, hashing everything but the trailer."""

    def __init__(self, stream: Any, length: int):
        self.stream = stream
        self.left = length
        self.digest = hashlib.sha256()

    def read(self, n: int, *, hashed: bool = True) -> bytes:
        if n > self.left:
            raise StagingError("upload is shorter than its own headers say")
        data = self.stream.read(n)
        if len(data) != n:
            raise StagingError("connection closed before the upload was complete")
        self.left -= n
        if hashed:
            self.digest.update(data)
        return data

    def line(self) -> bytes:
        """One JSON header line (not hashed yet: the trailer line must not hash itself)."""
        buf = bytearray()
        while not buf.endswith(b"\n"):
            if len(buf) >= _HEADER_MAX:
                raise StagingError(f"header line longer than {_HEADER_MAX} bytes")
            buf += self.read(1, hashed=False)
        return bytes(buf)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def receive(root: Path, name: str, stream: Any, length: int) -> dict[str, Any]:
    """Reads one upload from `stream` and publishes it as root/name; returns the reply body."""
    check_dir_name(name)
    dest = root / name
    if os.path.lexists(dest):
        raise StagingError(
            f"{name!r} is already staged (versions are immutable)", HTTPStatus.CONFLICT
        )
    body = _Body(stream, length)
    if body.read(len(MAGIC)) != MAGIC:
        raise StagingError("not a lorafleet staging upload (bad magic)")
    tmp = Path(os.path.realpath(root)) / f".{name}.{secrets.token_hex(6)}.incoming"
    tmp.mkdir(mode=0o700)
    try:
        names: list[str] = []
        while True:
            raw = body.line()
            try:
                header = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise StagingError(f"bad header line: {exc}") from exc
            if not isinstance(header, dict):
                raise StagingError("header line must be a JSON object")
            if header.get("end") is True:
                if (
                    header.get("files") != len(names)
                    or header.get("sha256") != body.digest.hexdigest()
                ):
                    raise StagingError(
                        "upload trailer does not match what was received (truncated or corrupted)"
                    )
                if body.left != 0:
                    raise StagingError("bytes after the trailer")
                break
            body.digest.update(raw)
            file_name = check_file_name(header.get("file"))
            size = header.get("size")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise StagingError(f"bad size {size!r} for {file_name!r}")
            if file_name in names:
                raise StagingError(f"file {file_name!r} sent twice")
            names.append(file_name)
            fd = os.open(tmp / file_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                left = size
                while left:
                    chunk = body.read(min(_CHUNK, left))
                    out.write(chunk)
                    left -= len(chunk)
                out.flush()
                os.fsync(out.fileno())
        if not names:
            raise StagingError("upload holds no files")
        _fsync_dir(tmp)
        if os.path.lexists(dest):
            raise StagingError(f"{name!r} was staged concurrently", HTTPStatus.CONFLICT)
        os.rename(tmp, dest)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"path": str(Path(os.path.realpath(root)) / name), "files": names, "bytes": length}


def remove(root: Path, name: str) -> dict[str, Any]:
    check_dir_name(name)
    dest = root / name
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise StagingError(f"{name!r} is not a staged directory")
    existed = dest.is_dir()
    if existed:
        shutil.rmtree(dest)
        _fsync_dir(root)
    return {"removed": existed, "name": name}


class StagingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], root: Path, token: str, max_bytes: int = DEFAULT_MAX_BYTES
    ):
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"the staging token must have at least {MIN_TOKEN_CHARS} characters")
        root = Path(root)
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not root.is_dir() or root.is_symlink():
            raise ValueError(f"staging root {root} must be a real directory")
        self.root = root.resolve()
        self.token = token.encode()
        self.max_bytes = max_bytes
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        assert isinstance(host, str)  # an AF_INET address is (str, int)
        return f"http://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: StagingServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # stdlib signature
        if os.environ.get("LORAFLEET_STAGING_VERBOSE"):
            super().log_message(format, *args)

    def _reply(self, status: int, body: dict[str, Any], *, unread_body: bool = False) -> None:
        data = (json.dumps(body) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if unread_body:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        if unread_body:
            self._linger()

    def _linger(self) -> None:
        """Closing a socket with unread request bytes makes the kernel send a reset, which can
        destroy the error reply before the client reads it. So: send the reply, shut our side,
        and discard what the client is still sending, for a bounded time and amount."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(_LINGER_S)
            deadline = time.monotonic() + _LINGER_S
            drained = 0
            while drained < _LINGER_BYTES and time.monotonic() < deadline:
                chunk = self.connection.recv(_CHUNK)
                if not chunk:
                    break
                drained += len(chunk)

    def _authorized(self) -> bool:
        header = self.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.server.token
        ):
            self._reply(
                HTTPStatus.UNAUTHORIZED,
                {"error": "missing or wrong bearer token"},
                unread_body=True,
            )
            return False
        return True

    def _name(self) -> str | None:
        if not self.path.startswith(ROUTE):
            self._reply(
                HTTPStatus.NOT_FOUND, {"error": f"no route {self.path!r}"}, unread_body=True
            )
            return None
        return self.path[len(ROUTE) :]

    def do_GET(self) -> None:  # stdlib naming
        if self.path == "/healthz":
            self._reply(HTTPStatus.OK, {"ok": True})
        else:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path!r}"})

    def do_PUT(self) -> None:
        if not self._authorized():
            return
        name = self._name()
        if name is None:
            return
        self.close_connection = True  # an aborted body leaves the stream unusable
        try:
            length = self._content_length()
            reply = receive(self.server.root, name, self.rfile, length)
        except StagingError as exc:
            self._reply(exc.status, {"error": str(exc)}, unread_body=True)
            return
        except OSError as exc:
            self._reply(
                HTTPStatus.INSUFFICIENT_STORAGE,
                {"error": f"could not write the upload: {exc}"},
                unread_body=True,
            )
            return
        self._reply(HTTPStatus.CREATED, reply)

    def _content_length(self) -> int:
        header = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") or header is None:
            raise StagingError("an exact Content-Length is required", HTTPStatus.LENGTH_REQUIRED)
        try:
            length = int(header)
        except ValueError:
            raise StagingError(f"bad Content-Length {header!r}") from None
        if not 0 < length <= self.server.max_bytes:
            raise StagingError(
                f"upload of {length} bytes exceeds {self.server.max_bytes}",
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            )
        return length

    def do_DELETE(self) -> None:
        if not self._authorized():
            return
        name = self._name()
        if name is None:
            return
        try:
            self._reply(HTTPStatus.OK, remove(self.server.root, name))
        except StagingError as exc:
            self._reply(exc.status, {"error": str(exc)})


@contextlib.contextmanager
def serve_in_thread(
    root: Path, token: str, host: str = "127.0.0.1", port: int = 0
) -> Iterator[StagingServer]:
    """A receiver on a background thread (tests, benchmarks, single-host setups)."""
    server = StagingServer((host, port), root, token)
    thread = threading.Thread(target=server.serve_forever, name="lorafleet-staging", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _read_token(token_file: str | None) -> str:
    if token_file is not None:
        token = Path(token_file).read_text().strip()
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise SystemExit(
            f"a staging token of at least {MIN_TOKEN_CHARS} characters is required (--token-file or ${TOKEN_ENV})"
        )
    return token


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root", required=True, help="directory the engine loads staged adapters from"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8471, help="0 picks a free port")
    parser.add_argument(
        "--token-file", default=None, help=f"file holding the bearer token (default: ${TOKEN_ENV})"
    )
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    args = parser.parse_args(argv)
    server = StagingServer(
        (args.host, args.port), Path(args.root), _read_token(args.token_file), args.max_bytes
    )
    print(f"lorafleet staging receiver on {server.url}, root {server.root}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
