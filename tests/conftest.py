"""Test-wide environment: never touch the network, and reuse one preset cache across runs.

Set at import time (not in a fixture) because huggingface_hub reads HF_HUB_OFFLINE when
it is first imported. The cache lives outside the repo and outside pytest's tmp dirs so
the ~30 s SmolLM2 dequantization happens once per machine, not once per run; export
LORAFLEET_CACHE to use a different one.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("LORAFLEET_CACHE", str(Path.home() / ".cache" / "lorafleet-test"))
