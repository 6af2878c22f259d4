"""Test-only sync faults for the replica pool, off unless LORAFLEET_ROLLOUT_FAULT is set.

`LORAFLEET_ROLLOUT_FAULT=<fault>:<substring>` breaks the sync of every version whose adapter
id contains `<substring>` (a sampler checkpoint's name, say), the way real syncs break:
- `wrong_module_names`: the staged PEFT files name modules the engine does not know (vLLM
  loads them, ignores them, and serves the base model under the adapter's name);
- `skipped_load`: the engine is never asked to load the version.
The canary must catch both; the tests prove it through a real server. Read at each use, so a
test can set it for one version and clear it again.
"""

from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import load_file, save_file

__all__ = ["ENV", "active", "rename_modules"]

ENV = "LORAFLEET_ROLLOUT_FAULT"
FAULTS = ("wrong_module_names", "skipped_load")


def active(fault: str, adapter_id: str) -> bool:
    value = os.environ.get(ENV)
    if not value:
        return False
    name, _, substring = value.partition(":")
    if name not in FAULTS or not substring:
        raise ValueError(f"{ENV} must be <{'|'.join(FAULTS)}>:<substring>, got {value!r}")
    return name == fault and substring in adapter_id


def rename_modules(peft_dir: str) -> None:
    """Rewrites the staged weights under module names no model has."""
    weights = Path(peft_dir) / "adapter_model.safetensors"
    tensors = load_file(weights)
    save_file({k.replace(".layers.", ".blocks."): v for k, v in tensors.items()}, weights)
