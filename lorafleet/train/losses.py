"""The Tinker built-in loss functions, as pure torch on per-token log-probs.

The engine works one datum at a time: ``validate_loss`` (loss_inputs.py) checks the datum
before any forward pass; the engine gathers the current policy's log-probs of
``loss_targets(spec)`` (``[T]``, or ``[T, K]`` for top-k cross-entropy) with autograd on;
``compute_loss`` turns them into the summed loss and a dict of metrics; ``merge_metrics`` folds
the per-datum dicts into the batch's.

Every loss is the negative of a per-token objective, summed (never averaged) over tokens,
exactly as Tinker defines it; normalisation is the client's job (it chooses the weights /
advantages).

| loss_fn             | per-token objective                                  |
|---------------------|------------------------------------------------------|
| cross_entropy       | w * logp                                             |
| importance_sampling | r * A,                     r = exp(logp - logq)      |
| ppo                 | min(r * A, clip(r, lo, hi) * A)                      |
| cispo               | sg(clip(r, lo, hi)) * logp * A   (sg = stop-gradient) |
| dro                 | logp * A - beta/2 * (logp - logq)^2                  |
| gspo                | min(s_t * A, clip(s_t, lo, hi) * A),                 |
|                     |   s_t = exp(sg(S) + logp - sg(logp)),                |
|                     |   S = mean of (logp - logq) over sequence_ratio_mask |
| stable_reinforce    | m * sg(min(r, C)) * A * logp - k/2 * s * (logp - logq)^2 |
|                     |   s = 1 on recorded sampled tokens (sampled_sequence > 0), |
|                     |   t = s * [lo_t <= r <= hi_t],  m = t * [lo_s <= exp(S_seq) <= hi_s], |
|                     |   S_seq = mean of (logp - logq) over the sequence's t tokens |

``logq`` is the sampler's log-prob (input key ``logprobs``; for stable_reinforce the server's
record of it, never the client's), ``A`` the advantage, ``lo``/``hi``
the clip thresholds on the ratio and ``beta`` the DRO penalty (defaults in loss_inputs.py).
gspo is Tinker's GSPO-token: every token carries the value of the sequence's ratio
``exp(S)`` (a geometric mean of token ratios) but the gradient of its own log-prob, so clipping
keeps or drops whole sequences while per-token advantages still work.

Numerics: everything is computed in float32, whatever the dtype of the log-probs, because bf16
ratios ``exp(logp - logq)`` are off by up to ~1%.  Ratios are not clamped:
``importance_sampling`` is defined as unclipped, so for ``logp - logq`` above ~88.7 the float32
ratio overflows to ``inf`` and the loss and gradient become infinite.  ``compute_loss`` reports
that rather than hides it; the engine should check ``torch.isfinite(loss)`` before
``backward()`` if it wants to reject such a datum.  Two things are *not* overflow: tokens with
advantage 0 contribute exactly 0 (value and gradient) instead of ``inf * 0 = NaN``, and PPO
tokens on the clipped branch have a finite value and exactly zero gradient even when their
ratio overflows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from lorafleet.train.loss_inputs import (
    CLIP_HIGH,
    CLIP_LOW,
    SAMPLED_SEQUENCE,
    SEQUENCE_RATIO_MASK,
    STABLE_REINFORCE,
    TARGETS,
    LossSpec,
    format_shape,
)

__all__ = ["METRIC_REDUCTIONS", "compute_loss", "gradient_mask", "merge_metrics"]

METRIC_REDUCTIONS: tuple[str, ...] = ("sum", "mean", "min", "max")


def gradient_mask(spec: LossSpec) -> torch.Tensor:
    """Bool, shape of the targets: the entries whose loss term can have a non-zero gradient.

    Everywhere else the term's gradient is exactly zero whatever the current log-probs (a zero
    weight or advantage multiplies it or, where a ratio could overflow, masks it), so the engine
    may compute those log-probs without autograd. cross_entropy: ``weights != 0``;
    importance_sampling, ppo, cispo, gspo: ``A != 0`` (ppo's clipped tokens depend on the
    log-probs, so they stay in; gspo's sequence ratio is a stop-gradient constant); dro: ``A != 0``,
    or everywhere when ``beta > 0`` (its penalty pulls every log-ratio to 0).
    """
    if spec.name == "cross_entropy":
        return spec.inputs["weights"] != 0
    if spec.name == STABLE_REINFORCE:
        sampled = spec.inputs[SAMPLED_SEQUENCE] > 0
        if spec.config["kl_coeff"] > 0:
            return sampled
        return sampled & (spec.inputs["advantages"] != 0)
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

    return bound(CLIP_LOW), bound(CLIP_HIGH)


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


def _gspo(spec: LossSpec, logp: torch.Tensor) -> tuple[torch.Tensor, _Metrics]:
    adv = spec.inputs["advantages"]
    log_ratio = logp - spec.inputs["logprobs"]
    in_ratio = spec.inputs[SEQUENCE_RATIO_MASK] != 0
    # The sequence's log-ratio: a stop-gradient constant (validation ensures in_ratio is nonempty).
    seq_log_ratio = torch.where(in_ratio, log_ratio.detach(), 0.0).sum() / in_ratio.sum()
    low, high = _clip_bounds(spec, logp)
    ratio_sg = torch.exp(seq_log_ratio).expand_as(logp)
    clipped_ratio = torch.minimum(torch.maximum(ratio_sg, low), high)
    # As in ppo: min(s*A, clip(s)*A) is the constant clipped term exactly when s has left the
    # range in the direction the advantage pushes it; only live tokens are exponentiated.
    on_clip = ((adv > 0) & (ratio_sg > high)) | ((adv < 0) & (ratio_sg < low))
    live = (adv != 0) & ~on_clip
    token_ratio = torch.exp(torch.where(live, seq_log_ratio + logp - logp.detach(), 0.0))
    objective = torch.where(live, token_ratio * adv, clipped_ratio * adv)
    metrics = _rl_metrics(log_ratio, adv != 0)
    metrics["clipped_tokens:sum"] = on_clip.sum().to(torch.float32)
    return objective, metrics


def _dro(spec: LossSpec, logp: torch.Tensor) -> tuple[torch.Tensor, _Metrics]:
    adv = spec.inputs["advantages"]
    log_ratio = logp - spec.inputs["logprobs"]
    objective = logp * adv - 0.5 * spec.config["beta"] * log_ratio.square()
    return objective, _rl_metrics(log_ratio, adv != 0)


def _stable_reinforce(spec: LossSpec, logp: torch.Tensor) -> tuple[torch.Tensor, _Metrics]:
    """REINFORCE on recorded sampled tokens with a truncated, masked importance weight and a
    sequence-level guard (docs/losses.md: the formula, why each part, the papers).

    The weight ``sg(min(r, C))`` is a constant per token, so each token's gradient is
    ``w * A * grad(logp)`` with ``0 <= w <= C``: bounded whatever the mismatch between the
    sampler and the trainer. Tokens whose ratio leaves ``[token_mask_low, token_mask_high]``
    and whole sequences whose geometric-mean ratio leaves ``[seq_mask_low, seq_mask_high]``
    get weight 0 (and no penalty): their samples came from a policy too far from this one for
    their advantage to say anything about it.
    """
    cfg = spec.config
    adv = spec.inputs["advantages"]
    segment = spec.inputs[SAMPLED_SEQUENCE]
    sampled = segment > 0
    log_ratio = logp - spec.inputs["logprobs"]
    log_ratio_sg = torch.where(sampled, log_ratio.detach(), 0.0)
    ratio_sg = torch.exp(log_ratio_sg)
    token_ok = sampled & (ratio_sg >= cfg["token_mask_low"]) & (ratio_sg <= cfg["token_mask_high"])
    # The sequence guard: each sampled run's mean log-ratio over the tokens the token mask kept
    # (one outlier token, masked already, does not drop its sequence), spread back over them.
    ids = segment.to(torch.int64)
    runs = int(ids.max()) + 1
    zeros = torch.zeros(runs, dtype=torch.float32, device=logp.device)
    sums = zeros.index_add(0, ids, torch.where(token_ok, log_ratio_sg, 0.0))
    kept = zeros.index_add(0, ids, token_ok.to(torch.float32))
    counts = zeros.index_add(0, ids, sampled.to(torch.float32))
    seq_log_ratio = sums / kept.clamp(min=1.0)
    seq_ok_run = (
        (kept > 0)
        & (seq_log_ratio >= math.log(max(cfg["seq_mask_low"], 1e-30)))
        & (seq_log_ratio <= math.log(cfg["seq_mask_high"]))
    )
    keep = token_ok & seq_ok_run[ids]
    weight = torch.where(keep, torch.clamp(ratio_sg, max=cfg["token_clip"]), 0.0)
    objective = weight * adv * logp
    if cfg["kl_coeff"] > 0:
        objective = objective - 0.5 * cfg["kl_coeff"] * torch.where(keep, log_ratio, 0.0).square()
    active = sampled & (adv != 0)
    metrics = _rl_metrics(log_ratio, active)
    present = counts[1:] > 0
    metrics["clipped_tokens:sum"] = (
        (keep & active & (ratio_sg > cfg["token_clip"])).sum().to(torch.float32)
    )
    metrics["masked_tokens:sum"] = (active & ~keep).sum().to(torch.float32)
    metrics["sequences:sum"] = present.sum().to(torch.float32)
    metrics["masked_sequences:sum"] = (present & ~seq_ok_run[1:]).sum().to(torch.float32)
    return objective, metrics


_LOSS_FNS = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
    "gspo": _gspo,
    STABLE_REINFORCE: _stable_reinforce,
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
    - ``clipped_tokens:sum`` (ppo, cispo, gspo, stable_reinforce): for ppo and gspo, tokens
      on the clipped branch, which get zero gradient; for cispo and stable_reinforce, tokens
      whose ratio weight was truncated.  Divide by ``active_tokens:sum`` for a clip fraction.
    - ``masked_tokens:sum``, ``sequences:sum``, ``masked_sequences:sum`` (stable_reinforce):
      active tokens given weight 0 by either guard; sampled sequences (runs) in the datum and
      how many the sequence guard dropped.

    No ``:mean`` metric is returned, because per-datum means cannot be merged
    without each datum's token count.
    """
    targets = spec.inputs[TARGETS]
    if target_logprobs.shape != targets.shape:
        raise ValueError(
            f"target_logprobs has shape {format_shape(target_logprobs.shape)}, "
            f"expected {format_shape(targets.shape)} (the shape of {TARGETS!r})"
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
