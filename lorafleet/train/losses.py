"""The Tinker built-in loss functions, as pure torch on per-token log-probs.

The engine works one datum at a time:

1. ``validate_loss`` checks the datum's ``loss_fn_inputs`` and the request's
   ``loss_fn_config`` before any forward pass, so a bad datum is rejected
   without touching adapter weights, gradients or optimizer state.
2. The engine gathers the current policy's log-probs of ``loss_targets(spec)``
   (``[T]``, or ``[T, K]`` for top-k cross-entropy) with autograd on.
3. ``compute_loss`` turns those log-probs into the summed loss and a dict of
   metrics; ``merge_metrics`` folds the per-datum dicts into the batch's.

Every loss is the negative of a per-token objective, summed (never averaged)
over tokens, exactly as Tinker defines it; normalisation is the client's job
(it chooses the weights / advantages).

| loss_fn             | per-token objective                                  |
|---------------------|------------------------------------------------------|
| cross_entropy       | w * logp                                             |
| importance_sampling | r * A,                     r = exp(logp - logq)      |
| ppo                 | min(r * A, clip(r, lo, hi) * A)                      |
| cispo               | sg(clip(r, lo, hi)) * logp * A   (sg = stop-gradient) |
| dro                 | logp * A - beta/2 * (logp - logq)^2                  |

``logq`` is the sampler's log-prob (input key ``logprobs``), ``A`` the
advantage.  ``lo``/``hi`` come from ``loss_fn_config`` keys
``clip_low_threshold``/``clip_high_threshold`` (defaults 0.8/1.2, thresholds
on the ratio itself, not epsilons), or per token from ``loss_fn_inputs`` keys
of the same names, which override the config value.  ``beta`` defaults to 0.05
(the value Tinker's docs use) because the cookbook's DRO recipe may omit it
and rejecting such requests would break it; an explicit value always wins.

Numerics: everything is computed in float32, whatever the dtype of the
log-probs, because bf16 ratios ``exp(logp - logq)`` are off by up to ~1%.
Ratios are not clamped: ``importance_sampling`` is defined as unclipped, so
for ``logp - logq`` above ~88.7 the float32 ratio overflows to ``inf`` and
the loss and gradient become infinite.  ``compute_loss`` reports that rather
than hides it; the engine should check ``torch.isfinite(loss)`` before
``backward()`` if it wants to reject such a datum.  Two things are *not*
overflow: tokens with advantage 0 contribute exactly 0 (value and gradient)
instead of ``inf * 0 = NaN``, and PPO tokens on the clipped branch have a
finite value and exactly zero gradient even when their ratio overflows.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

__all__ = [
    "LOSS_CONFIG_DEFAULTS",
    "LOSS_INPUT_KEYS",
    "LOSS_NAMES",
    "METRIC_REDUCTIONS",
    "LossInputError",
    "LossSpec",
    "compute_loss",
    "gradient_mask",
    "loss_targets",
    "merge_metrics",
    "validate_loss",
]

LOSS_NAMES: tuple[str, ...] = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")

METRIC_REDUCTIONS: tuple[str, ...] = ("sum", "mean", "min", "max")

_TARGETS = "target_tokens"
_CLIP_LOW = "clip_low_threshold"
_CLIP_HIGH = "clip_high_threshold"
_RL_REQUIRED = (_TARGETS, "logprobs", "advantages")
_CLIP_DEFAULTS = MappingProxyType({_CLIP_LOW: 0.8, _CLIP_HIGH: 1.2})


@dataclass(frozen=True)
class _Schema:
    required: tuple[str, ...]
    optional: tuple[str, ...]
    config_defaults: Mapping[str, float]


_SCHEMAS: Mapping[str, _Schema] = MappingProxyType(
    {
        "cross_entropy": _Schema((_TARGETS, "weights"), (), MappingProxyType({})),
        "importance_sampling": _Schema(_RL_REQUIRED, (), MappingProxyType({})),
        "ppo": _Schema(_RL_REQUIRED, (_CLIP_LOW, _CLIP_HIGH), _CLIP_DEFAULTS),
        "cispo": _Schema(_RL_REQUIRED, (_CLIP_LOW, _CLIP_HIGH), _CLIP_DEFAULTS),
        "dro": _Schema(_RL_REQUIRED, (), MappingProxyType({"beta": 0.05})),
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


# --------------------------------------------------------------------------- validation


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def _position(index: list[int]) -> str:
    return f"position {index[0]}" if len(index) == 1 else f"position {tuple(index)}"


def _first(mask: torch.Tensor) -> list[int]:
    return [int(i) for i in mask.nonzero()[0].tolist()]


def _shape(shape: Iterable[int]) -> str:
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
    label = f"loss_fn_inputs[{_TARGETS!r}]"
    if not _is_integer_dtype(t.dtype):
        raise fail(f"{label} must hold integer token ids, got dtype {t.dtype}")
    allow_2d = name == "cross_entropy"
    ok_rank = t.dim() == 1 or (allow_2d and t.dim() == 2 and t.shape[1] >= 1)
    if not ok_rank or t.shape[0] != num_tokens:
        expected = f"[{num_tokens}]" + (f" or [{num_tokens}, K]" if allow_2d else "")
        raise fail(
            f"{label} has shape {_shape(t.shape)}, expected {expected} "
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
            f"{label} has shape {_shape(t.shape)}, expected {_shape(shape)} "
            f"(the shape of {_TARGETS!r}) for loss {name!r}"
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
    low = inputs.get(_CLIP_LOW)
    high = inputs.get(_CLIP_HIGH)
    if low is None and high is None:
        if config[_CLIP_LOW] > config[_CLIP_HIGH]:
            raise fail(
                f"loss_fn_config[{_CLIP_LOW!r}] = {config[_CLIP_LOW]!r} is greater than "
                f"loss_fn_config[{_CLIP_HIGH!r}] = {config[_CLIP_HIGH]!r}"
            )
        return
    low_t = low if low is not None else torch.tensor(config[_CLIP_LOW])
    high_t = high if high is not None else torch.tensor(config[_CLIP_HIGH])
    bad = low_t > high_t
    if bool(bad.any()):
        index = _first(bad.expand(torch.broadcast_shapes(low_t.shape, high_t.shape)))
        low_v = float(low_t.expand_as(bad)[tuple(index)])
        high_v = float(high_t.expand_as(bad)[tuple(index)])
        low_src = (
            f"loss_fn_inputs[{_CLIP_LOW!r}]"
            if low is not None
            else f"loss_fn_config[{_CLIP_LOW!r}]"
        )
        high_src = (
            f"loss_fn_inputs[{_CLIP_HIGH!r}]"
            if high is not None
            else f"loss_fn_config[{_CLIP_HIGH!r}]"
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
        raise fail(f"unknown loss_fn {name!r}; known: {', '.join(LOSS_NAMES)}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if num_tokens < 1:
        raise fail(f"model_input has {num_tokens} tokens; a datum needs at least 1")

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

    targets = _check_targets(
        _read_tensor(inputs[_TARGETS], f"loss_fn_inputs[{_TARGETS!r}]", fail),
        name,
        num_tokens,
        vocab_size,
        fail,
    )
    checked: dict[str, torch.Tensor] = {_TARGETS: targets}
    for key in accepted:
        if key == _TARGETS or key not in inputs:
            continue
        raw = _read_tensor(inputs[key], f"loss_fn_inputs[{key!r}]", fail)
        checked[key] = _check_floats(raw, key, targets.shape, name, fail)

    config = {} if config is None else config
    resolved = dict(schema.config_defaults)
    for key, value in config.items():
        if key not in schema.config_defaults:
            known = ", ".join(schema.config_defaults) or "none"
            raise fail(
                f"loss_fn_config[{key!r}] is not accepted by loss {name!r} (accepted: {known})"
            )
        resolved[key] = _config_number(key, value, fail)
    if "beta" in resolved and resolved["beta"] < 0:
        raise fail(f"loss_fn_config['beta'] must be >= 0, got {resolved['beta']!r}")
    if _CLIP_LOW in resolved:
        _check_clip_order(checked, resolved, fail)

    if device is not None:
        checked = {key: t.to(device) for key, t in checked.items()}
    return LossSpec(name=name, inputs=checked, config=resolved)


def loss_targets(spec: LossSpec) -> torch.Tensor:
    """The int64 target ids ([T] or [T, K]) whose log-probs the engine must gather."""
    return spec.inputs[_TARGETS]


def gradient_mask(spec: LossSpec) -> torch.Tensor:
    """Bool, shape of the targets: the entries whose loss term can have a non-zero gradient.

    Everywhere else the term's gradient is exactly zero whatever the current log-probs (a zero
    weight or advantage multiplies it or, where a ratio could overflow, masks it), so the engine
    may compute those log-probs without autograd. cross_entropy: ``weights != 0``; importance_sampling, ppo,
    cispo: ``A != 0`` (ppo's clipped tokens depend on the log-probs, so they stay in); dro:
    ``A != 0``, or everywhere when ``beta > 0`` (its penalty pulls every log-ratio to 0).
    """
    if spec.name == "cross_entropy":
        return spec.inputs["weights"] != 0
    wanted = spec.inputs["advantages"] != 0
    if spec.name == "dro" and spec.config["beta"] > 0:
        wanted = torch.ones_like(wanted)
    return wanted


# --------------------------------------------------------------------------- losses

_Metrics = dict[str, torch.Tensor]


def _clip_bounds(spec: LossSpec, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    def bound(key: str) -> torch.Tensor:
        given = spec.inputs.get(key)
        if given is not None:
            return given
        return torch.full_like(like, spec.config[key])

    return bound(_CLIP_LOW), bound(_CLIP_HIGH)


def _rl_metrics(log_ratio: torch.Tensor, active: torch.Tensor) -> _Metrics:
    """Ratio statistics over tokens with a nonzero advantage.

    Only those tokens are policy actions: the cookbook gives prompt tokens
    advantage 0 and a placeholder sampler log-prob of 0, whose "ratio" would
    swamp min/max with meaningless values.
    """
    log_ratio = log_ratio.detach()
    inf = torch.tensor(math.inf, device=log_ratio.device)
    return {
        "active_tokens:sum": active.sum().to(torch.float32),
        "log_ratio:sum": torch.where(active, log_ratio, 0.0).sum(),
        "log_ratio:min": torch.where(active, log_ratio, inf).amin(),
        "log_ratio:max": torch.where(active, log_ratio, -inf).amax(),
    }


def _cross_entropy(spec: LossSpec, logp: torch.Tensor) -> tuple[torch.Tensor, _Metrics]:
    return spec.inputs["weights"] * logp, {}


def _importance_sampling(spec: LossSpec, logp: torch.Tensor) -> tuple[torch.Tensor, _Metrics]:
    adv = spec.inputs["advantages"]
    log_ratio = logp - spec.inputs["logprobs"]
    active = adv != 0
    # Masking the exponent (not the product) keeps A == 0 tokens at exactly 0
    # in value and gradient even when their ratio would overflow.
    ratio = torch.exp(torch.where(active, log_ratio, 0.0))
    return ratio * adv, _rl_metrics(log_ratio, active)


def _ppo(spec: LossSpec, logp: torch.Tensor) -> tuple[torch.Tensor, _Metrics]:
    adv = spec.inputs["advantages"]
    log_ratio = logp - spec.inputs["logprobs"]
    low, high = _clip_bounds(spec, logp)
    ratio_sg = torch.exp(log_ratio.detach())
    clipped_ratio = torch.minimum(torch.maximum(ratio_sg, low), high)
    # min(r*A, clip(r)*A) picks the (constant) clipped term exactly when the
    # ratio has left the range in the direction the advantage pushes it.
    on_clip = ((adv > 0) & (ratio_sg > high)) | ((adv < 0) & (ratio_sg < low))
    live = (adv != 0) & ~on_clip
    # Exponentiate only live tokens so that clipped or A == 0 tokens get a
    # zero gradient rather than 0 * inf = NaN from an overflowing ratio.
    ratio = torch.exp(torch.where(live, log_ratio, 0.0))
    objective = torch.where(live, ratio * adv, clipped_ratio * adv)
    metrics = _rl_metrics(log_ratio, adv != 0)
    metrics["clipped_tokens:sum"] = on_clip.sum().to(torch.float32)
    return objective, metrics


def _cispo(spec: LossSpec, logp: torch.Tensor) -> tuple[torch.Tensor, _Metrics]:
    adv = spec.inputs["advantages"]
    log_ratio = logp - spec.inputs["logprobs"]
    low, high = _clip_bounds(spec, logp)
    ratio_sg = torch.exp(log_ratio.detach())
    coefficient = torch.minimum(torch.maximum(ratio_sg, low), high) * adv
    active = adv != 0
    metrics = _rl_metrics(log_ratio, active)
    metrics["clipped_tokens:sum"] = (
        (active & ((ratio_sg < low) | (ratio_sg > high))).sum().to(torch.float32)
    )
    return coefficient * logp, metrics


def _dro(spec: LossSpec, logp: torch.Tensor) -> tuple[torch.Tensor, _Metrics]:
    adv = spec.inputs["advantages"]
    log_ratio = logp - spec.inputs["logprobs"]
    objective = logp * adv - 0.5 * spec.config["beta"] * log_ratio.square()
    return objective, _rl_metrics(log_ratio, adv != 0)


_LOSS_FNS = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
}


def compute_loss(
    spec: LossSpec, target_logprobs: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """The datum's summed loss (0-d float32, differentiable) and its metrics.

    ``target_logprobs`` are the current policy's log-probs of
    ``loss_targets(spec)``, same shape, any float dtype (upcast to float32).

    Metrics, all combinable across datums by their suffix (see
    ``merge_metrics``); ratios are ``r = exp(logp - logq)``:

    - ``loss:sum``: the loss value (every loss).
    - ``active_tokens:sum``: tokens with nonzero advantage (RL losses).
    - ``log_ratio:sum`` / ``log_ratio:min`` / ``log_ratio:max``: ``logp - logq``
      over those tokens (RL losses).  ``log_ratio:sum / active_tokens:sum`` is
      minus the usual k1 estimate of KL(q || p).  Logs rather than ratios,
      because a ratio can overflow to inf and inf is not valid JSON.  The
      min/max keys are omitted when the datum has no such token.
    - ``clipped_tokens:sum`` (ppo, cispo): for ppo, tokens on the clipped
      branch, which get zero gradient; for cispo, tokens whose ratio weight
      was clipped.  Divide by ``active_tokens:sum`` for a clip fraction.

    No ``:mean`` metric is returned, because per-datum means cannot be merged
    without each datum's token count.
    """
    targets = spec.inputs[_TARGETS]
    if target_logprobs.shape != targets.shape:
        raise ValueError(
            f"target_logprobs has shape {_shape(target_logprobs.shape)}, "
            f"expected {_shape(targets.shape)} (the shape of {_TARGETS!r})"
        )
    if not target_logprobs.dtype.is_floating_point:
        raise TypeError(f"target_logprobs must be floating point, got {target_logprobs.dtype}")
    logp = target_logprobs.to(torch.float32)
    objective, metric_tensors = _LOSS_FNS[spec.name](spec, logp)
    loss = -objective.sum()

    names = ["loss:sum", *metric_tensors]
    values = torch.stack([loss.detach(), *metric_tensors.values()]).tolist()  # one device sync
    metrics = dict(zip(names, values, strict=True))
    if metrics.get("active_tokens:sum") == 0:
        del metrics["log_ratio:min"], metrics["log_ratio:max"]
    return loss, metrics


# --------------------------------------------------------------------------- metrics


def _reduction(key: str) -> str:
    base, sep, reduction = key.rpartition(":")
    if not sep or not base or reduction not in METRIC_REDUCTIONS:
        raise ValueError(
            f"metric key {key!r} must look like 'name:reduction' with reduction in "
            f"{', '.join(METRIC_REDUCTIONS)}"
        )
    return reduction


def merge_metrics(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Combine per-datum (or per-chunk) metric dicts by each key's suffix.

    ``:sum`` adds, ``:min``/``:max`` take the extreme (NaN propagates, as in
    torch), ``:mean`` is the unweighted mean of the parts that have the key,
    which is only right if every part weighs the same; this module emits no
    ``:mean`` keys for that reason.  A key missing from some parts is merged
    over the parts that have it.  Raises ValueError for a key without a
    known reduction suffix.
    """
    merged: dict[str, float] = {}
    counts: dict[str, int] = {}
    for part in parts:
        for key, raw in part.items():
            reduction = _reduction(key)
            value = float(raw)
            if key not in merged:
                merged[key] = value
                counts[key] = 1
                continue
            counts[key] += 1
            current = merged[key]
            if reduction in ("sum", "mean"):
                merged[key] = current + value
            elif math.isnan(current) or math.isnan(value):
                merged[key] = math.nan
            elif reduction == "min":
                merged[key] = min(current, value)
            else:
                merged[key] = max(current, value)
    for key, count in counts.items():
        if _reduction(key) == "mean":
            merged[key] /= count
    return merged
