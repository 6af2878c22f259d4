"""Batch-invariant numerics (model/numerics.py): in bf16, a tenant's log-probs and gradient do
not depend on which other tenants share its batches, and the sampler agrees with the trainer.

The partners' datums are longer than 48 tokens on purpose: from a padded key length of 48 on,
PyTorch's CPU SDPA takes another path, which is what moved a row's bf16 log-probs by up to
0.25 nats before (bench/invariance.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lorafleet.engines import colocate
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.numerics import (
    INVARIANT_ATTENTION,
    apply_numerics,
    invariant_attention,
    invariant_linear,
    model_numerics,
    parse_numerics,
)
from lorafleet.sample import SampleRequest, SamplingParams
from lorafleet.train.items import TrainItem
from tests._models import tiny_llama, tiny_qwen3

BF16_BOUND = 1e-3  # the bound on solo-vs-shared |delta log-prob| in bf16


def _stack(model: torch.nn.Module, numerics: str):
    from lorafleet.model.targets import resolve_tinker_targets

    stack = colocate(
        model.to(torch.bfloat16),
        resolve_tinker_targets(model, train_unembed=False),
        base_model_id="tiny",
        train_slots=4,
        sample_slots=4,
        r_max=4,
        max_rows=8,
        numerics=parse_numerics(numerics),
    )
    keys, slots = [], []
    for i in range(4):
        slot = stack.trainer.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=i))
        gen = torch.Generator().manual_seed(100 + i)
        weights = {
            path: (A, 0.1 * torch.randn(B.shape, generator=gen))
            for path, (A, B) in stack.trainer.bank.slot_weights(slot).items()
        }
        stack.trainer.bank.load_slot_weights(slot, weights)
        keys.append(stack.versions.publish(f"a{i}", stack.trainer.bank, slot))
        slots.append(slot)
    return stack, keys, slots


def _tokens(seed: int, n: int, vocab: int) -> torch.Tensor:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _datum(slot: int, tokens: torch.Tensor) -> TrainItem:
    n = tokens.numel() - 1
    return TrainItem(
        slot, tokens[:-1], "cross_entropy", {"target_tokens": tokens[1:], "weights": torch.ones(n)}
    )


@pytest.fixture(scope="module")
def invariant(one_torch_thread):
    model = tiny_qwen3(seed=3, vocab=96)
    return (*_stack(model, "batch-invariant"), 96)


def test_bf16_training_shared_equals_alone(invariant) -> None:
    stack, _, slots, vocab = invariant
    prefix = _tokens(1, 20, vocab)  # two datums sharing a prefix: the second-forward path too
    own = [
        _datum(slots[0], torch.cat([prefix, _tokens(2, 12, vocab)])),
        _datum(slots[0], torch.cat([prefix, _tokens(3, 25, vocab)])),
    ]
    partners = [
        _datum(slots[1 + i % 3], _tokens(10 + i, n, vocab)) for i, n in enumerate((90, 33, 130))
    ]
    grads = stack.trainer.bank.grads

    def run(items: list[TrainItem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        forward = stack.trainer.forward(items)
        grads.zero_()
        out = stack.trainer.forward_backward(items)
        grad = grads[slots[0]].clone()
        grads.zero_()
        lp = lambda o: torch.cat([i.logprobs.reshape(-1) for i in o.items[:2]])  # noqa: E731
        return lp(forward), lp(out), grad

    solo_fwd, solo_bwd, solo_grad = run(own)
    for k in (1, 3):
        fwd, bwd, grad = run(own + partners[:k])
        assert (fwd - solo_fwd).abs().max().item() <= BF16_BOUND
        assert (bwd - solo_bwd).abs().max().item() <= BF16_BOUND
        assert F.cosine_similarity(grad.double(), solo_grad.double(), dim=0).item() >= 0.9999


def test_bf16_sampling_shared_equals_alone_and_matches_trainer(invariant) -> None:
    stack, keys, slots, vocab = invariant
    prompt = _tokens(5, 30, vocab).tolist()

    def sample(partners: int):
        own = SampleRequest(
            prompt,
            SamplingParams(max_tokens=12, temperature=1.0, seed=3, stop=[]),
            adapter=keys[0],
            prompt_logprobs=True,
        )
        others = [
            SampleRequest(
                _tokens(20 + i, n, vocab).tolist(),
                SamplingParams(max_tokens=6 + 3 * i, temperature=1.0, seed=i, stop=[]),
                adapter=keys[1 + i],
            )
            for i, n in enumerate((70, 9, 120)[:partners])
        ]
        results = stack.sampler.generate([*others, own])
        assert all(r.ok for r in results)
        return results[-1]

    solo = sample(0)
    for k in (1, 3):
        shared = sample(k)
        assert shared.sequences[0].tokens == solo.sequences[0].tokens
        decode = torch.tensor(shared.sequences[0].logprobs) - torch.tensor(
            solo.sequences[0].logprobs
        )
        assert decode.abs().max().item() <= BF16_BOUND
        prefill = torch.tensor(shared.prompt_logprobs[1:]) - torch.tensor(solo.prompt_logprobs[1:])
        assert prefill.abs().max().item() <= BF16_BOUND
    # the trainer scores the same tokens as the sampler drew them (decode) and prefilled them
    full = torch.tensor(prompt + solo.sequences[0].tokens)
    trainer = stack.trainer.forward([_datum(slots[0], full)]).items[0].logprobs.reshape(-1)
    sampled = torch.tensor(solo.prompt_logprobs[1:] + solo.sequences[0].logprobs)
    assert (trainer - sampled).abs().max().item() <= BF16_BOUND


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_invariant_path_computes_the_same_model(
    dtype: torch.dtype, tol: float, one_torch_thread
) -> None:
    """Not only invariant but right: the same logits as the stock kernels, within the dtype's
    rounding, with padding (a 2-D mask) and without; and switching back restores the stock path."""
    model = tiny_llama(seed=1).to(dtype)
    ids = torch.randint(1, 90, (3, 70), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0
    mask[2, 9:] = 0
    with torch.no_grad():
        stock = model(input_ids=ids, attention_mask=mask).logits.float()
        apply_numerics(model, "batch-invariant")
        assert model.config._attn_implementation == INVARIANT_ATTENTION
        assert model_numerics(model) == "batch-invariant"
        mine = model(input_ids=ids, attention_mask=mask).logits.float()
        apply_numerics(model, "fast")
        assert model.config._attn_implementation == "sdpa"
        assert model_numerics(model) == "fast"
        again = model(input_ids=ids, attention_mask=mask).logits.float()
    real = mask.bool()
    assert (mine - stock)[real].abs().max().item() <= tol * max(1.0, stock[real].abs().max().item())
    assert torch.equal(again, stock)


def test_invariant_attention_handles_gaps_single_queries_and_empty_rows() -> None:
    """Key columns a row may not see sit between its own (the prefix-sharing second forward);
    a lone query (decode); a padding query that sees nothing gives zeros, not NaN."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 8, generator=gen)
    k = torch.randn(2, 2, 100, 8, generator=gen)
    v = torch.randn(2, 2, 100, 8, generator=gen)
    allowed = torch.zeros(2, 1, 3, 100, dtype=torch.bool)
    allowed[0, :, :, :30] = True  # row 0: a 30-key prefix, a gap, then its own 3 keys
    for t in range(3):
        allowed[0, :, t, 97 : 98 + t] = True
    allowed[1, :, :2, :70] = True  # row 1: its last query is padding (sees nothing)
    module = torch.nn.Module()
    out, _ = invariant_attention(module, q, k, v, allowed, scaling=0.5)
    ref = F.scaled_dot_product_attention(
        q[:1],
        k[:1].repeat_interleave(2, 1),
        v[:1].repeat_interleave(2, 1),
        attn_mask=allowed[:1],
        scale=0.5,
    ).transpose(1, 2)
    assert torch.allclose(out[:1], ref, atol=1e-5)
    assert torch.equal(out[1, 2], torch.zeros_like(out[1, 2]))
    single, _ = invariant_attention(module, q[:, :, :1], k, v, allowed[:, :, :1], scaling=0.5)
    assert torch.equal(single[:, 0], out[:, 0])  # one query alone = that query among three


def test_invariant_linear_rows_do_not_depend_on_their_partners() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 24, generator=gen).bfloat16()
    bias = torch.randn(40, generator=gen).bfloat16()
    x = torch.randn(150, 24, generator=gen).bfloat16()
    full = invariant_linear(x, weight, bias)
    assert full.shape == (150, 40)
    for rows in (1, 7, 64, 65, 149):
        assert torch.equal(invariant_linear(x[:rows], weight, bias), full[:rows])
    assert torch.allclose(full.float(), F.linear(x, weight, bias).float(), rtol=1e-2, atol=1e-2)


def test_parse_numerics_names_the_value() -> None:
    assert parse_numerics("fast") == "fast"
    with pytest.raises(
        ValueError, match=r"numerics must be one of batch-invariant, fast; got 'exact'"
    ):
        parse_numerics("exact")
