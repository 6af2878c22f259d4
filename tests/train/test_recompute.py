"""Activation recompute in the trainer (exact gradients, the sampler's no-grad forwards
untouched) and the micro-batch token budget sized from device memory."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.routing import RoutingScope
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.train.engine import TrainEngine, TrainItem
from lorafleet.train.recompute import recompute_enabled, set_recompute
from lorafleet.train.token_budget import (
    DecoderShape,
    activation_bytes_per_token,
    layer_bytes_per_token,
    token_budget_for_memory,
)
from tests._models import tiny_qwen3

VOCAB = 96


def _engine(recompute: bool) -> TrainEngine:
    model = tiny_qwen3(seed=0)
    adapted = AdaptedModel(model, resolve_tinker_targets(model))
    bank = adapted.add_bank("train", num_slots=4, r_max=8)
    engine = TrainEngine(adapted, base_model_id="tiny", recompute=recompute)
    for seed, rank in ((1, 4), (2, 8)):
        slot = engine.create_adapter(AdapterSpec(rank=rank, alpha=8.0, seed=seed))
        weights = {
            path: (A, 0.3 * torch.randn(B.shape, generator=torch.Generator().manual_seed(seed)))
            for path, (A, B) in bank.slot_weights(slot).items()
        }
        bank.load_slot_weights(slot, weights)
    return engine


def _items() -> list[TrainItem]:
    items = []
    for i, slot in enumerate((1, 2, 1, 2)):
        gen = torch.Generator().manual_seed(i)
        seq = torch.randint(0, VOCAB, (9,), generator=gen)
        weights = torch.ones(8)
        items.append(
            TrainItem(
                slot, seq[:-1], "cross_entropy", {"target_tokens": seq[1:], "weights": weights}
            )
        )
    # Two items of one slot sharing a prompt: prefix sharing would group them (off with recompute).
    shared = torch.arange(10, 22)
    for j in range(2):
        seq = torch.cat([shared, torch.tensor([30 + j, 40 + j, 50])])
        items.append(
            TrainItem(
                2, seq[:-1], "cross_entropy", {"target_tokens": seq[1:], "weights": torch.ones(14)}
            )
        )
    return items


def test_gradients_equal_with_and_without_recompute():
    results = {}
    for recompute in (False, True):
        engine = _engine(recompute)
        assert engine.recompute is recompute and engine.share_prefixes is not recompute
        assert recompute_enabled(engine.adapted.model) is recompute
        calls: list[int] = []
        layer = engine.adapted.layers["model.layers.1.self_attn.q_proj"]
        handle = layer.register_forward_pre_hook(lambda *args, calls=calls: calls.append(1))
        out = engine.forward_backward(_items())
        handle.remove()
        # With recompute the layer runs again in the backward (under the forward's routing).
        assert len(calls) == out.num_microbatches * (2 if recompute else 1)
        grads = engine.bank.grads
        assert grads is not None
        results[recompute] = (torch.cat([item.logprobs for item in out.items]), grads.clone())
    (lp, grads), (lp_re, grads_re) = results[False], results[True]
    torch.testing.assert_close(lp_re, lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads_re, grads, atol=1e-5, rtol=1e-4)
    assert grads[1:3].abs().sum() > 0


def test_recompute_leaves_no_grad_forwards_and_their_cache_alone():
    """The sampler runs no-grad forwards with a KV cache on the same base: with recompute on,
    the cache is still filled and the logits are unchanged."""
    engine = _engine(True)
    adapted = engine.adapted
    model = adapted.model
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    outputs = []
    for enabled in (True, False):
        set_recompute(model, adapted.scope, enabled)
        cache = DynamicCache()
        with torch.no_grad(), adapted.routing("train", torch.ones(1, 6, dtype=torch.int64)):
            logits = model(input_ids=ids, cache=cache, use_cache=True).logits
        assert cache.get_seq_length() == 6
        outputs.append(logits)
    torch.testing.assert_close(outputs[0], outputs[1])
    assert not model.training  # only the decoder layers were switched, and back


def test_recompute_refuses_a_model_without_decoder_layers():
    with pytest.raises(ValueError, match="does not support activation recompute"):
        set_recompute(torch.nn.Linear(2, 2), RoutingScope(), True)


QWEN3_1_7B = DecoderShape(
    hidden=2048, intermediate=6144, layers=28, heads=16, kv_heads=8, head_dim=128, vocab=151936
)


def test_activation_bytes_per_token_from_given_shapes():
    layer = layer_bytes_per_token(QWEN3_1_7B, 2)
    # bf16: 6 * 2048 + (2 * 16 + 3 * 8) * 128 + 4 * 6144 = 44032 values; fp32 LoRA inputs:
    # 3 * 2048 + 16 * 128 + 6144 = 14336 values.
    assert layer == 2 * 44032 + 4 * 14336
    assert layer_bytes_per_token(QWEN3_1_7B, 2, lora=False) == 2 * 44032
    head = 151936 * 4 * 3 + 2048 * 2  # three fp32 vocabulary-wide tensors at the head
    assert activation_bytes_per_token(QWEN3_1_7B, 2) == 28 * layer + head
    assert activation_bytes_per_token(QWEN3_1_7B, 2, recompute=True) == 28 * 2048 * 2 + layer + head
    assert activation_bytes_per_token(QWEN3_1_7B, 4) > activation_bytes_per_token(QWEN3_1_7B, 2)
    with pytest.raises(ValueError, match="dtype_bytes must be 2"):
        activation_bytes_per_token(QWEN3_1_7B, 1)


def test_the_head_term_covers_its_backward_peak():
    """The head's backward starts with three fp32 [tokens, vocab] tensors alive: the saved
    log-softmax, its gradient and the logits' gradient (about 12 bytes per vocabulary entry,
    measured in bf16 and fp32). Counting only the forward's bf16 logits and fp32 log-softmax
    (6 bytes) sized recompute budgets 1.6x past free memory, since there the head dominates."""
    for dtype_bytes in (2, 4):
        inputs = QWEN3_1_7B.layers * QWEN3_1_7B.hidden * dtype_bytes
        layer = layer_bytes_per_token(QWEN3_1_7B, dtype_bytes)
        per_token = activation_bytes_per_token(QWEN3_1_7B, dtype_bytes, recompute=True)
        assert per_token - inputs - layer >= 3 * 4 * QWEN3_1_7B.vocab


def test_token_budget_from_free_memory():
    per_token = activation_bytes_per_token(QWEN3_1_7B, 2)
    free = 130 * 2**30
    budget = token_budget_for_memory(free, per_token)
    assert budget == int(free * 0.75) // per_token
    # The training call (8 adapters x 4 x 512 tokens) fits one micro-batch on an H200.
    assert budget >= 8 * 4 * 512
    recomputed = token_budget_for_memory(
        free, activation_bytes_per_token(QWEN3_1_7B, 2, recompute=True)
    )
    assert recomputed > 2 * budget
    assert token_budget_for_memory(free, per_token, maximum=4096) == 4096
    assert token_budget_for_memory(1000, 10, headroom=0.5) == 50
    with pytest.raises(ValueError, match="fewer than the minimum 64"):
        token_budget_for_memory(2**30, per_token, minimum=64, headroom=0.05)
    with pytest.raises(ValueError, match="headroom must be in"):
        token_budget_for_memory(free, per_token, headroom=0)
    with pytest.raises(ValueError, match="per_token_bytes > 0"):
        token_budget_for_memory(free, 0)
    with pytest.raises(ValueError, match="minimum <= maximum"):
        token_budget_for_memory(free, per_token, minimum=10, maximum=5)


def test_decoder_shape_from_a_config():
    config = tiny_qwen3().config
    shape = DecoderShape.from_config(config)
    assert shape == DecoderShape(
        hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=96
    )
