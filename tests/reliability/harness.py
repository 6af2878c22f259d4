"""Shared pieces of the reliability battery: servers (in-process and as a killable subprocess),
tenant keys, and the checks that read the data directory behind the server's back (torn
files, permissions, SQLite consistency).

The battery's scenarios (load.py, crash.py, fuzz.py, security.py) are plain functions that
return reports, so the CI tests (tests/reliability/test_*.py) and the heavier bench
(bench/reliability.py) run the same code with different sizes. Everything runs on the
tiny-qwen3 preset: the battery is about what the server survives, not about speed.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import httpx

from lorafleet.adapters.checkpoint import CheckpointError, read_training_state
from lorafleet.adapters.peft_io import read_peft
from lorafleet.server.config import ServerConfig
from lorafleet.server.engine.executor import EPHEMERAL_DIR, EngineConfig
from lorafleet.server.engine.faults import FILE_ENV
from lorafleet.server.main import ServerThread, free_port
from lorafleet.server.state.paths import checkpoint_dir, parse_tinker_path
from lorafleet.server.state.recovery import TENANTS_DIR

BASE_MODEL = "tiny-qwen3"
VOCAB = 512  # tiny-qwen3's tokenizer
REPO = Path(__file__).resolve().parents[2]


def tenant_keys(count: int, tag: str) -> list[str]:
    return [f"tml-{tag}-tenant-{i:02d}-0123456789abcdef" for i in range(count)]


def tenant_id(key: str) -> str:
    """What the server names a tenant (auth.KeyRing): a prefix of the key's sha256."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


# ============================================================================ servers


def engine_config(max_adapters: int = 12, sampler_slots: int = 16) -> EngineConfig:
    return EngineConfig(
        base_model=BASE_MODEL,
        max_adapters=max_adapters,
        sampler_slots=sampler_slots,
        max_lora_rank=16,
        max_sample_rows=32,
    )


def server_config(
    data_dir: Path, keys: list[str], *, max_adapters: int = 12, sampler_slots: int = 16, **overrides
) -> ServerConfig:
    settings: dict = {"torch_threads": 1, "batch_window_s": 0.0, **overrides}
    return ServerConfig(
        base_model=BASE_MODEL,
        data_dir=data_dir,
        api_keys=keys,
        port=free_port(),
        engine=engine_config(max_adapters, sampler_slots),
        **settings,
    )


@contextmanager
def inprocess_server(data_dir: Path, keys: list[str], **overrides) -> Iterator[ServerThread]:
    server = ServerThread(server_config(data_dir, keys, **overrides))
    try:
        yield server
    finally:
        server.stop()


class ServerProcess:
    """`lorafleet serve` as a child process, so that it can be killed with SIGKILL and started
    again on the same data directory and port (clients keep polling the same URL)."""

    def __init__(self, data_dir: Path, keys: list[str], log_path: Path, *, max_adapters: int = 8):
        self.data_dir = data_dir
        self.keys = keys
        self.log_path = log_path
        self.port = free_port()
        self.max_adapters = max_adapters
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, fault_file: Path | None = None, timeout: float = 180.0) -> float:
        """Starts the server and waits until it answers; returns the start-up time in seconds."""
        env = {
            **os.environ,
            "LORAFLEET_API_KEYS": ",".join(self.keys),
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
        }
        env.pop(FILE_ENV, None)
        if fault_file is not None:
            env[FILE_ENV] = str(fault_file)
        command = [
            sys.executable, "-m", "lorafleet.cli", "serve", "--base-model", BASE_MODEL,
            "--data-dir", str(self.data_dir), "--port", str(self.port), "--torch-threads", "1",
            "--max-adapters", str(self.max_adapters), "--sampler-slots", "8", "--max-lora-rank", "16",
            "--batch-window-ms", "0",
        ]  # fmt: skip
        began = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start {self.starts} (faults: {fault_file}) =====\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            )
        self.starts += 1
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.base_url}/api/v1/healthz", timeout=2).status_code == 200:
                    return time.monotonic() - began
            except httpx.TransportError:
                pass
            if time.monotonic() - began > timeout:
                self.kill()
                raise RuntimeError(
                    f"the server did not come up within {timeout:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""


# ============================================================================ data-dir checks


def checkpoint_path_on_disk(data_dir: Path, key: str, tinker_path: str) -> Path:
    return checkpoint_dir(data_dir, tenant_id(key), parse_tinker_path(tinker_path))


def digest_dir(path: Path) -> dict[str, str]:
    """sha256 of every file in a checkpoint directory, by name."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
        if p.is_file()
    }


def _readable(path: Path, segment: str) -> str | None:
    """None if the directory is a complete checkpoint of its kind, else why not."""
    try:
        if segment == "weights":
            read_training_state(path)
        else:
            read_peft(path)
    except (CheckpointError, ValueError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def scan_checkpoints(data_dir: Path) -> tuple[int, list[str], list[str]]:
    """Reads every visible checkpoint directory (training states, sampler PEFT dirs, ephemeral
    exports). Returns (complete, torn: visible but unreadable, hidden: in-progress entries)."""
    complete, torn, hidden = 0, [], []  # type: ignore[var-annotated]
    candidates: list[tuple[Path, str]] = []
    tenants = data_dir / TENANTS_DIR
    for segment in ("weights", "sampler_weights"):
        candidates += [(d, segment) for d in tenants.glob(f"*/runs/*/{segment}/*")]
    candidates += [(d, "sampler_weights") for d in (data_dir / EPHEMERAL_DIR).glob("*/*")]
    for directory, segment in candidates:
        if directory.name.startswith("."):
            continue
        problem = _readable(directory, segment)
        if problem is None:
            complete += 1
        else:
            torn.append(f"{directory.relative_to(data_dir)}: {problem}")
    for root in (tenants, data_dir / EPHEMERAL_DIR):
        if root.is_dir():
            hidden += [str(p.relative_to(data_dir)) for p in root.rglob(".*")]
    return complete, torn, sorted(hidden)


def permission_problems(data_dir: Path) -> list[str]:
    """Every file under the data dir must be 0600 and every directory 0700."""
    problems = []
    for path in [data_dir, *data_dir.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if path.is_symlink():
            problems.append(f"{path}: is a symlink")
        elif path.is_dir() and mode != 0o700:
            problems.append(f"{path}: directory mode {oct(mode)}")
        elif path.is_file() and mode != 0o600:
            problems.append(f"{path}: file mode {oct(mode)}")
    return problems


def sqlite_problems(data_dir: Path, *, started_before: float | None = None) -> list[str]:
    """Integrity of the store and of what it says about the files: every checkpoint row has a
    readable directory inside the data dir and a model of the same tenant, every model and
    sampling session a session; with `started_before`, no future created before then is still
    pending (the restart must have failed them)."""
    db = sqlite3.connect(f"file:{data_dir / 'lorafleet.db'}?mode=ro", uri=True, timeout=30)
    try:
        problems = []
        check = db.execute("PRAGMA integrity_check").fetchall()
        if check != [("ok",)]:
            problems.append(f"integrity_check: {check[:5]}")
        root = data_dir.resolve()
        for path, tenant, model_id, kind, directory in db.execute(
            "SELECT tinker_path, tenant, model_id, kind, dir FROM checkpoints"
        ):
            owner = db.execute("SELECT tenant FROM models WHERE model_id=?", (model_id,)).fetchone()
            if owner is None or owner[0] != tenant:
                problems.append(
                    f"checkpoint {path}: model {model_id} missing or owned by another tenant"
                )
            where = (root / directory).resolve()  # stored relative to the data dir
            if root not in where.parents:
                problems.append(f"checkpoint {path}: directory {where} is outside the data dir")
            elif not where.is_dir():
                problems.append(f"checkpoint {path}: directory {where} is missing")
            else:
                problem = _readable(where, "weights" if kind == "training" else "sampler_weights")
                if problem is not None:
                    problems.append(f"checkpoint {path}: {problem}")
        for table, column in (("models", "model_id"), ("sampling_sessions", "sampling_session_id")):
            orphans = db.execute(
                f"SELECT {column} FROM {table} WHERE session_id NOT IN (SELECT session_id FROM sessions)"
            ).fetchall()
            problems += [f"{table} row {row[0]} has no session" for row in orphans]
        bad = db.execute(
            "SELECT request_id, state FROM futures WHERE state NOT IN ('pending', 'done', 'failed')"
        ).fetchall()
        problems += [f"future {r} in state {s!r}" for r, s in bad]
        finished_without_body = db.execute(
            "SELECT COUNT(*) FROM futures WHERE state != 'pending' AND body IS NULL"
        ).fetchone()[0]
        if finished_without_body:
            problems.append(f"{finished_without_body} finished futures have no result body")
        if started_before is not None:
            stuck = db.execute(
                "SELECT COUNT(*) FROM futures WHERE state='pending' AND created_at < ?",
                (started_before,),
            ).fetchone()[0]
            if stuck:
                problems.append(f"{stuck} futures from before the restart are still pending")
        return problems
    finally:
        db.close()


def files_outside(root: Path, allowed: Path) -> list[str]:
    """Everything under `root` that is not `allowed` or inside it (for 'names never escape')."""
    out = []
    for path in root.rglob("*"):
        if path == allowed or allowed in path.parents or path in allowed.parents:
            continue
        out.append(str(path.relative_to(root)))
    return sorted(out)
