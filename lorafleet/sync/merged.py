"""Merged-weight sync: W' = W + scale * B @ A, written as a full checkpoint for engines that
serve one model at a time (or cannot take LoRA at all).

Every merge starts from a pristine copy of the base, read once from the base checkpoint and
never modified: merging into the previous step's merged weights would add each step's
rounding error to the next (and in bf16 lose small updates for good). The merge itself runs
in fp32 and is cast once, to the engine's dtype.

Only the targeted linears change, but engines reload whole checkpoints (vLLM's in-place
reload zeroes any weight the checkpoint leaves out, measured), so the output is a complete
checkpoint: every base tensor, plus config.json so that it is a loadable model directory.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file

from lorafleet.fsio import PathLike, atomic_directory, atomic_save_safetensors
from lorafleet.sync.base import AdapterUpdate, SyncError

__all__ = ["MERGED_SUFFIX", "PristineBase", "merged_name"]

MERGED_SUFFIX = ".merged"
_COPIED_FILES = ("config.json", "generation_config.json")


def merged_name(update_name: str) -> str:
    """Staging name of a merged checkpoint (kept apart from the PEFT dir of the same version)."""
    return f"{update_name}{MERGED_SUFFIX}"


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SyncError(f"{model_dir} has no *.safetensors weights to merge into")
    return files


class PristineBase:
    """The base checkpoint's tensors, as loaded once, plus the engine dtype to write in."""

    def __init__(self, model_dir: PathLike, dtype: torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"merged dtype must be float32, bfloat16 or float16, got {dtype}")
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise SyncError(f"{self.model_dir} is not a model directory (no config.json)")
        self.dtype = dtype
        self._tensors: dict[str, torch.Tensor] = {}
        for path in _weight_files(self.model_dir):
            self._tensors.update(load_file(path))
        # Untouched tensors in the engine's dtype, converted once (a no-op view when equal).
        self._cast = {name: t.to(dtype) for name, t in self._tensors.items()}

    def tensor_name(self, module_path: str) -> str:
        name = f"{module_path}.weight"
        if name not in self._tensors:
            hint = (
                " (tied embeddings: merging into lm_head would also change the input embeddings)"
                if module_path.endswith("lm_head")
                else ""
            )
            raise SyncError(
                f"cannot merge into {module_path!r}: the base checkpoint has no tensor {name!r}{hint}"
            )
        return name

    def merge(self, update: AdapterUpdate) -> dict[str, torch.Tensor]:
        """Full checkpoint tensors with the update merged in (fresh tensors for changed ones)."""
        return self.merge_weights(update.weights(), float(update.spec.scale))

    @torch.no_grad()
    def merge_weights(
        self, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]], scale: float
    ) -> dict[str, torch.Tensor]:
        """`merge` for per-layer fp32 (A[rank, in], B[out, rank]) read from a checkpoint file
        (`lorafleet export --merged`) rather than a trainer slot."""
        out = dict(self._cast)
        for path, (A, B) in weights.items():
            name = self.tensor_name(path)
            W = self._tensors[name]
            if W.shape != (B.shape[0], A.shape[1]):
                raise SyncError(
                    f"{path}: base weight {tuple(W.shape)} does not fit LoRA B@A {(B.shape[0], A.shape[1])}"
                )
            out[name] = torch.addmm(W.float(), B, A, alpha=scale).to(self.dtype)
        return out

    def write(self, update: AdapterUpdate, dest: Path) -> None:
        """Publishes the merged checkpoint at `dest` (atomic directory, 0700/0600)."""
        tensors = self.merge(update)
        with atomic_directory(dest) as tmp:
            atomic_save_safetensors(tmp / "model.safetensors", tensors, metadata={"format": "pt"})
            for name in _COPIED_FILES:
                if (self.model_dir / name).is_file():
                    shutil.copyfile(self.model_dir / name, tmp / name)

    def base_tensor(self, name: str) -> torch.Tensor:
        """The pristine tensor (for tests: it must never change)."""
        return self._tensors[name]
