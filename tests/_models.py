"""Tiny random HF models built from a config, for unit tests that need no preset files."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config


def tiny_qwen3(
    seed: int = 0, *, hidden: int = 64, vocab: int = 96, layers: int = 2
) -> torch.nn.Module:
    config = Qwen3Config(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval()


def tiny_llama(seed: int = 0, *, hidden: int = 48, vocab: int = 90) -> torch.nn.Module:
    """Odd sizes on purpose (not multiples of 16 bytes in bf16), tied embeddings."""
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval()
