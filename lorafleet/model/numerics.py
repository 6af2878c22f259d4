"""Batch-invariant numerics: a row's result does not depend on what shares its batch.

Why: tenants share one base model's forward. With the stock kernels a row's log-probs depend on
its partners (docs/numerics.md has the measurements): PyTorch's CPU SDPA picks another kernel
path once the (padded) key length reaches 48, so a datum padded to a longer partner's length is
computed differently (up to 0.25 nats per token in bf16), and oneDNN/MKL matmuls pick kernels by
the number of rows, so a row's output changes with how many rows share the call (1 ulp here and
there, which 30 layers grow to ~1e-2 nats in bf16). `batch-invariant` replaces both at one seam:

- every `nn.Linear` of the base (the targets' base layers and the head) multiplies in tiles of
  exactly `LINEAR_TILE` rows (the last tile zero-padded): the kernel only ever sees one shape
  per weight, and a row's result does not depend on its place in a tile (measured on oneDNN
  AMX/AVX-512 and MKL fp32), so it does not depend on its partners;
- attention runs `invariant_attention`: fp32, over each row's own keys (padding and the gaps of
  the prefix-sharing second forward compacted away), in fixed chunks of `KV_CHUNK` keys from
  position 0, each chunk's products with one fixed gemm shape per query count, chunk partial
  sums added in order. A query at position p sees exactly the same chunks whatever the padded
  key length, the batch, or whether it is decoded alone or prefilled with others.

What remains: elementwise transcendental functions (exp, rsqrt) may take a vector or a scalar
path depending on a tensor's size (last-bit fp32 differences, far below bf16's resolution), and
gradient sums over a slot's tokens run in the batch's order (cosine >= 0.9999, measured).

`fast` keeps the stock kernels (the default: DEFAULT_NUMERICS says why). The mode is a
property of the model (`apply_numerics`), set once by `colocate` from the command's
`--numerics`. On CUDA the same seam applies: the tiled
linear keeps cuBLAS on one shape per weight (cuBLAS picks split-K and tile by shape), and the
attention is the same chunked fp32 code (no flash kernel); the fused LoRA kernel is per-row
already. That side is not measured here (no GPU on the machine this was built on).
"""

from __future__ import annotations

import types
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

NumericsName = Literal["batch-invariant", "fast"]
NUMERICS: tuple[NumericsName, ...] = ("batch-invariant", "fast")
DEFAULT_NUMERICS: NumericsName = "fast"
"""The default of every command. Issue 35's rule: batch-invariant by default where it costs at
most 15% of the README job's step time; measured on the 2-core AMX Xeon it costs far more
(NUMERICS_COST, docs/numerics.md: the 64-row tiles make oneDNN re-pack each weight per tile), so
fast. Not measured on a GPU."""

NUMERICS_COST = (
    "batch-invariant costs about +120% CPU time per step on the README job (2-core AMX Xeon, "
    "bf16; bench/numerics_cost.py), so fast is the default"
)
"""The measured cost the default was chosen on, printed at start-up and in --help."""

INVARIANT_ATTENTION = "lorafleet_invariant"
"""The attention implementation name (config._attn_implementation) of the invariant path."""

LINEAR_TILE = 64
"""Rows per base matmul call on the invariant path: every call has exactly this many rows."""

KV_CHUNK = 64
"""Keys per attention chunk: a query's scores and weighted values are summed chunk by chunk."""

_STOCK_ATTENTION = "_lorafleet_stock_attention"  # attribute keeping the config's own choice


def parse_numerics(value: str) -> NumericsName:
    """`value` if it names a mode; ValueError naming the value and the choices otherwise."""
    for name in NUMERICS:
        if value == name:
            return name
    raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}; got {value!r}")


# --------------------------------------------------------------------------- linear


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed in calls of exactly LINEAR_TILE rows each."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    rows = flat.shape[0]
    pad = (-rows) % LINEAR_TILE
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
    if flat.shape[0] == LINEAR_TILE:
        out = F.linear(flat, weight, bias)
    else:
        out = torch.cat([F.linear(tile, weight, bias) for tile in flat.split(LINEAR_TILE)])
    if pad:
        out = out[:rows]
    return out.reshape(*shape[:-1], weight.shape[0])


def _tiled_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return invariant_linear(x, self.weight, self.bias)


# --------------------------------------------------------------------------- attention


def _allowed(
    attention_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int, device: torch.device
) -> torch.Tensor:
    """bool [B, 1|H, q, kv], True = attend. None means causal, queries at the end of the keys."""
    if attention_mask is None:
        rows = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
        causal = torch.arange(kv_len, device=device).unsqueeze(0) <= rows
        return causal.expand(batch, 1, q_len, kv_len)
    mask = attention_mask[..., :kv_len]
    if mask.dtype == torch.bool:
        return mask.expand(batch, -1, q_len, kv_len)
    # an additive mask (0 = attend, the dtype's minimum = masked), as eager attention takes
    return (mask > torch.finfo(mask.dtype).min / 2).expand(batch, -1, q_len, kv_len)


def _compact(
    key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Moves each batch row's usable keys to its first columns, in order, so chunking starts at
    the row's own first key (the second forward of a shared prefix leaves a gap between a
    member's prefix and its own tokens). A no-op when every row's keys already form a prefix."""
    usable = allowed.any(dim=2).any(dim=1)  # [B, kv]
    if bool((usable[:, 1:] <= usable[:, :-1]).all()):
        return key, value, allowed
    order = torch.argsort((~usable).to(torch.int8), dim=1, stable=True)  # [B, kv]
    take = order[:, None, :, None]
    key = key.gather(2, take.expand(-1, key.shape[1], -1, key.shape[3]))
    value = value.gather(2, take.expand(-1, value.shape[1], -1, value.shape[3]))
    allowed = allowed.gather(
        3, order[:, None, None, :].expand(-1, allowed.shape[1], allowed.shape[2], -1)
    )
    return key, value, allowed


def invariant_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """HF attention interface: query [B, H, q, D], key/value [B, Hkv, kv, D] -> [B, q, H, D].

    Each gemm has a fixed M and K (the chunk's keys, the head size) and the query count as N,
    which oneDNN/MKL compute column by column the same way for any N >= 2 (a single query is
    doubled: a one-column product takes the gemv path)."""
    if dropout:
        raise ValueError("batch-invariant attention has no dropout (the base model is frozen)")
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise NotImplementedError("batch-invariant attention: no softcap or sliding window")
    batch, heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    groups = heads // key.shape[1]
    allowed = _allowed(attention_mask, batch, q_len, kv_len, query.device)
    key, value, allowed = _compact(key, value, allowed)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scale = head_dim**-0.5 if scaling is None else scaling
    single = q_len == 1
    queries = torch.cat([query, query], dim=2) if single else query
    allowed = torch.cat([allowed, allowed], dim=2) if single else allowed
    n_q = queries.shape[2]
    chunks = -(-kv_len // KV_CHUNK)
    pad = chunks * KV_CHUNK - kv_len
    keys = key.float()
    values = torch.cat(
        [value.float(), value.new_ones(*value.shape[:3], 1, dtype=torch.float32)], -1
    )
    if pad:
        keys = F.pad(keys, (0, 0, 0, pad))
        values = F.pad(values, (0, 0, 0, pad))
        allowed = F.pad(allowed, (0, pad), value=False)
    keys = keys.view(batch, heads, chunks, KV_CHUNK, head_dim)
    q_t = queries.float().transpose(-1, -2).unsqueeze(2)  # [B, H, 1, D, q]
    scores = torch.matmul(keys, q_t) * scale  # [B, H, C, chunk, q]
    visible = allowed.view(batch, allowed.shape[1], n_q, chunks, KV_CHUNK).permute(0, 1, 3, 4, 2)
    scores = scores.masked_fill(~visible, float("-inf"))
    peak = scores.amax(dim=(2, 3), keepdim=True)
    peak = peak.masked_fill(torch.isinf(peak), 0.0)  # a query that sees nothing (padding)
    weights = torch.exp(scores - peak)  # [B, H, C, chunk, q], 0 where masked
    v_t = values.view(batch, heads, chunks, KV_CHUNK, head_dim + 1).transpose(-1, -2)
    parts = torch.matmul(v_t, weights)  # [B, H, C, D + 1, q]
    total = parts[:, :, 0]
    for c in range(1, chunks):
        total = total + parts[:, :, c]
    out = total[:, :, :head_dim] / total[:, :, head_dim:].clamp_min(torch.finfo(torch.float32).tiny)
    if single:
        out = out[..., :1]
    return out.permute(0, 3, 1, 2).to(query.dtype).contiguous(), None


def _invariant_mask(*args: object, **kwargs: object) -> torch.Tensor | None:
    """SDPA's bool mask, never skipped for `is_causal` (the invariant attention takes masks)."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)  # type: ignore[arg-type]


ALL_ATTENTION_FUNCTIONS.register(INVARIANT_ATTENTION, invariant_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(INVARIANT_ATTENTION, _invariant_mask)


# --------------------------------------------------------------------------- the switch


def _configs(model: nn.Module) -> list[object]:
    config = getattr(model, "config", None)
    if config is None:
        return []
    found = [config]
    for name in ("text_config", "decoder"):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            found.append(sub)
    return found


def apply_numerics(model: nn.Module, numerics: NumericsName) -> None:
    """Switches `model` (in place, reversibly) to `numerics`. Every nn.Linear's forward becomes
    the tiled one (or its own again) and the attention implementation the invariant one (or
    the one the model was loaded with)."""
    numerics = parse_numerics(numerics)
    invariant = numerics == "batch-invariant"
    for module in model.modules():
        if isinstance(module, nn.Linear):
            if invariant:
                module.forward = types.MethodType(_tiled_forward, module)  # type: ignore[method-assign]
            elif "forward" in module.__dict__:
                del module.forward
    for config in _configs(model):
        current = config._attn_implementation  # type: ignore[attr-defined]
        if invariant and current != INVARIANT_ATTENTION:
            if current not in ("sdpa", "eager"):
                raise NotImplementedError(
                    f"numerics batch-invariant: attention implementation {current!r} is not "
                    "supported (sdpa or eager models only)"
                )
            setattr(config, _STOCK_ATTENTION, current)
            config._attn_implementation = INVARIANT_ATTENTION  # type: ignore[attr-defined]
        elif not invariant and current == INVARIANT_ATTENTION:
            config._attn_implementation = getattr(config, _STOCK_ATTENTION, "sdpa")  # type: ignore[attr-defined]
    model._lorafleet_numerics = numerics  # type: ignore[assignment]


def model_numerics(model: nn.Module) -> NumericsName:
    """The mode `model` runs in (`fast` unless `apply_numerics` said otherwise)."""
    value = getattr(model, "_lorafleet_numerics", "fast")
    return "batch-invariant" if value == "batch-invariant" else "fast"
