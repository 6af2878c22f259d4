"""Test-wide environment: never touch the network, and reuse one preset cache across runs.

Set at import time (not in a fixture) because huggingface_hub reads HF_HUB_OFFLINE when
it is first imported. The cache lives outside the repo and outside pytest's tmp dirs so
the ~30 s SmolLM2 dequantization happens once per machine, not once per run; export
LORAFLEET_CACHE to use a different one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lorafleet.cli import tame_openmp_spinning

# Before torch loads libgomp, as the CLI does: a shared machine must not stall every parallel
# region (lorafleet/cli.py).
tame_openmp_spinning()

import torch  # noqa: E402 - after the spin setting, which torch reads on load

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("LORAFLEET_CACHE", str(Path.home() / ".cache" / "lorafleet-test"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread, and on shared CPUs OpenMP spin-waits are costly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
