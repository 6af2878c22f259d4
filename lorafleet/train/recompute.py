"""Activation recompute (checkpointing) for the trainer's forwards on a shared base.

Each decoder layer keeps only its input for the backward and runs again there, so a
micro-batch's activation memory is about one layer's instead of every layer's (the token
budget grows accordingly, see token_budget.py). Built on transformers' own per-layer
checkpointing, which acts only while the layer is in training mode and autograd is on: the
sampler's no-grad forwards on the same base (its KV cache included) are untouched. So this sets
training mode on the decoder layers alone (not their children: attention dropout keeps its
eval behaviour), never on the whole model.

The recompute runs in the backward, after the forward's routing scope has closed, so each
checkpoint takes the routing in force when its forward ran and re-enters it for the recompute
(`context_fn`): the layer's LoRA sees the same slots both times.

A layer with recompute drops any KV cache it is handed, so the trainer's prefix sharing (whose
second forward reads the first one's cache) is off while recompute is on (train/engine.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import nn

from lorafleet.model.routing import RoutingError, RoutingScope


def checkpoint_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers transformers can checkpoint (its GradientCheckpointingLayer)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _routing_contexts(
    scope: RoutingScope,
) -> Callable[
    [], tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]
]:
    """checkpoint's `context_fn`: nothing around the forward, the forward's routing around the
    recompute."""

    def contexts() -> tuple[
        contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]
    ]:
        try:
            routing = scope.current("recompute")
        except RoutingError:
            return contextlib.nullcontext(), contextlib.nullcontext()
        return contextlib.nullcontext(), scope.use(routing)

    return contexts


def set_recompute(
    model: nn.Module, scope: RoutingScope, enabled: bool, *, every_n_layers: int = 1
) -> None:
    """Turns per-layer recompute on (every `every_n_layers`-th layer) or off; `scope` is the
    adapted model's routing scope.

    Raises ValueError for a model transformers cannot checkpoint, naming its class."""
    if (
        not isinstance(every_n_layers, int)
        or isinstance(every_n_layers, bool)
        or every_n_layers < 1
    ):
        raise ValueError(f"every_n_layers must be a positive integer, got {every_n_layers!r}")
    hf: Any = model  # a transformers PreTrainedModel (nn.Module types hide its methods)
    layers = checkpoint_layers(model)
    if not getattr(hf, "supports_gradient_checkpointing", False) or not layers:
        raise ValueError(
            f"{type(model).__name__} does not support activation recompute (no checkpointable "
            "decoder layers)"
        )
    if enabled:
        hf.activation_checkpointing_enable(
            activation_checkpointing_kwargs={
                "use_reentrant": False,
                "context_fn": _routing_contexts(scope),
            },
            every_n_layers=every_n_layers,
        )
    else:
        hf.activation_checkpointing_disable()
    for layer in layers:
        layer.training = enabled


def recompute_enabled(model: nn.Module) -> bool:
    return any(
        getattr(layer, "gradient_checkpointing", False) and layer.training
        for layer in checkpoint_layers(model)
    )
