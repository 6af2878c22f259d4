"""A loopback HTTP proxy between the real SDK and the server that can reroute or drop chosen
requests: it plays a newer SDK calling a route this server lacks, or a request lost on the way
(the SDK has already numbered the call; the server never sees it)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from lorafleet.server.main import free_port

Rule = Callable[[str, str], str | None]
"""(method, path) -> the path to forward to, or None to drop the request (answered 404 by the
proxy itself, which the SDK does not retry)."""

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class Proxy:
    def __init__(self, upstream: str, rule: Rule):
        self.upstream = upstream
        self.rule = rule
        self.dropped: list[str] = []
        self.rerouted: list[tuple[str, str]] = []
        self._client = httpx.Client(base_url=upstream, timeout=120)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                return  # the test reads `dropped` / `rerouted` instead

            def _relay(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                target = proxy.rule(self.command, self.path)
                if target is None:
                    proxy.dropped.append(self.path)
                    self._answer(404, b'{"error": "dropped by the test proxy"}', "application/json")
                    return
                if target != self.path:
                    proxy.rerouted.append((self.path, target))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
                response = proxy._client.request(
                    self.command, target, content=body, headers=headers
                )
                self._answer(
                    response.status_code,
                    response.content,
                    response.headers.get("content-type", "application/json"),
                )

            def _answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = _relay

        self._server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._client.close()


def once(method: str, path: str, target: str | None) -> Rule:
    """Reroutes (or drops, `target` None) the first `method path` request; forwards the rest."""
    done = threading.Event()

    def rule(request_method: str, request_path: str) -> str | None:
        if request_method == method and request_path == path and not done.is_set():
            done.set()
            return target
        return request_path

    return rule
