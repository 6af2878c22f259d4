"""A server refused at start-up for a bad tenants file changes nothing on disk: the file is
checked before the data dir is made, its database opened or crash recovery run (before, a
typo in the file still created the data dir, its database and its 8 MiB disk reserve, and ran
recovery over an existing one)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from lorafleet.server.engine.executor import Executor
from lorafleet.server.main import ServerThread
from lorafleet.server.service import STEPS, Service
from lorafleet.server.state.tenants import TenantsFileError
from tests.server.conftest import server_config
from tests.server.tenant_files import tenants_server_config


def test_a_bad_tenants_file_is_refused_before_the_data_dir_is_touched(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.Alice]\nkey_sha256 = ["' + "0" * 64 + '"]\n')
    data_dir = tmp_path / "data"
    with pytest.raises(TenantsFileError, match=r"line 1: \[tenants.Alice\]"):
        Service(tenants_server_config(data_dir, tenants))
    assert not data_dir.exists()


# --------------------------------------------------------------------------- start-up as one unit


def _open_files(name: str) -> list[str]:
    fds = Path("/proc/self/fd")
    found = []
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if name in target:
            found.append(target)
    return found


def _lorafleet_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("lorafleet-"))


class _Injected(RuntimeError):
    pass


@pytest.mark.parametrize("step", STEPS)
def test_a_failure_at_any_start_up_step_leaves_nothing_open(tmp_path, monkeypatch, step):
    """A failure right after each step closes what the steps before opened: no lorafleet
    thread left running, the database closed (no open descriptor on it), and the engines'
    `close` (which stops spawned vLLM servers and Ray actors) called once the engine exists."""
    closed: list[str] = []
    original = Executor.close
    monkeypatch.setattr(Executor, "close", lambda self: (closed.append("engines"), original(self)))
    threads_before = _lorafleet_threads()
    data_dir = tmp_path / "data"

    def fail(name: str) -> None:
        if name == step:
            raise _Injected(step)

    with pytest.raises(_Injected):
        Service(server_config(data_dir), on_step=fail)
    deadline = time.monotonic() + 10
    while _lorafleet_threads() != threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _lorafleet_threads() == threads_before
    assert _open_files(str(data_dir)) == []
    engine_built = STEPS.index(step) >= STEPS.index("engine")
    assert closed == (["engines"] if engine_built else [])


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_server_whose_port_is_taken_closes_its_service(tmp_path):
    """uvicorn failing to bind after the service started: the service is closed again."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        threads_before = _lorafleet_threads()
        data_dir = tmp_path / "data"
        with pytest.raises((RuntimeError, SystemExit, OSError)):
            ServerThread(server_config(data_dir, port=port))
    deadline = time.monotonic() + 10
    while _lorafleet_threads() != threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _lorafleet_threads() == threads_before
    assert _open_files(str(data_dir)) == []
