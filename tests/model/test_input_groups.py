"""Layers fed the same input share one A-projection; sorted and uniform batches take the
slice / batched-matmul paths. Every variant must give the values and gradients of the plain
per-layer computation."""

from __future__ import annotations

import pytest
import torch

from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.routing import build_routing
from lorafleet.model.targets import resolve_tinker_targets
from tests._models import tiny_llama, tiny_qwen3

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPECS = [
    AdapterSpec(rank=4, alpha=8.0, seed=1),
    AdapterSpec(rank=8, alpha=8.0, seed=2),
    AdapterSpec(rank=2, alpha=4.0, seed=3),
]


def _build(model_fn, *, share_inputs: bool, kernel: str = "auto"):
    torch.manual_seed(0)
    model = model_fn()
    adapted = AdaptedModel(
        model, resolve_tinker_targets(model), share_inputs=share_inputs, kernel=kernel
    )
    bank = adapted.add_bank("train", num_slots=5, r_max=8)
    gen = torch.Generator().manual_seed(7)
    for spec in SPECS:
        slot = bank.allocate(spec)
        weights = {
            path: (
                torch.randn(A.shape, generator=gen) * 0.3,
                torch.randn(B.shape, generator=gen) * 0.3,
            )
            for path, (A, B) in bank.slot_weights(slot).items()
        }
        bank.load_slot_weights(slot, weights)
    return adapted, bank


def _run(adapted, bank, slot_ids: torch.Tensor):
    input_ids = torch.randint(
        0, 96, tuple(slot_ids.shape), generator=torch.Generator().manual_seed(5)
    )
    bank.grads.zero_()
    with adapted.routing("train", slot_ids) as routing:
        logits = adapted.model(input_ids).logits
    weights = torch.linspace(-1, 1, logits.shape[-1])
    (logits * weights).sum().backward()
    return logits.detach(), bank.grads.clone(), routing


def test_probe_finds_attention_and_mlp_siblings():
    adapted, _ = _build(tiny_llama, share_inputs=True)
    groups = [sorted(p.rsplit(".", 1)[1] for p in group) for group in adapted.input_groups]
    assert ["k_proj", "q_proj", "v_proj"] in groups
    assert ["gate_proj", "up_proj"] in groups
    # o_proj and down_proj get their own inputs: never grouped.
    assert not any(
        "o_proj" in p or "down_proj" in p for group in adapted.input_groups for p in group
    )
    assert AdaptedModel(tiny_llama(), ["model.layers.0.self_attn.q_proj"]).input_groups == []


def test_shared_layout_only_reorders_the_row():
    """Same adapters, same layer-free weights, whatever the layout."""
    _shared, shared_bank = _build(tiny_qwen3, share_inputs=True)
    _plain, plain_bank = _build(tiny_qwen3, share_inputs=False)
    assert shared_bank.layout() != plain_bank.layout()
    for slot in range(1, len(SPECS) + 1):
        a, b = shared_bank.slot_weights(slot), plain_bank.slot_weights(slot)
        for path in a:
            torch.testing.assert_close(a[path][0], b[path][0], rtol=0, atol=0)
            torch.testing.assert_close(a[path][1], b[path][1], rtol=0, atol=0)


@pytest.mark.parametrize(
    "slot_ids",
    [
        # unsorted, uneven, with base tokens: gather/scatter + grouped_mm
        torch.tensor([[1, 1, 2, 0, 3, 3], [2, 0, 0, 1, 3, 2], [3, 3, 3, 3, 1, 1]]),
        # sorted with base rows first: slice path, uneven counts
        torch.tensor([[0] * 6, [1] * 6, [2] * 6, [2] * 6]),
        # sorted, every slot the same count: slice + batched matmul
        torch.tensor([[1] * 4, [2] * 4, [3] * 4]),
        # unsorted but uniform counts: gather + batched matmul
        torch.tensor([[3] * 4, [1] * 4, [2] * 4]),
    ],
    ids=["unsorted-uneven", "sorted-uneven", "sorted-uniform", "unsorted-uniform"],
)
@pytest.mark.parametrize("kernel", ["auto", "loop"])
def test_shared_projection_equals_plain_layers(slot_ids, kernel):
    shared, shared_bank = _build(tiny_qwen3, share_inputs=True, kernel=kernel)
    plain, plain_bank = _build(tiny_qwen3, share_inputs=False, kernel="loop")
    logits_s, grads_s, routing = _run(shared, shared_bank, slot_ids)
    logits_p, grads_p, _ = _run(plain, plain_bank, slot_ids)
    # fp32, different summation order (grouped vs per-slot matmuls): relative to the scale
    scale = float(logits_p.abs().max())
    torch.testing.assert_close(logits_s, logits_p, rtol=1e-5, atol=1e-5 * scale)
    gscale = float(grads_p.abs().max())
    for slot in range(1, len(SPECS) + 1):
        got = shared_bank.split_row(
            grads_s[slot], SPECS[slot - 1].rank, shared_bank.slots[slot].targets
        )
        want = plain_bank.split_row(
            grads_p[slot], SPECS[slot - 1].rank, plain_bank.slots[slot].targets
        )
        for path in got:
            for g, w in zip(got[path], want[path], strict=True):
                torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4 * gscale)
    # the case labels above hold
    flat = slot_ids.reshape(-1)
    assert (routing.sorted_from is not None) == bool((flat[1:] >= flat[:-1]).all())


def test_uniform_count_and_sorted_suffix_are_detected():
    scales = torch.ones(5)
    routing = build_routing(torch.tensor([0, 0, 1, 1, 2, 2]), scales, bank="b")
    assert routing.sorted_from == 2 and routing.uniform_count == 2
    routing = build_routing(
        torch.tensor([1, 1, 3, 3]), scales, bank="b"
    )  # slot 2 empty in the span
    assert routing.uniform_count is None
    routing = build_routing(torch.tensor([2, 1, 0]), scales, bank="b")
    assert routing.sorted_from is None and routing.uniform_count == 1


def test_sibling_fed_another_tensor_computes_its_own_projection():
    """The share is keyed by tensor identity: a layer given a different input (here a copy
    with other values) must not reuse its sibling's projection."""
    shared, _bank = _build(tiny_qwen3, share_inputs=True)
    plain, _plain_bank = _build(tiny_qwen3, share_inputs=False)
    attn_s = shared.model.model.layers[0].self_attn
    attn_p = plain.model.model.layers[0].self_attn
    x = torch.randn(2, 3, attn_s.q_proj.in_features)
    other = x * 2.0
    slot_ids = torch.tensor([[1, 1, 1], [2, 2, 2]])
    with torch.no_grad():
        outs = []
        for adapted, attn in ((shared, attn_s), (plain, attn_p)):
            with adapted.routing("train", slot_ids):
                outs.append((attn.q_proj(x), attn.k_proj(other), attn.v_proj(x)))
    for got, want in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
