"""How many tokens one training micro-batch may hold on a device: free memory over the bytes
each token keeps alive for the backward.

The trainer packs a call into micro-batches by a token budget (layout.py). On a GPU the right
budget is as large as memory allows (bigger matmuls, fewer passes), and a fixed default is
either wasteful on an H200 or fatal on a small card. The estimate counts what autograd keeps
per token of a dense decoder:

- per decoder layer, in the base dtype: about 6 hidden-sized tensors (the residual input, two
  norm outputs, the attention output and its projection, the MLP output), q/k/v (and the
  rotated q/k) and 4 intermediate-sized ones (gate, up, the activation and the product);
- per adapted projection input, the fp32 copy the LoRA path takes of it (kernels.py: the LoRA
  runs in fp32), for q/k/v, o, gate/up and down;
- at the head, per hidden row, three fp32 vocabulary-wide tensors alive together when the
  backward starts there (before any layer's): the log-softmax autograd saved, its gradient
  and the logits' gradient (measured on the CPU: about 11.9 bytes per vocabulary entry in
  bf16 and 11.4 in fp32; counting the forward's logits and log-softmax instead, 6 bytes in
  bf16, under-counted the head by half, and with recompute, where the head dominates, the
  whole estimate by 1.6x: a budget past free memory).

With recompute (recompute.py) a layer keeps only its input, plus one layer's full activations
while it is recomputed. The estimate is deliberately generous (no fusion credit), and the
budget fills only the `headroom` fraction of free memory, leaving the rest to the allocator's
fragmentation and the optimizer's temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

HIDDEN_TENSORS = 6
INTERMEDIATE_TENSORS = 4
HEAD_FP32_TENSORS = 3
DEFAULT_HEADROOM = 0.75


@dataclass(frozen=True)
class DecoderShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: Any) -> DecoderShape:
        """From a transformers config (its text config for multimodal ones)."""
        text = (
            config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        )
        heads = int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or int(text.hidden_size) // heads
        return cls(
            hidden=int(text.hidden_size),
            intermediate=int(text.intermediate_size),
            layers=int(text.num_hidden_layers),
            heads=heads,
            kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            vocab=int(text.vocab_size),
        )


def layer_bytes_per_token(shape: DecoderShape, dtype_bytes: int, *, lora: bool = True) -> int:
    """What one decoder layer keeps per token for its backward."""
    qkv = (2 * shape.heads + 3 * shape.kv_heads) * shape.head_dim  # q, k, v, rotated q, k
    base = dtype_bytes * (
        HIDDEN_TENSORS * shape.hidden + qkv + INTERMEDIATE_TENSORS * shape.intermediate
    )
    # fp32 copies of the adapted projections' inputs: q/k/v and gate/up share theirs.
    lora_inputs = 4 * (3 * shape.hidden + shape.heads * shape.head_dim + shape.intermediate)
    return base + (lora_inputs if lora else 0)


def activation_bytes_per_token(
    shape: DecoderShape, dtype_bytes: int, *, recompute: bool = False, lora: bool = True
) -> int:
    """Bytes a training token keeps alive until its backward (the head included)."""
    if dtype_bytes not in (2, 4):
        raise ValueError(f"dtype_bytes must be 2 (bf16) or 4 (fp32), got {dtype_bytes!r}")
    layer = layer_bytes_per_token(shape, dtype_bytes, lora=lora)
    head = shape.vocab * 4 * HEAD_FP32_TENSORS + shape.hidden * dtype_bytes
    if recompute:
        # Every layer's input, plus one layer recomputed at a time.
        return shape.layers * shape.hidden * dtype_bytes + layer + head
    return shape.layers * layer + head


def token_budget_for_memory(
    free_bytes: int,
    per_token_bytes: int,
    *,
    headroom: float = DEFAULT_HEADROOM,
    minimum: int = 1,
    maximum: int | None = None,
) -> int:
    """The micro-batch token budget that fits `headroom` of `free_bytes`, clamped to
    [minimum, maximum]. Raises ValueError when not even `minimum` tokens fit."""
    if free_bytes < 0 or per_token_bytes <= 0:
        raise ValueError(
            f"free_bytes must be >= 0 and per_token_bytes > 0, got {free_bytes} and {per_token_bytes}"
        )
    if not 0.0 < headroom <= 1.0:
        raise ValueError(f"headroom must be in (0, 1], got {headroom}")
    if minimum < 1 or (maximum is not None and maximum < minimum):
        raise ValueError(f"need 1 <= minimum <= maximum, got {minimum} and {maximum}")
    budget = int(free_bytes * headroom) // per_token_bytes
    if budget < minimum:
        raise ValueError(
            f"{free_bytes} free bytes hold {budget} training tokens at {per_token_bytes} bytes "
            f"each (headroom {headroom}), fewer than the minimum {minimum}; turn recompute on "
            "or free device memory"
        )
    return budget if maximum is None else min(budget, maximum)


def device_token_budget(
    model: torch.nn.Module,
    device: torch.device,
    *,
    recompute: bool = False,
    headroom: float = DEFAULT_HEADROOM,
    maximum: int | None = None,
) -> int:
    """`token_budget_for_memory` with the device's free memory now (CUDA only: a CPU's
    memory is the operating system's to share, so callers keep their fixed budget there)."""
    if device.type != "cuda":
        raise ValueError(f"device_token_budget reads CUDA memory; got device {device}")
    free, _total = torch.cuda.mem_get_info(device)
    dtype = next(model.parameters()).dtype
    hf: Any = model
    per_token = activation_bytes_per_token(
        DecoderShape.from_config(hf.config), dtype.itemsize, recompute=recompute
    )
    return token_budget_for_memory(free, per_token, headroom=headroom, maximum=maximum)
