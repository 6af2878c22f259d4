"""Per-adapter optimizer hyper-parameters (AdamW, Dimuon) as plain data.

They live here, not in `lorafleet.train`, because a checkpoint records the last ones an
adapter was stepped with (`adapters/checkpoint.py` reads and writes them): the checkpoint
format is plain data, and the optimizer (`train/optim.py`) is one of its users.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["OPTIMIZERS", "AdamHParams", "DimuonHParams", "OptimHParams", "hparams_from_dict"]

OPTIMIZERS = ("adamw", "dimuon")
"""The optimizer families a training adapter can be created with (Tinker's `optimizer_config`
types); one is fixed for the adapter's lifetime."""


@dataclass(frozen=True)
class AdamHParams:
    """Per-slot AdamW hyper-parameters, as a tenant sends them with each optim step.

    Not validated on construction so that a bad request can be built, reported and
    rejected at the optimizer boundary (``BankAdamW.step`` validates before touching
    any state); ``from_dict`` validates because it reads untrusted checkpoint data.
    """

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 = no clipping

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field, so API errors are actionable."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"AdamHParams.{f.name} must be a real number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"AdamHParams.{f.name} must be finite, got {value!r}")
        if self.learning_rate < 0:
            raise ValueError(f"AdamHParams.learning_rate must be >= 0, got {self.learning_rate!r}")
        for name in ("beta1", "beta2"):
            beta = getattr(self, name)
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"AdamHParams.{name} must be in [0, 1), got {beta!r}")
        if self.eps <= 0:
            raise ValueError(f"AdamHParams.eps must be > 0, got {self.eps!r}")
        if self.weight_decay < 0:
            raise ValueError(f"AdamHParams.weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.grad_clip_norm < 0:
            raise ValueError(
                f"AdamHParams.grad_clip_norm must be >= 0 (0 disables clipping), "
                f"got {self.grad_clip_norm!r}"
            )

    def to_dict(self) -> dict[str, float]:
        """Plain JSON-able data, so checkpoints do not depend on pickling this class."""
        return {k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AdamHParams:
        """Inverse of ``to_dict``; rejects unknown keys so typos are not silently ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"AdamHParams: unknown field(s) {unknown}")
        if "learning_rate" not in d:
            raise ValueError("AdamHParams: missing required field 'learning_rate'")
        hp = cls(**dict(d))
        hp.validate()
        return hp


@dataclass(frozen=True)
class DimuonHParams:
    """Per-slot Dimuon hyper-parameters: exactly the fields of SDK 0.38's ``DimuonParams``.

    Validated at the optimizer boundary like ``AdamHParams``. ``grad_clip_norm <= 0`` disables
    clipping (the SDK documents "nonpositive values disable"), so it is never refused.
    """

    learning_rate: float
    beta1: float = 0.9
    grad_clip_norm: float = 0.0

    def validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"DimuonHParams.{f.name} must be a real number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"DimuonHParams.{f.name} must be finite, got {value!r}")
        if self.learning_rate < 0:
            raise ValueError(
                f"DimuonHParams.learning_rate must be >= 0, got {self.learning_rate!r}"
            )
        if not 0.0 <= self.beta1 < 1.0:
            raise ValueError(f"DimuonHParams.beta1 must be in [0, 1), got {self.beta1!r}")

    def to_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DimuonHParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"DimuonHParams: unknown field(s) {unknown}")
        if "learning_rate" not in d:
            raise ValueError("DimuonHParams: missing required field 'learning_rate'")
        hp = cls(**dict(d))
        hp.validate()
        return hp


OptimHParams = AdamHParams | DimuonHParams
"""One optim step's hyper-parameters, of the family the adapter was created with."""


def hparams_from_dict(optimizer: str, d: Mapping[str, Any]) -> OptimHParams:
    """Reads a checkpoint's recorded hyper-parameters for its optimizer family."""
    if optimizer == "adamw":
        return AdamHParams.from_dict(d)
    if optimizer == "dimuon":
        return DimuonHParams.from_dict(d)
    raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)}")
