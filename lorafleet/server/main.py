"""Running the server: in the foreground (`lorafleet serve`) or on a background thread (tests,
notebooks), with uvicorn either way."""

from __future__ import annotations

import ipaddress
import logging
import signal
import socket
import threading
import time

import uvicorn

from lorafleet.server.app import create_app
from lorafleet.server.config import ServerConfig
from lorafleet.server.service import Service

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str) -> bool:
    """Logs a warning (and returns True) when `host` is not a loopback address: the API then
    speaks plain HTTP, API keys included, to whoever can reach the port."""
    if is_loopback(host):
        return False
    log.warning(
        "binding to %s, which is not a loopback address: the API is reachable from other machines, "
        "in plain HTTP (API keys included); put TLS in front of it (a reverse proxy) or bind to 127.0.0.1",
        host or "all interfaces",
    )
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _uvicorn_config(service: Service, config: ServerConfig, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(service),
        host=config.host,
        port=config.port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=2,  # long polls are released by FutureTable.close anyway
        timeout_keep_alive=30,
    )


class ServerThread:
    """A server on a daemon thread; `stop()` closes it like a shutdown (pending work is dropped
    and, on the next start over the same data dir, reported as failed)."""

    def __init__(self, config: ServerConfig, *, log_level: str = "warning"):
        self.config = config
        warn_if_exposed(config.host)
        self.service = Service(config)  # loads the model on its engine thread
        try:
            self._server = uvicorn.Server(_uvicorn_config(self.service, config, log_level))
            self._thread = threading.Thread(
                target=self._server.run, name="lorafleet-http", daemon=True
            )
            self._thread.start()
            deadline = time.monotonic() + 30
            while not self._server.started:
                if not self._thread.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start on {config.host}:{config.port}")
                time.sleep(0.02)
        except BaseException:
            self.service.close()
            raise

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def stop(self) -> None:
        self.service.futures.close()
        self._server.should_exit = True
        self._thread.join(15)
        self.service.close()


def serve(config: ServerConfig, *, log_level: str = "info") -> None:
    """Blocks until interrupted (SIGINT/SIGTERM, handled by uvicorn); SIGHUP reloads the
    tenants file (`Service.request_reload`)."""
    warn_if_exposed(config.host)
    # SIGTERM while the service starts (spawned vLLM replicas take a minute or two) ends the
    # process the way Ctrl-C does, by an exception, so that exit hooks run: the one in
    # sync/vllm_server.py stops the servers already started (they are in their own session)
    previous_term = signal.signal(signal.SIGTERM, _stopped_while_starting)
    try:
        service = Service(config)  # loads the model on its engine thread
    finally:
        signal.signal(signal.SIGTERM, previous_term)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM and then re-raises the signal to whatever
    # handler was there before; make that handler a normal exit so the engine and the database
    # are closed below rather than the process being killed mid-way.
    previous = {sig: signal.signal(sig, _exit_cleanly) for sig in (signal.SIGINT, signal.SIGTERM)}
    # SIGHUP reloads the tenants file. uvicorn leaves this signal alone; the handler runs on
    # the main thread, inside uvicorn's event loop, so it only wakes the reload thread.
    previous[signal.SIGHUP] = signal.signal(
        signal.SIGHUP, lambda _signum, _frame: service.request_reload()
    )
    try:
        uvicorn.Server(_uvicorn_config(service, config, log_level)).run()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    finally:
        service.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exit_cleanly(signum: int, _frame: object) -> None:
    raise SystemExit(0)


def _stopped_while_starting(signum: int, _frame: object) -> None:
    raise SystemExit(f"lorafleet serve: stopped by signal {signum} while starting")
