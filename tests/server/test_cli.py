"""`lorafleet serve` as a real process: keys from the environment and a key file, both model
names served, a clean stop on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import tinker
import torch

from lorafleet.server.main import free_port, is_loopback

KEY_ENV = "tml-cli-env-key-0123456"
KEY_FILE = "tml-cli-file-key-0123456"


def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert (
        not is_loopback("0.0.0.0")
        and not is_loopback("10.0.0.1")
        and not is_loopback("example.com")
    )


def test_serve_subcommand(tmp_path):
    port = free_port()
    key_file = tmp_path / "keys.txt"
    key_file.write_text(KEY_FILE + "\n")
    env = {
        **os.environ,
        "LORAFLEET_API_KEYS": KEY_ENV,
        "HF_HUB_OFFLINE": "1",
        "TINKER_TELEMETRY": "0",
    }
    command = [
        sys.executable,
        "-m",
        "lorafleet.cli",
        "serve",
        "--base-model",
        "tiny-qwen3",
        "--port",
        str(port),
        "--data-dir",
        str(tmp_path / "data"),
        "--api-key-file",
        str(key_file),
        "--torch-threads",
        "1",
    ]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            try:
                if (
                    httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=2).status_code
                    == 200
                ):
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        for key in (KEY_ENV, KEY_FILE):
            rest = tinker.RestClient(base_url=f"http://127.0.0.1:{port}", api_key=key)
            names = [m.model_name for m in rest.get_server_capabilities().result().supported_models]
            assert names == ["tiny-qwen3"]  # the preset's name, never a server directory
        # `--device` defaults to auto: the CPU here, reported with what ran there and why
        stats = httpx.get(
            f"http://127.0.0.1:{port}/api/v1/lorafleet/stats", headers={"X-API-Key": KEY_ENV}
        ).json()
        device, on_gpu = stats["device"], torch.cuda.is_available()
        assert device["device"] == ("cuda:0" if on_gpu else "cpu") and device["name"]
        # sizes planned from free memory on CUDA; the flags' defaults on the CPU
        assert device["memory_plan"]["planned"] is on_gpu
        if not on_gpu:
            assert device["memory_plan"]["values"]["max_adapters"] == 8
            assert "need CUDA" in device["cuda_graphs"]["reason"]
        # the fused kernel and graph decode run on CUDA, after their start-up checks
        assert device["lora_kernel"]["fused"] is on_gpu, device["lora_kernel"]
        assert device["cuda_graphs"]["enabled"] is on_gpu, device["cuda_graphs"]
        assert oct((tmp_path / "data").stat().st_mode & 0o777) == "0o700"
        assert oct((tmp_path / "data" / "lorafleet.db").stat().st_mode & 0o777) == "0o600"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    assert process.returncode == 0
