"""Which module paths a Tinker `LoraConfig` trains (its train_attn / train_mlp / train_unembed
switches), resolved for every combination on the bare base before the engines wrap it: once the
linears sit inside LoRA wrappers they no longer resolve, yet `create_model` may ask for any
combination later."""

from __future__ import annotations

import itertools
from typing import Any

from torch import nn

from lorafleet.model.targets import TargetError, resolve_tinker_targets

Switches = tuple[bool, bool, bool]
"""(train_attn, train_mlp, train_unembed)."""


class TargetSets:
    def __init__(self, base: nn.Module):
        # A combination that resolves to nothing keeps its error, raised when a model asks for it.
        self._by_switches: dict[Switches, tuple[str, ...] | TargetError] = {}
        for attn, mlp, unembed in itertools.product((False, True), repeat=3):
            try:
                self._by_switches[(attn, mlp, unembed)] = resolve_tinker_targets(
                    base, train_attn=attn, train_mlp=mlp, train_unembed=unembed
                )
            except TargetError as exc:
                self._by_switches[(attn, mlp, unembed)] = exc

    def _get(self, switches: Switches) -> tuple[str, ...]:
        targets = self._by_switches[switches]
        if isinstance(targets, TargetError):
            raise targets
        return targets

    def everything(self) -> tuple[str, ...]:
        """Every trainable target: the banks the engines are built with (TargetError if none)."""
        return self._get((True, True, True))

    def for_lora(self, lora: dict[str, Any]) -> tuple[str, ...]:
        """The targets of a model's `lora` config (TargetError when it selects nothing here)."""
        return self._get(
            (bool(lora["train_attn"]), bool(lora["train_mlp"]), bool(lora["train_unembed"]))
        )
