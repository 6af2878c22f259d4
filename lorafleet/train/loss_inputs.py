"""Validation of a datum's loss request, before any compute.

``validate_loss`` checks the datum's ``loss_fn_inputs`` and the request's ``loss_fn_config``
and returns a ``LossSpec`` of float32 (and int64 target) tensors with every config default
filled in. Doing every check up front is what lets the engine promise that a rejected datum
changed no state, and lets the loss math (losses.py) assume a valid spec. Every message names
the offending field and the value or position, so a client can fix its request.

``weights`` (cross_entropy) default to ones over the targets (``[T]`` or ``[T, K]``): the SDK's
own docstring example sends none.  ``clip_low_threshold``/``clip_high_threshold`` (ppo, cispo,
gspo) come from ``loss_fn_config``
(defaults 0.8/1.2, thresholds on the ratio itself, not epsilons), or per token from
``loss_fn_inputs`` keys of the same names, which override the config value.  ``beta`` (dro)
defaults to 0.05 (the value Tinker's docs use) because the cookbook's DRO recipe may omit it
and rejecting such requests would break it; an explicit value always wins.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

__all__ = [
    "CLIP_HIGH",
    "CLIP_LOW",
    "LOSS_CONFIG_DEFAULTS",
    "LOSS_INPUT_KEYS",
    "LOSS_NAMES",
    "REFUSED_LOSSES",
    "SAMPLED_SEQUENCE",
    "SEQUENCE_RATIO_MASK",
    "STABLE_REINFORCE",
    "STABLE_REINFORCE_DEFAULTS",
    "TARGETS",
    "LossInputError",
    "LossSpec",
    "format_shape",
    "loss_targets",
    "validate_loss",
]

LOSS_NAMES: tuple[str, ...] = (
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "gspo",
    "stable_reinforce",
)

TARGETS = "target_tokens"
CLIP_LOW = "clip_low_threshold"
CLIP_HIGH = "clip_high_threshold"
SEQUENCE_RATIO_MASK = "sequence_ratio_mask"
STABLE_REINFORCE = "stable_reinforce"
SAMPLED_SEQUENCE = "sampled_sequence"
"""stable_reinforce's per-token segment ids: 0 where the target is not a recorded sampled
token, k >= 1 for the tokens of the datum's k-th sampled run (one sequence's tokens). A server
sets it from the provenance spans (server/ops/stability.py); library callers pass it."""
STABLE_REINFORCE_DEFAULTS = MappingProxyType(
    {
        "token_clip": 2.0,
        "token_mask_low": 1e-3,
        "token_mask_high": 1e3,
        "seq_mask_low": 0.05,
        "seq_mask_high": 20.0,
        "kl_coeff": 0.0,
    }
)
"""stable_reinforce's loss_fn_config keys and defaults (docs/losses.md says why each)."""
_RL_REQUIRED = (TARGETS, "logprobs", "advantages")
_CLIP_DEFAULTS = MappingProxyType({CLIP_LOW: 0.8, CLIP_HIGH: 1.2})

REFUSED_LOSSES: Mapping[str, str] = MappingProxyType(
    {
        "custom": (
            "server-side custom losses need a graph uploaded with create_custom_loss, which this "
            "server does not offer; run the loss on the client with forward_backward_custom "
            "(a plain callable), which this server supports"
        ),
    }
)
"""Loss names SDK 0.38 can send that this server refuses, with the reason given to the client."""


@dataclass(frozen=True)
class _Schema:
    required: tuple[str, ...]
    optional: tuple[str, ...]
    config_defaults: Mapping[str, float]
    ones_if_missing: tuple[str, ...] = ()  # optional inputs that default to all-ones


_SCHEMAS: Mapping[str, _Schema] = MappingProxyType(
    {
        "cross_entropy": _Schema((TARGETS,), ("weights",), MappingProxyType({}), ("weights",)),
        "importance_sampling": _Schema(_RL_REQUIRED, (), MappingProxyType({})),
        "ppo": _Schema(_RL_REQUIRED, (CLIP_LOW, CLIP_HIGH), _CLIP_DEFAULTS),
        "cispo": _Schema(_RL_REQUIRED, (CLIP_LOW, CLIP_HIGH), _CLIP_DEFAULTS),
        "dro": _Schema(_RL_REQUIRED, (), MappingProxyType({"beta": 0.05})),
        "gspo": _Schema(
            (*_RL_REQUIRED, SEQUENCE_RATIO_MASK), (CLIP_LOW, CLIP_HIGH), _CLIP_DEFAULTS
        ),
        STABLE_REINFORCE: _Schema((*_RL_REQUIRED, SAMPLED_SEQUENCE), (), STABLE_REINFORCE_DEFAULTS),
    }
)

LOSS_INPUT_KEYS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {name: s.required + s.optional for name, s in _SCHEMAS.items()}
)
"""Every ``loss_fn_inputs`` key each loss accepts (required ones first)."""

LOSS_CONFIG_DEFAULTS: Mapping[str, Mapping[str, float]] = MappingProxyType(
    {name: s.config_defaults for name, s in _SCHEMAS.items()}
)
"""The ``loss_fn_config`` keys each loss accepts, with their defaults."""


class LossInputError(ValueError):
    """A datum's loss inputs or the request's loss config are unusable.

    A ``ValueError`` so that servers mapping those to HTTP 400 need no change;
    the message names the offending field and value so the client can fix it.
    """


@dataclass(frozen=True)
class LossSpec:
    """One datum's validated loss request.

    ``inputs`` holds float32 tensors, except ``target_tokens`` (int64).
    ``config`` holds every config key of the loss with defaults filled in;
    per-token clip tensors, when given, live in ``inputs`` and take precedence.
    """

    name: str
    inputs: dict[str, torch.Tensor]
    config: dict[str, float]

    def to(self, device: torch.device | str) -> LossSpec:
        """The same spec with its tensors on `device` (itself when they already are)."""
        device = torch.device(device)
        if all(t.device == device for t in self.inputs.values()):
            return self
        return LossSpec(self.name, {k: t.to(device) for k, t in self.inputs.items()}, self.config)


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def _position(index: list[int]) -> str:
    return f"position {index[0]}" if len(index) == 1 else f"position {tuple(index)}"


def _first(mask: torch.Tensor) -> list[int]:
    return [int(i) for i in mask.nonzero()[0].tolist()]


def format_shape(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def _describe(value: float) -> str:
    # 7 significant digits: a float32 0.9 should read 0.9, not 0.8999999761581421.
    return "NaN" if math.isnan(value) else f"{value:.7g}"


def _read_tensor(value: object, label: str, fail: _Fail) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise fail(f"{label} cannot be read as an array ({type(value).__name__}): {exc}") from exc


class _Fail:
    """Builds errors with the caller's ``where`` prefix, so every message has it."""

    def __init__(self, where: str) -> None:
        self.prefix = f"{where}: " if where else ""

    def __call__(self, message: str) -> LossInputError:
        return LossInputError(self.prefix + message)


def _check_targets(
    t: torch.Tensor, name: str, num_tokens: int, vocab_size: int, fail: _Fail
) -> torch.Tensor:
    label = f"loss_fn_inputs[{TARGETS!r}]"
    if not _is_integer_dtype(t.dtype):
        raise fail(f"{label} must hold integer token ids, got dtype {t.dtype}")
    allow_2d = name == "cross_entropy"
    ok_rank = t.dim() == 1 or (allow_2d and t.dim() == 2 and t.shape[1] >= 1)
    if not ok_rank or t.shape[0] != num_tokens:
        expected = f"[{num_tokens}]" + (f" or [{num_tokens}, K]" if allow_2d else "")
        raise fail(
            f"{label} has shape {format_shape(t.shape)}, expected {expected} "
            f"(one entry per model input token) for loss {name!r}"
        )
    t = t.to(torch.int64)
    bad = (t < 0) | (t >= vocab_size)
    if bool(bad.any()):
        index = _first(bad)
        raise fail(
            f"{label} has token id {int(t[tuple(index)])} at {_position(index)}, "
            f"outside [0, {vocab_size})"
        )
    return t


def _check_floats(
    t: torch.Tensor, key: str, shape: torch.Size, name: str, fail: _Fail
) -> torch.Tensor:
    label = f"loss_fn_inputs[{key!r}]"
    # Integer arrays are accepted: JSON clients often send 0/1 weights as ints.
    if not (t.dtype.is_floating_point or _is_integer_dtype(t.dtype)):
        raise fail(f"{label} must hold real numbers, got dtype {t.dtype}")
    if t.shape != shape:
        raise fail(
            f"{label} has shape {format_shape(t.shape)}, expected {format_shape(shape)} "
            f"(the shape of {TARGETS!r}) for loss {name!r}"
        )
    if t.dtype.is_floating_point:
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            index = _first(bad)
            raise fail(f"{label} has {_describe(float(t[tuple(index)]))} at {_position(index)}")
    t32 = t.to(torch.float32)
    bad = ~torch.isfinite(t32)
    if bool(bad.any()):
        index = _first(bad)
        raise fail(
            f"{label} has {float(t[tuple(index)])!r} at {_position(index)}, which overflows float32"
        )
    return t32


def _config_number(key: str, value: object, fail: _Fail) -> float:
    label = f"loss_fn_config[{key!r}]"
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise fail(f"{label} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise fail(f"{label} must be finite, got {_describe(number)}")
    return number


def _check_clip_order(
    inputs: Mapping[str, torch.Tensor], config: Mapping[str, float], fail: _Fail
) -> None:
    low = inputs.get(CLIP_LOW)
    high = inputs.get(CLIP_HIGH)
    if low is None and high is None:
        if config[CLIP_LOW] > config[CLIP_HIGH]:
            raise fail(
                f"loss_fn_config[{CLIP_LOW!r}] = {config[CLIP_LOW]!r} is greater than "
                f"loss_fn_config[{CLIP_HIGH!r}] = {config[CLIP_HIGH]!r}"
            )
        return
    low_t = low if low is not None else torch.tensor(config[CLIP_LOW])
    high_t = high if high is not None else torch.tensor(config[CLIP_HIGH])
    bad = low_t > high_t
    if bool(bad.any()):
        index = _first(bad.expand(torch.broadcast_shapes(low_t.shape, high_t.shape)))
        low_v = float(low_t.expand_as(bad)[tuple(index)])
        high_v = float(high_t.expand_as(bad)[tuple(index)])
        low_src = (
            f"loss_fn_inputs[{CLIP_LOW!r}]" if low is not None else f"loss_fn_config[{CLIP_LOW!r}]"
        )
        high_src = (
            f"loss_fn_inputs[{CLIP_HIGH!r}]"
            if high is not None
            else f"loss_fn_config[{CLIP_HIGH!r}]"
        )
        raise fail(
            f"{low_src} = {_describe(low_v)} is greater than {high_src} = {_describe(high_v)} "
            f"at {_position(index)}"
        )


def validate_loss(
    name: str,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float] | None,
    num_tokens: int,
    vocab_size: int,
    *,
    where: str = "",
    device: torch.device | str | None = None,
) -> LossSpec:
    """Validate one datum's loss request completely, before any compute.

    Doing every check up front is what lets the engine promise that a rejected
    datum changed no state; ``compute_loss`` therefore assumes a valid spec.
    ``where`` (e.g. ``"datum 3"``) prefixes every message so a client sending a
    batch knows which datum to fix.  Validation runs wherever ``inputs`` live
    (keep them on CPU to avoid device syncs); ``device``, if given, is where
    the validated tensors are then moved for ``compute_loss``.

    Raises LossInputError naming the field and the bad value or position.
    Non-tensor inputs (lists, numpy arrays) are converted with
    ``torch.as_tensor``.
    """
    fail = _Fail(where)
    schema = _SCHEMAS.get(name)
    if schema is None:
        if name in REFUSED_LOSSES:
            raise fail(
                f"loss_fn {name!r} is not supported by this server: {REFUSED_LOSSES[name]} "
                f"(supported: {', '.join(LOSS_NAMES)})"
            )
        raise fail(f"unknown loss_fn {name!r}; known: {', '.join(LOSS_NAMES)}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if num_tokens < 1:
        raise fail(f"model_input has {num_tokens} tokens; a datum needs at least 1")
    _check_keys(name, schema, inputs, fail)
    checked = _check_inputs(name, schema, inputs, num_tokens, vocab_size, fail)
    resolved = _resolve_config(name, schema, config, fail)
    if CLIP_LOW in resolved:
        _check_clip_order(checked, resolved, fail)
    if SEQUENCE_RATIO_MASK in checked and not bool((checked[SEQUENCE_RATIO_MASK] != 0).any()):
        # The sequence ratio is a mean over the marked tokens: over none it is undefined.
        raise fail(
            f"loss_fn_inputs[{SEQUENCE_RATIO_MASK!r}] marks no token (all zero); loss {name!r} "
            "averages the log-ratio over the marked tokens, so at least one must be nonzero"
        )
    if name == STABLE_REINFORCE:
        _check_segments(checked, fail)
    if device is not None:
        checked = {key: t.to(device) for key, t in checked.items()}
    return LossSpec(name=name, inputs=checked, config=resolved)


def _check_keys(name: str, schema: _Schema, inputs: Mapping[str, object], fail: _Fail) -> None:
    missing = [key for key in schema.required if key not in inputs]
    if missing:
        raise fail(
            f"loss {name!r} needs loss_fn_inputs {', '.join(map(repr, missing))}, "
            f"which {'is' if len(missing) == 1 else 'are'} missing"
        )
    accepted = schema.required + schema.optional
    for key in inputs:
        if key not in accepted:
            raise fail(
                f"loss_fn_inputs[{key!r}] is not accepted by loss {name!r} "
                f"(accepted: {', '.join(accepted)})"
            )


def _check_inputs(
    name: str,
    schema: _Schema,
    inputs: Mapping[str, object],
    num_tokens: int,
    vocab_size: int,
    fail: _Fail,
) -> dict[str, torch.Tensor]:
    """The inputs as tensors: int64 targets first, then float32 values of the targets' shape."""
    targets = _check_targets(
        _read_tensor(inputs[TARGETS], f"loss_fn_inputs[{TARGETS!r}]", fail),
        name,
        num_tokens,
        vocab_size,
        fail,
    )
    checked: dict[str, torch.Tensor] = {TARGETS: targets}
    for key in schema.required + schema.optional:
        if key == TARGETS or key not in inputs:
            continue
        raw = _read_tensor(inputs[key], f"loss_fn_inputs[{key!r}]", fail)
        checked[key] = _check_floats(raw, key, targets.shape, name, fail)
    for key in schema.ones_if_missing:
        if key not in checked:
            checked[key] = torch.ones(targets.shape, dtype=torch.float32)
    return checked


def _resolve_config(
    name: str, schema: _Schema, config: Mapping[str, object] | None, fail: _Fail
) -> dict[str, float]:
    """Every config key of the loss, the given ones checked, the others at their defaults."""
    resolved = dict(schema.config_defaults)
    for key, value in (config or {}).items():
        if key not in schema.config_defaults:
            known = ", ".join(schema.config_defaults) or "none"
            raise fail(
                f"loss_fn_config[{key!r}] is not accepted by loss {name!r} (accepted: {known})"
            )
        resolved[key] = _config_number(key, value, fail)
    if "beta" in resolved and resolved["beta"] < 0:
        raise fail(f"loss_fn_config['beta'] must be >= 0, got {resolved['beta']!r}")
    if name == STABLE_REINFORCE:
        _check_stable_config(resolved, fail)
    return resolved


def _check_stable_config(config: Mapping[str, float], fail: _Fail) -> None:
    """The ranges that keep stable_reinforce's weights bounded and its guards meaningful:
    every threshold is a ratio, and a guard must keep on-policy tokens (ratio 1)."""
    if not config["token_clip"] > 0:
        raise fail(f"loss_fn_config['token_clip'] must be > 0, got {config['token_clip']!r}")
    if config["kl_coeff"] < 0:
        raise fail(f"loss_fn_config['kl_coeff'] must be >= 0, got {config['kl_coeff']!r}")
    for low, high in (("token_mask_low", "token_mask_high"), ("seq_mask_low", "seq_mask_high")):
        if not 0 <= config[low] <= 1 <= config[high]:
            raise fail(
                f"loss_fn_config[{low!r}] = {config[low]!r} and loss_fn_config[{high!r}] = "
                f"{config[high]!r} must satisfy 0 <= {low} <= 1 <= {high} (a ratio of 1, an "
                "on-policy token, must pass)"
            )


def _check_segments(inputs: Mapping[str, torch.Tensor], fail: _Fail) -> None:
    segment = inputs[SAMPLED_SEQUENCE]
    bad = (segment < 0) | (segment != segment.round())
    if bool(bad.any()):
        index = _first(bad)
        raise fail(
            f"loss_fn_inputs[{SAMPLED_SEQUENCE!r}] has {_describe(float(segment[tuple(index)]))} "
            f"at {_position(index)}; it holds 0 (not a sampled token) or a sequence number >= 1"
        )
    if not bool((segment > 0).any()):
        raise fail(
            f"loss_fn_inputs[{SAMPLED_SEQUENCE!r}] marks no sampled token; stable_reinforce "
            "trains only recorded sampled tokens"
        )


def loss_targets(spec: LossSpec) -> torch.Tensor:
    """The int64 target ids ([T] or [T, K]) whose log-probs the engine must gather."""
    return spec.inputs[TARGETS]
