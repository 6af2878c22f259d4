"""The staging receiver under hostile or broken clients: slow-loris connections, a cap on
connections, uploads cut mid-body, leftovers of a killed receiver, malformed headers."""

from __future__ import annotations

import hashlib
import http.client
import io
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from lorafleet.sync.staging_server import (
    MAGIC,
    Limits,
    StagingError,
    StagingServer,
    receive,
    serve_in_thread,
)

TOKEN = "a-staging-token-of-some-length"
FAST = Limits(max_connections=4, header_timeout_s=0.5, idle_timeout_s=5.0, body_grace_s=0.5)


def _connect(server: StagingServer) -> socket.socket:
    sock = socket.create_connection(server.server_address[:2], timeout=10)
    return sock


def _closed_by_server(sock: socket.socket, within_s: float) -> float | None:
    """Seconds until the server ends the connection (EOF or reset), None if it did not."""
    began = time.monotonic()
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - began


def _upload(files: list[tuple[str, bytes]]) -> bytes:
    body = bytearray(MAGIC)
    for name, data in files:
        body += (json.dumps({"file": name, "size": len(data)}) + "\n").encode() + data
    digest = hashlib.sha256(bytes(body)).hexdigest()
    body += (json.dumps({"end": True, "files": len(files), "sha256": digest}) + "\n").encode()
    return bytes(body)


def _put(server: StagingServer, name: str, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    conn.request(
        "PUT",
        f"/v1/staging/{name}",
        body=body,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Length": str(len(body))},
    )
    response = conn.getresponse()
    status, reply = response.status, json.loads(response.read())
    conn.close()
    return status, reply


def test_slow_loris_connections_are_capped_and_reaped(tmp_path):
    with serve_in_thread(tmp_path / "root", TOKEN, limits=FAST) as server:
        threads_before = threading.active_count()
        loris = []
        for _ in range(FAST.max_connections):
            sock = _connect(server)
            sock.sendall(b"PUT /v1/stag")  # half a request line, never finished
            loris.append(sock)
        deadline = time.monotonic() + 5
        while server.open_connections < FAST.max_connections and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.open_connections == FAST.max_connections
        # one more is answered at once with a 503, without a thread of its own
        began = time.monotonic()
        extra = _connect(server)
        reply = extra.recv(4096)
        assert reply.startswith(b"HTTP/1.1 503"), reply
        assert time.monotonic() - began < 1.0
        assert threading.active_count() <= threads_before + FAST.max_connections
        extra.close()
        # the reaper frees the slots once the header deadline has passed
        for sock in loris:
            waited = _closed_by_server(sock, within_s=5)
            assert waited is not None and waited < 3 * FAST.header_timeout_s + 1
            sock.close()
        assert server.reaped_connections >= FAST.max_connections
        assert server.refused_connections >= 1
        conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200


def test_a_trickled_request_line_does_not_outlive_the_header_deadline(tmp_path):
    """One byte per 0.2 s keeps every single read inside the idle timeout; the deadline for the
    whole header still ends it."""
    with serve_in_thread(tmp_path / "root", TOKEN, limits=FAST) as server:
        sock = _connect(server)
        began = time.monotonic()
        closed = False
        for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\n":
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.2)
            if time.monotonic() - began > 5:
                break
        if not closed:
            closed = _closed_by_server(sock, within_s=2) is not None
        assert closed and time.monotonic() - began < 4
        sock.close()


def test_an_upload_cut_mid_body_leaves_nothing_behind(tmp_path):
    root = tmp_path / "root"
    with serve_in_thread(root, TOKEN, limits=FAST) as server:
        body = _upload([("a.bin", b"x" * 10_000)])
        sock = _connect(server)
        head = (
            f"PUT /v1/staging/a@1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock.sendall(head + body[:5000])  # then the client stalls
        deadline = time.monotonic() + 5
        while not list(root.glob(".*.incoming")) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert list(root.glob(".*.incoming")), "the upload never started"
        assert _closed_by_server(sock, within_s=5) is not None  # reaped at its body deadline
        sock.close()
        deadline = time.monotonic() + 5
        while list(root.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert list(root.iterdir()) == []
        assert _put(server, "a@1", body)[0] == 201  # the name is free and the receiver works


def test_leftovers_of_a_killed_receiver_are_removed_at_start(tmp_path):
    root = tmp_path / "root"
    (root / "kept@1").mkdir(parents=True)
    (root / "kept@1" / "f.bin").write_bytes(b"published")
    partial = root / ".a@2.0123456789ab.incoming"
    partial.mkdir()
    (partial / "adapter_model.safetensors").write_bytes(b"half")
    with serve_in_thread(root, TOKEN) as server:
        assert server.swept == [partial.name]
        assert sorted(p.name for p in root.iterdir()) == ["kept@1"]
        assert (root / "kept@1" / "f.bin").read_bytes() == b"published"


def test_one_receiver_per_root(tmp_path):
    with (
        serve_in_thread(tmp_path / "root", TOKEN),
        pytest.raises(ValueError, match="already served by another receiver"),
    ):
        StagingServer(("127.0.0.1", 0), tmp_path / "root", TOKEN)
    with serve_in_thread(tmp_path / "root", TOKEN):  # released when the first one closed
        pass


@pytest.mark.parametrize(
    "line", [b"[" * 3000 + b"\n", b"{" * 3000 + b"\n", b'{"file": ["a"], "size": 1}\n']
)
def test_nested_header_lines_are_a_400_not_a_crash(tmp_path, line):
    root = tmp_path / "root"
    root.mkdir()
    body = MAGIC + line
    with pytest.raises(StagingError, match="flat JSON object"):
        receive(root, "a@1", io.BytesIO(body), len(body))
    assert list(root.iterdir()) == []
    with serve_in_thread(tmp_path / "served", TOKEN) as server:
        status, reply = _put(server, "a@1", body)
        assert status == 400 and "flat JSON object" in reply["error"]
        assert list((tmp_path / "served").iterdir()) == []


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_connections"):
        Limits(max_connections=0)
    with pytest.raises(ValueError, match="header_timeout_s"):
        Limits(header_timeout_s=0)
    with pytest.raises(ValueError, match="min_body_bytes_per_s"):
        Limits(min_body_bytes_per_s=0)


def test_a_slow_but_steady_upload_within_its_deadline_succeeds(tmp_path):
    """The body deadline scales with the declared length: a client sending at the minimum rate
    is not cut off."""
    limits = Limits(
        max_connections=2, header_timeout_s=1.0, body_grace_s=1.0, min_body_bytes_per_s=2048
    )
    with serve_in_thread(tmp_path / "root", TOKEN, limits=limits) as server:
        body = _upload([("a.bin", b"y" * 4096)])
        sock = _connect(server)
        sock.sendall(
            (
                f"PUT /v1/staging/b@1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
        )
        for start in range(0, len(body), 1024):
            sock.sendall(body[start : start + 1024])
            time.sleep(0.4)  # 1.6 s in all: past a fixed 1 s deadline, inside 1 s + length / rate
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 201"), reply
        sock.close()
        assert (Path(server.root) / "b@1" / "a.bin").read_bytes() == b"y" * 4096
