"""A full data disk: the server must fail saves with a clear error, keep its engine (and other
tenants' training) going, say so on /healthz, let checkpoints be deleted while the disk is full,
and accept saves again once they freed space, without a restart.

Two modes, recorded in the report:
- `tmpfs`: `lorafleet serve` runs in a private mount namespace (`unshare -rm`) whose data dir is
  a tmpfs of `size_mb`, so the disk really fills: ENOSPC in the checkpoint writer, SQLite's
  "database or disk is full";
- `injected`: where such a mount is not permitted, the server's disk-full test hook
  (`LORAFLEET_FAULT_DISK_FULL`, lorafleet/server/state/disk.py) reports the disk full instead; the
  same client-side checks run, but no real write fails.

One tenant saves training states (`save_state`, the optimizer with them) until the server says
the disk is full; a second tenant then trains; the first deletes its checkpoints through the
SDK's RestClient and saves again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker

from tests.reliability.harness import BASE_MODEL, REPO, free_port, tenant_keys

FULL_MESSAGE = "the server's data disk is full"
RESULT_TIMEOUT_S = 120.0


def tmpfs_allowed(probe_dir: Path) -> bool:
    """Whether this machine lets an unprivileged user mount a tmpfs in a private namespace."""
    if shutil.which("unshare") is None:
        return False
    probe_dir.mkdir(parents=True, exist_ok=True)
    script = f"mount -t tmpfs -o size=1m tmpfs {probe_dir} && touch {probe_dir}/ok"
    try:
        done = subprocess.run(
            ["unshare", "-rm", "sh", "-c", script], capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and not (probe_dir / "ok").exists()  # the mount stayed private


def run_on_small_tmpfs(tmp_path: Path, script: str, size: str = "2m") -> dict[str, Any]:
    """Runs the Python `script` (given the mount point as its argument) in a private mount
    namespace with a `size` tmpfs mounted, and returns the JSON object its last stdout line
    holds. Skips the calling test where the machine forbids the mount."""
    if not tmpfs_allowed(tmp_path / "probe"):
        pytest.skip("this machine does not permit a private tmpfs mount (unshare -rm)")
    mount = tmp_path / "disk"
    mount.mkdir()
    path = tmp_path / "on_small_tmpfs.py"
    path.write_text(script)
    command = f'mount -t tmpfs -o size={size} tmpfs {mount} && exec "$@"'
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", command, "sh", sys.executable, str(path), str(mount)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


class DiskServer:
    """`lorafleet serve` on a small data disk (tmpfs mode) or with the disk-full hook armed by a
    switch file (injected mode)."""

    def __init__(self, workdir: Path, keys: list[str], mode: str, size_mb: int):
        self.workdir = workdir
        self.data_dir = workdir / "data"
        self.switch = workdir / "disk-full"  # injected mode: exists = the disk is full
        self.keys = keys
        self.mode = mode
        self.size_mb = size_mb
        self.port = free_port()
        self.log_path = workdir / "server.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> float:
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        env = {
            **os.environ,
            "LORAFLEET_API_KEYS": ",".join(self.keys),
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
        }
        serve = [
            sys.executable, "-m", "lorafleet.cli", "serve", "--base-model", BASE_MODEL,
            "--data-dir", str(self.data_dir), "--port", str(self.port), "--torch-threads", "1",
            "--max-adapters", "4", "--sampler-slots", "4", "--max-lora-rank", "16",
            "--batch-window-ms", "0",
        ]  # fmt: skip
        if self.mode == "tmpfs":
            mount = f"mount -t tmpfs -o size={self.size_mb}m,mode=0700 tmpfs {self.data_dir}"
            command = ["unshare", "-rm", "sh", "-c", f'{mount} && exec "$@"', "sh", *serve]
        else:
            env["LORAFLEET_FAULT_DISK_FULL"] = str(self.switch)
            command = serve
        began = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            )
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {self.process.returncode}:\n{self.tail()}"
                )
            try:
                if httpx.get(f"{self.base_url}/api/v1/healthz", timeout=2).status_code == 200:
                    return time.monotonic() - began
            except httpx.TransportError:
                pass
            if time.monotonic() - began > timeout:
                self.stop()
                raise RuntimeError(f"the server did not come up in {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)

    def healthz(self) -> tuple[int, dict[str, Any]]:
        response = httpx.get(f"{self.base_url}/api/v1/healthz", timeout=10)
        return response.status_code, response.json()

    def tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""


def _disk_full(exc: BaseException) -> bool:
    return isinstance(exc, tinker.RequestFailedError) and FULL_MESSAGE in str(exc)


def run_disk_full(
    workdir: Path, *, size_mb: int = 8, max_saves: int = 400, mode: str | None = None
) -> dict[str, Any]:
    """Fills the data disk with saves, checks the server through it, frees it, checks recovery.
    `mode` None: tmpfs where permitted, else injected. Returns the report
    (`disk_full_recovered` 1 when a save succeeded again after the deletions)."""
    workdir.mkdir(parents=True, exist_ok=True)
    if mode is None:
        mode = "tmpfs" if tmpfs_allowed(workdir / "probe") else "injected"
    keys = tenant_keys(2, "disk")
    server = DiskServer(workdir, keys, mode, size_mb)
    report: dict[str, Any] = {"mode": mode, "size_mb": size_mb if mode == "tmpfs" else None}
    problems: list[str] = []
    report["problems"] = problems
    report["startup_s"] = server.start()
    sc_a = tinker.ServiceClient(base_url=server.base_url, api_key=keys[0])
    sc_b = tinker.ServiceClient(base_url=server.base_url, api_key=keys[1])
    try:
        tc_a = sc_a.create_lora_training_client(base_model=BASE_MODEL, rank=16).result(
            timeout=RESULT_TIMEOUT_S
        )
        tc_b = sc_b.create_lora_training_client(base_model=BASE_MODEL, rank=4).result(
            timeout=RESULT_TIMEOUT_S
        )
        rest_a = tinker.RestClient(base_url=server.base_url, api_key=keys[0])

        # ---- fill: save until the server says the disk is full
        saved: list[str] = []
        full_error = ""
        began = time.monotonic()
        for i in range(max_saves):
            if mode == "injected" and i == 2:
                server.switch.touch()  # a couple of real saves first, then "full"
            try:
                saved.append(tc_a.save_state(f"fill-{i:03d}").result(timeout=RESULT_TIMEOUT_S).path)
            except Exception as exc:  # noqa: BLE001 - the one outcome wanted here is a disk-full error
                if not _disk_full(exc):
                    problems.append(
                        f"save {i} failed with something else: {type(exc).__name__}: {exc}"
                    )
                full_error = str(exc)
                break
        else:
            problems.append(f"{max_saves} saves and the disk never filled")
        report["saves_until_full"] = len(saved)
        report["fill_s"] = round(time.monotonic() - began, 2)
        report["full_error"] = full_error
        if str(server.data_dir) in full_error or str(workdir) in full_error:
            problems.append(f"the disk-full error names a server path: {full_error}")
        checkpoints = rest_a.list_checkpoints(tc_a.model_id).result(timeout=RESULT_TIMEOUT_S)
        sizes = [c.size_bytes for c in checkpoints.checkpoints if c.size_bytes]
        report["checkpoint_bytes"] = max(sizes) if sizes else None

        # ---- while full: another save is refused at once, clearly; the engine goes on
        began = time.monotonic()
        try:
            tc_a.save_state("while-full").result(timeout=RESULT_TIMEOUT_S)
            report["save_while_full"] = "succeeded"
        except Exception as exc:  # noqa: BLE001 - recorded: a clear disk-full error is the expected outcome
            report["save_while_full"] = (
                "disk full" if _disk_full(exc) else f"{type(exc).__name__}: {exc}"
            )
        report["refused_save_s"] = round(time.monotonic() - began, 3)
        try:
            datum = tinker.types.Datum(
                model_input=tinker.types.ModelInput.from_ints([1, 2, 3, 4, 5]),
                loss_fn_inputs={"target_tokens": [2, 3, 4, 5, 6], "weights": [1.0] * 5},
            )
            tc_b.forward_backward([datum], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
            tc_b.optim_step(tinker.types.AdamParams(learning_rate=1e-3)).result(
                timeout=RESULT_TIMEOUT_S
            )
            report["other_tenant_training"] = "ok"
        except Exception as exc:  # noqa: BLE001 - a clean error is acceptable; recorded either way
            report["other_tenant_training"] = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, tinker.RequestFailedError):
                problems.append(f"other tenant's training: {type(exc).__name__}: {exc}")
        status, body = server.healthz()
        report["healthz_while_full"] = {"status_code": status, **body}
        if status != 200 or body.get("engine") != "ok" or body.get("disk") != "full":
            problems.append(f"healthz while the disk is full: {status} {body}")

        # ---- free: delete the checkpoints (works while the disk is full), then save again
        began = time.monotonic()
        if mode == "injected":
            server.switch.unlink()
        for path in saved:
            rest_a.delete_checkpoint_from_tinker_path(path).result(timeout=RESULT_TIMEOUT_S)
        report["deleted"] = len(saved)
        report["delete_s"] = round(time.monotonic() - began, 2)
        try:
            tc_a.save_state("after-free").result(timeout=RESULT_TIMEOUT_S)
            report["disk_full_recovered"] = 1
        except Exception as exc:  # noqa: BLE001 - recorded as not recovered
            report["disk_full_recovered"] = 0
            problems.append(f"save after freeing space: {type(exc).__name__}: {exc}")
        report["recover_s"] = round(time.monotonic() - began, 2)
        status, body = server.healthz()
        report["healthz_after"] = {"status_code": status, **body}
        if status != 200 or body != {"status": "ok", "engine": "ok", "disk": "ok", "rollout": "ok"}:
            problems.append(f"healthz after recovery: {status} {body}")
    finally:
        for client in (sc_a, sc_b):
            try:
                client.close("success").result(timeout=30)
            except Exception as exc:  # noqa: BLE001 - the report says so; the server is stopped regardless
                problems.append(f"closing a client: {type(exc).__name__}: {exc}")
        server.stop()
    if problems:
        report["server_log_tail"] = server.tail(2000)
    return report


if __name__ == "__main__":
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run_disk_full(Path(tmp)), indent=2))
