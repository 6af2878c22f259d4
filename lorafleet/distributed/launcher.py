"""Starts N trainer ranks on this machine with `torchrun` and talks to rank 0.

The server listens on a loopback port with a random key; rank 0 connects (key and address come
through the environment, never argv), proves it knows the key (multiprocessing's HMAC
challenge, both ways), receives the rank settings and answers with the model info once every
rank has built its shard. After that each `call` is one command and one reply.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from lorafleet.distributed.fsdp import DistError
from lorafleet.distributed.protocol import RankSettings, Reply, command, recv, send
from lorafleet.distributed.trainer_worker import ENV_AUTHKEY, ENV_CONNECT, ENV_DEVICE, ENV_TIMEOUT


def _stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """Ends the torchrun process group this launcher started (its own session)."""
    if proc.poll() is not None:
        return
    try:
        proc.wait(grace_s)
        return
    except subprocess.TimeoutExpired:
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(10)
            return
        except subprocess.TimeoutExpired:
            continue


class TorchrunRanks:
    """A `torchrun --standalone --nproc_per_node=N` group of trainer ranks on this machine."""

    def __init__(self, settings: RankSettings, nproc: int, *, startup_timeout_s: float = 600.0):
        settings.validate()
        if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
            raise ValueError(f"trainer ranks must be a positive integer, got {nproc!r}")
        self.settings = settings
        self.nproc = nproc
        self._lock = threading.Lock()
        authkey = secrets.token_bytes(32)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        env = dict(os.environ)
        env[ENV_CONNECT] = f"127.0.0.1:{port}"
        env[ENV_AUTHKEY] = authkey.hex()
        env[ENV_DEVICE] = settings.device
        env[ENV_TIMEOUT] = str(settings.collective_timeout_s)
        env["OMP_NUM_THREADS"] = str(settings.torch_threads or 1)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "lorafleet.distributed.trainer_worker",
        ]
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        self._finalizer = weakref.finalize(self, _stop_group, self.proc, 0.0)
        deadline = time.monotonic() + startup_timeout_s
        try:
            try:
                self.conn = self._accept(listener, authkey, deadline)
            finally:
                listener.close()
            send(self.conn, asdict(settings))
            self.info: dict[str, Any] = self._receive(deadline).unwrap()
        except BaseException:
            _stop_group(self.proc, 0.0)
            raise

    def _accept(self, listener: socket.socket, authkey: bytes, deadline: float) -> Connection:
        while True:
            self._check_alive("before rank 0 connected")
            if time.monotonic() > deadline:
                raise DistError("trainer rank 0 did not connect in time")
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(None)
            conn = Connection(sock.detach())
            try:
                deliver_challenge(conn, authkey)
                answer_challenge(conn, authkey)
            except (OSError, EOFError) as exc:
                conn.close()
                raise DistError(f"the trainer connection failed authentication: {exc}") from exc
            return conn

    def _check_alive(self, when: str) -> None:
        code = self.proc.poll()
        if code is not None:
            raise DistError(
                f"the trainer ranks (torchrun) exited with code {code} {when}; see their log above"
            )

    def _receive(self, deadline: float | None = None) -> Reply:
        while not self.conn.poll(0.5):
            self._check_alive("while a command was running")
            if deadline is not None and time.monotonic() > deadline:
                raise DistError("the trainer ranks did not answer in time")
        try:
            reply = recv(self.conn)
        except EOFError:
            self._check_alive("while a command was running")
            raise DistError("trainer rank 0 closed the connection") from None
        if not isinstance(reply, Reply):
            raise DistError(f"trainer rank 0 sent {type(reply).__name__}, not a Reply")
        return reply

    def call(self, name: str, **kwargs: Any) -> Any:
        """Runs a command on the ranks and returns rank 0's value (or raises its error)."""
        message = command(name, **kwargs)
        with self._lock:
            self._check_alive("before the command")
            send(self.conn, message)
            return self._receive().unwrap()

    def close(self) -> None:
        with self._lock:
            if self.proc.poll() is None and not self.conn.closed:
                with contextlib.suppress(OSError, EOFError, DistError):
                    send(self.conn, command("shutdown"))
                    self._receive(time.monotonic() + 30)
            if not self.conn.closed:
                self.conn.close()
            _stop_group(self.proc, 30.0)
            self._finalizer.detach()
