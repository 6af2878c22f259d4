"""Load the one frozen base model that every tenant's LoRA adapter sits on.

Only local directories are accepted (presets are materialized locally first), so a
typo in a model name fails fast instead of triggering a hub download.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lorafleet.hardware import resolve_dtype
from lorafleet.model.presets import is_preset, materialize, random_weights_seed

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass
class LoadedBase:
    model: nn.Module
    tokenizer: Any
    model_id: str  # preset name, or the resolved absolute directory
    path: Path  # the HF directory the weights came from
    dtype: torch.dtype


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """Only fp32 and bf16: the LoRA kernels and optimizer states are not tuned for others."""
    if isinstance(value, torch.dtype):
        if value in _DTYPES.values():
            return value
    elif isinstance(value, str) and value.strip().lower() in _DTYPES:
        return _DTYPES[value.strip().lower()]
    raise ValueError(f"unsupported dtype {value!r}; expected one of: {', '.join(_DTYPES)}")


def resolve_base(name_or_path: str) -> tuple[str, Path]:
    """Return (model_id, HF directory), materializing presets; validates local directories."""
    if is_preset(name_or_path):
        return name_or_path, materialize(name_or_path)
    path = Path(name_or_path).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(
            f"base model {name_or_path!r} is neither a known preset nor an existing path"
        )
    if not path.is_dir():
        raise NotADirectoryError(f"base model path {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"base model directory {str(path)!r} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ValueError(
            f"base model directory {str(path)!r} has no *.safetensors weights "
            "(pickled .bin checkpoints are not loaded)"
        )
    _check_causal_lm(path)
    return str(path), path


def _check_causal_lm(path: Path) -> None:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"cannot read config.json in {str(path)!r}: {err}") from err
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"base model {str(path)!r} has model_type {config.model_type!r}, "
            f"which is not a causal LM architecture (architectures: {config.architectures})"
        )


def load_base(
    name_or_path: str,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> LoadedBase:
    """Load a preset or local HF directory, frozen: only adapters are ever trained.
    `dtype="auto"` takes the machine's choice (lorafleet/hardware.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str) and dtype.strip().lower() == "auto":
        dtype = resolve_dtype("auto", device).dtype
    torch_dtype = parse_dtype(dtype)  # before any slow work, so bad input fails fast
    model_id, path = resolve_base(name_or_path)
    seed = random_weights_seed(path)
    if seed is not None:
        model = build_random_weights(path, torch_dtype, torch.device(device), seed)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch_dtype,
            attn_implementation="sdpa",
            local_files_only=True,
            use_safetensors=True,
        )
    model.requires_grad_(False)
    model.eval()
    module: nn.Module = model  # transformers' decorator on PreTrainedModel.to hides its `self`
    module.to(device)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return LoadedBase(
        model=model, tokenizer=tokenizer, model_id=model_id, path=path, dtype=torch_dtype
    )


def build_random_weights(path: Path, dtype: torch.dtype, device: torch.device, seed: int) -> Any:
    """A shape preset's model (presets.RANDOM_WEIGHTS): built from its config directly on
    `device` in `dtype`, so a large one is never held in fp32 nor in host memory on its way
    to a GPU. The seed fixes the values for a given device type (CPU and CUDA generators
    differ); `meta` builds the structure alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with device:
            return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
