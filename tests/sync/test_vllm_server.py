"""Spawned vLLM servers never outlive the process that started them when it exits without
stopping them (Ctrl-C, or SIGTERM to `lorafleet serve` while its replicas are still starting):
they run in their own session, so only the exit hook in `sync/vllm_server.py` can end them.
A stand-in "venv" whose python answers /health and /v1/models plays vLLM (no vLLM needed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

FAKE_VLLM = """
import http.server, os, pathlib, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
model = pathlib.Path(sys.argv[sys.argv.index("--model") + 1])
(model / f"pid-{os.getpid()}").touch()
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"data": [{"id": "base"}]}')
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""

START = """
import sys
from pathlib import Path
from lorafleet.sync.vllm_server import start_vllm_server
def start(*_args, **_kwargs):
    server = start_vllm_server(Path(sys.argv[1]), ready_timeout=60, log_path=Path(sys.argv[1]) / "log")
    print(server.process.pid, flush=True)
    return server
"""


@pytest.fixture
def fake_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".lorafleet-ready").touch()
    (tmp_path / "fake_vllm.py").write_text(FAKE_VLLM)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {tmp_path / "fake_vllm.py"} "$@"\n')
    python.chmod(0o700)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({}))
    monkeypatch.setenv("LORAFLEET_VLLM_VENV", str(venv))
    return model


def _gone(pid: int, within_s: float = 20.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    return False


def _child(code: str, model: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(START) + textwrap.dedent(code), str(model)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )


def test_an_exit_without_stop_stops_the_server(fake_venv: Path) -> None:
    child = _child("start()\nraise KeyboardInterrupt\n", fake_venv)
    out, err = child.communicate(timeout=90)
    assert child.returncode != 0 and "KeyboardInterrupt" in err
    assert _gone(int(out.split()[0])), "the spawned server outlived its parent"


def test_sigterm_while_serve_starts_stops_what_it_started(fake_venv: Path) -> None:
    """`serve` builds its Service (which spawns the replicas) before uvicorn handles signals."""
    code = """
    import time
    from lorafleet.server import main
    def service(_config):
        start()
        time.sleep(120)  # still starting other replicas
    main.Service = service
    main.serve(main.ServerConfig(base_model="x", data_dir="/nonexistent", api_keys=[]))
    """
    child = _child(code, fake_venv)
    assert child.stdout is not None
    pid = int(child.stdout.readline())
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 1 and "stopped by signal 15 while starting" in err
    assert _gone(pid), "the spawned server outlived its parent"


def test_no_server_starts_once_the_exit_hook_ran(fake_venv: Path) -> None:
    """Daemon threads still run during exit hooks: a pool's supervisor that saw its replica
    stopped by the hook must not start a new one that nothing would stop."""
    code = """
    from lorafleet.sync import vllm_server
    vllm_server._stop_left_running()
    try:
        start()
    except vllm_server.VllmUnavailableError as exc:
        print("refused:", exc, flush=True)
    """
    child = _child(code, fake_venv)
    out, err = child.communicate(timeout=90)
    assert "refused: this process is exiting" in out, err
    started = [int(f.name.removeprefix("pid-")) for f in fake_venv.glob("pid-*")]
    assert all(_gone(pid) for pid in started)
