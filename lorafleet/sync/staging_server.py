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

Hostile or broken clients (see `Limits`): connections are capped (the next one gets a 503 at
once, without a thread), each has a deadline for its headers and one for its body that a reaper
thread enforces, header lines are flat JSON objects (nesting is a 400, never a parser crash),
and the temp directories of uploads a killed receiver never finished are removed at start-up
(one receiver per root, held by a lock on the directory).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import hmac
import json
import math
import os
import re
import secrets
import shutil
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
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
DEFAULT_MAX_CONNECTIONS = 32
INCOMING_SUFFIX = ".incoming"
_REAP_INTERVAL_S = 0.25
_CLOSE_WAIT_S = 5.0

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
        try:
            data = self.stream.read(n)
        except TimeoutError:
            raise StagingError(
                "the upload stalled (no data within the receiver's idle timeout)",
                HTTPStatus.REQUEST_TIMEOUT,
            ) from None
        except OSError as exc:
            raise StagingError(f"the connection failed during the upload: {exc.strerror}") from None
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


def _header(raw: bytes) -> dict[str, Any]:
    """A header or trailer line: one flat JSON object. Nesting is refused before parsing, since
    the parser recurses once per level and a line of brackets would exhaust the stack."""
    if raw.count(b"{") > 1 or b"[" in raw:
        raise StagingError("header line must be a flat JSON object (no nesting)")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise StagingError(f"bad header line: {exc}") from None
    if not isinstance(header, dict):
        raise StagingError("header line must be a JSON object")
    return header


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _incoming_name(name: str) -> str:
    return f".{name}.{secrets.token_hex(6)}{INCOMING_SUFFIX}"


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
    tmp = Path(os.path.realpath(root)) / _incoming_name(name)
    tmp.mkdir(mode=0o700)
    try:
        names: list[str] = []
        while True:
            raw = body.line()
            header = _header(raw)
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


def sweep_incoming(root: Path) -> list[str]:
    """Removes the temp directories of uploads a previous receiver never finished (killed
    mid-body: its own cleanup never ran); returns their names. Only the receiver holding the
    root's lock calls this, so no upload in flight is touched."""
    removed = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(".") and entry.name.endswith(INCOMING_SUFFIX):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry.name)
    if removed:
        _fsync_dir(root)
    return removed


@dataclass(frozen=True)
class Limits:
    """How long and how many connections the receiver gives its clients.

    Each connection holds a thread, so the number of them is capped and every one has a
    deadline that a reaper thread enforces by shutting the socket: the request line and
    headers must arrive within `header_timeout_s` (also the idle time allowed between
    keep-alive requests), and a body within `body_grace_s` plus its length at
    `min_body_bytes_per_s`. `idle_timeout_s` is the socket timeout for any one read. A client
    past the cap gets an immediate 503 from the accepting thread."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0
    body_grace_s: float = 30.0
    min_body_bytes_per_s: int = 1 << 20

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        for field in ("header_timeout_s", "idle_timeout_s", "body_grace_s"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"{field} must be > 0, got {value}")
        if self.min_body_bytes_per_s < 1:
            raise ValueError(f"min_body_bytes_per_s must be >= 1, got {self.min_body_bytes_per_s}")

    def body_deadline(self, length: int) -> float:
        return time.monotonic() + self.body_grace_s + length / self.min_body_bytes_per_s


_BUSY_BODY = b'{"error": "too many connections to the staging receiver"}'
_BUSY_REPLY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\n"
    + f"Content-Length: {len(_BUSY_BODY)}\r\n\r\n".encode()
    + _BUSY_BODY
)


class StagingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        root: Path,
        token: str,
        max_bytes: int = DEFAULT_MAX_BYTES,
        limits: Limits | None = None,
    ):
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"the staging token must have at least {MIN_TOKEN_CHARS} characters")
        root = Path(root)
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not root.is_dir() or root.is_symlink():
            raise ValueError(f"staging root {root} must be a real directory")
        self.root = root.resolve()
        self._lock_fd = _lock_root(self.root)
        self.token = token.encode()
        self.max_bytes = max_bytes
        self.limits = limits or Limits()
        self.swept = sweep_incoming(self.root)
        self.refused_connections = 0  # over the cap: answered 503 at once
        self.reaped_connections = 0  # past their deadline: shut by the reaper
        self.lost_replies = 0  # the client was gone before its reply was written
        self._deadlines: dict[socket.socket, float] = {}
        self._conn_lock = threading.Lock()
        self._closing = threading.Event()
        self.reaper_error: BaseException | None = None
        try:
            super().__init__(address, _Handler)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._reaper = threading.Thread(
            target=self._reap_forever, name="lorafleet-staging-reaper", daemon=True
        )
        self._reaper.start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        assert isinstance(host, str)  # an AF_INET address is (str, int)
        return f"http://{host}:{port}"

    @property
    def open_connections(self) -> int:
        with self._conn_lock:
            return len(self._deadlines)

    # -- connections: a capped set, each with a deadline

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conn_lock:
            full = len(self._deadlines) >= self.limits.max_connections
            if not full and self._reaper.is_alive():
                self._deadlines[request] = time.monotonic() + self.limits.header_timeout_s
                admitted = True
            else:
                admitted = False
        if not admitted:
            self.refused_connections += 1
            self._refuse(request)
            return
        super().process_request(request, client_address)

    def _refuse(self, request: socket.socket) -> None:
        """A 503 without reading the request: the send is one small write into an empty socket
        buffer, so the accepting thread never waits on the client."""
        try:
            request.setblocking(False)
            request.send(_BUSY_REPLY)
        except OSError:
            self.lost_replies += 1
        self.shutdown_request(request)

    def set_deadline(self, request: socket.socket, deadline: float) -> None:
        with self._conn_lock:
            if request in self._deadlines:
                self._deadlines[request] = deadline

    def shutdown_request(self, request: Any) -> None:
        with self._conn_lock:
            self._deadlines.pop(request, None)
        super().shutdown_request(request)

    def _reap_forever(self) -> None:
        """Shuts the sockets of connections past their deadline; the blocked read in their
        thread then returns and the thread ends (and an upload in flight is cleaned up)."""
        try:
            while not self._closing.wait(_REAP_INTERVAL_S):
                now = time.monotonic()
                with self._conn_lock:
                    late = [s for s, deadline in self._deadlines.items() if deadline <= now]
                    for sock in late:
                        self._deadlines[sock] = math.inf  # shut once; removed when its thread ends
                for sock in late:
                    self.reaped_connections += 1
                    _shut(sock)
        except BaseException as exc:
            # new connections are refused from now on (process_request checks the reaper)
            self.reaper_error = exc
            sys.stderr.write(
                f"lorafleet staging receiver: the reaper thread died:\n{traceback.format_exc()}"
            )
            raise

    def server_close(self) -> None:
        """Stops the reaper and shuts every open connection, so that uploads in flight end (and
        remove their temp directories) before the root's lock is released."""
        self._closing.set()
        self._reaper.join(timeout=5)
        with self._conn_lock:
            open_now = list(self._deadlines)
        for sock in open_now:
            _shut(sock)
        deadline = time.monotonic() + _CLOSE_WAIT_S
        while self.open_connections and time.monotonic() < deadline:
            time.sleep(0.01)
        super().server_close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _shut(sock: socket.socket) -> None:
    """Both directions of a connection that must end; one already closed needs nothing."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _lock_root(root: Path) -> int:
    """An exclusive lock on the root directory for this receiver's life: the start-up sweep
    removes unfinished uploads, which is only safe if no other receiver is writing there."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"staging root {root} is already served by another receiver") from None
    return fd


class _Handler(BaseHTTPRequestHandler):
    server: StagingServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.limits.idle_timeout_s)

    def handle(self) -> None:
        try:
            super().handle()
        except (BrokenPipeError, ConnectionResetError):
            # the client hung up or was reaped mid-request: counted, nobody left to answer
            self.server.lost_replies += 1

    def handle_one_request(self) -> None:
        """Each request (a keep-alive connection's next one too) gets the header deadline."""
        self.server.set_deadline(
            self.connection, time.monotonic() + self.server.limits.header_timeout_s
        )
        super().handle_one_request()

    def log_message(self, format: str, *args: Any) -> None:  # stdlib signature
        if os.environ.get("LORAFLEET_STAGING_VERBOSE"):
            super().log_message(format, *args)

    def _reply(self, status: int, body: dict[str, Any], *, unread_body: bool = False) -> None:
        data = (json.dumps(body) + "\n").encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if unread_body:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            # the client hung up or was reaped; nobody is left to tell
            self.server.lost_replies += 1
            self.close_connection = True
            return
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

    def _crashed(self, what: str) -> None:
        """An error this receiver did not foresee: logged with its traceback, and answered, so
        the client is not left with a closed connection and no reason."""
        sys.stderr.write(f"lorafleet staging receiver: {what} failed:\n{traceback.format_exc()}")
        self._reply(
            HTTPStatus.INTERNAL_SERVER_ERROR,
            {"error": f"internal error in the staging receiver during {what}"},
            unread_body=True,
        )

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
            self.server.set_deadline(self.connection, self.server.limits.body_deadline(length))
            reply = receive(self.server.root, name, self.rfile, length)
        except StagingError as exc:
            self._reply(exc.status, {"error": str(exc)}, unread_body=True)
            return
        except OSError as exc:
            self._reply(
                HTTPStatus.INSUFFICIENT_STORAGE,
                {"error": f"could not write the upload: {exc.strerror}"},
                unread_body=True,
            )
            return
        except Exception:  # noqa: BLE001 - logged with its traceback and answered as a 500
            self._crashed(f"PUT {name!r}")
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
        except OSError as exc:
            self._reply(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                {"error": f"could not remove {name!r}: {exc.strerror}"},
            )
        except Exception:  # noqa: BLE001 - logged with its traceback and answered as a 500
            self._crashed(f"DELETE {name!r}")


@contextlib.contextmanager
def serve_in_thread(
    root: Path,
    token: str,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    limits: Limits | None = None,
) -> Iterator[StagingServer]:
    """A receiver on a background thread (tests, benchmarks, single-host setups)."""
    server = StagingServer((host, port), root, token, limits=limits)
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
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="connections served at once; more are answered 503",
    )
    args = parser.parse_args(argv)
    server = StagingServer(
        (args.host, args.port),
        Path(args.root),
        _read_token(args.token_file),
        args.max_bytes,
        Limits(max_connections=args.max_connections),
    )
    if server.swept:
        print(f"removed {len(server.swept)} unfinished upload(s): {server.swept}", flush=True)
    print(f"lorafleet staging receiver on {server.url}, root {server.root}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
