"""Adapter banks: mixed-adapter batches equal PEFT running each adapter alone."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

from lorafleet.model import kernels
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec, BankError, init_seed, kaiming_uniform_A
from lorafleet.model.routing import RoutingError
from lorafleet.model.targets import TargetError, resolve_target_modules, resolve_tinker_targets
from tests._models import tiny_llama, tiny_qwen3

SPECS = [
    AdapterSpec(rank=2, alpha=4.0, seed=11),
    AdapterSpec(rank=4, alpha=8.0, seed=12),
    AdapterSpec(rank=8, alpha=16.0, use_rslora=True, seed=13),
    AdapterSpec(rank=3, alpha=3.0, seed=14),
]
ROW_SLOTS = [1, 2, 0, 3, 4, 2, 1, 0]
SEQ = 9


def _random_weights(bank, slot, gen):
    weights = {}
    for path, (A, B) in bank.slot_weights(slot).items():
        weights[path] = (
            torch.randn(A.shape, generator=gen) * 0.3,
            torch.randn(B.shape, generator=gen) * 0.3,
        )
    return weights


def _build(model_fn, kernel="auto", dtype=torch.float32, targets=None):
    model = model_fn().to(dtype)
    paths = targets(model) if targets else resolve_tinker_targets(model)
    adapted = AdaptedModel(model, paths, kernel=kernel)
    bank = adapted.add_bank("train", num_slots=8, r_max=8)
    gen = torch.Generator().manual_seed(0)
    for spec in SPECS:
        slot = bank.allocate(spec)
        bank.load_slot_weights(slot, _random_weights(bank, slot, gen))
    return adapted, bank


def _peft_model(model_fn, spec, weights, dtype=torch.float32):
    base = model_fn().to(dtype)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        use_rslora=spec.use_rslora,
        target_modules=list(weights),
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    peft_model = get_peft_model(base, config)
    state = {}
    for path, (A, B) in weights.items():
        state[f"base_model.model.{path}.lora_A.default.weight"] = A.to(dtype)
        state[f"base_model.model.{path}.lora_B.default.weight"] = B.to(dtype)
    missing, unexpected = peft_model.load_state_dict(state, strict=False)
    assert not unexpected
    assert not [k for k in missing if "lora_" in k]
    return peft_model


def _assert_close_to_scale(actual, expected, tol):
    """fp32 agreement measured against the tensor's own scale (sums reorder across batches)."""
    scale = float(expected.abs().max())
    err = float((actual - expected).abs().max())
    assert err <= tol * max(scale, 1e-12), f"max error {err:.3g} vs scale {scale:.3g}"


def _row_loss_weights(vocab, dtype=torch.float32):
    gen = torch.Generator().manual_seed(5)
    return torch.randn(len(ROW_SLOTS), SEQ, vocab, generator=gen).to(dtype)


@pytest.mark.parametrize("model_fn", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama-tied-odd"])
def test_mixed_batch_matches_peft_per_adapter(model_fn):
    adapted, bank = _build(model_fn)
    vocab = adapted.model.config.vocab_size
    input_ids = torch.randint(
        0, vocab, (len(ROW_SLOTS), SEQ), generator=torch.Generator().manual_seed(1)
    )
    loss_w = _row_loss_weights(vocab)
    with adapted.routing("train", bank.slot_ids_for_rows(ROW_SLOTS, SEQ)):
        logits = adapted.model(input_ids).logits
    (logits * loss_w).sum().backward()

    base = model_fn()
    with torch.no_grad():
        base_logits = base(input_ids).logits
    rows0 = [i for i, s in enumerate(ROW_SLOTS) if s == 0]
    torch.testing.assert_close(logits[rows0], base_logits[rows0], atol=1e-5, rtol=1e-5)

    for slot, spec in enumerate(SPECS, start=1):
        rows = [i for i, s in enumerate(ROW_SLOTS) if s == slot]
        weights = bank.slot_weights(slot)
        peft_model = _peft_model(model_fn, spec, weights)
        peft_logits = peft_model(input_ids[rows]).logits
        effect = float((peft_logits - base_logits[rows]).detach().abs().max())
        assert effect > 0.05, "adapter had no effect"
        # fp32 differences from batching the rows differently, far below the adapter's effect.
        torch.testing.assert_close(
            logits[rows].detach(), peft_logits.detach(), atol=1e-3 * effect, rtol=1e-4
        )
        (peft_logits * loss_w[rows]).sum().backward()
        named = dict(peft_model.named_parameters())
        rank = spec.rank
        for path in weights:
            layer_bank = bank.layer_banks[path]
            gA = named[f"base_model.model.{path}.lora_A.default.weight"].grad
            gB = named[f"base_model.model.{path}.lora_B.default.weight"].grad
            _assert_close_to_scale(layer_bank.A.grad[slot, :rank], gA, 1e-3)
            _assert_close_to_scale(layer_bank.B.grad[slot, :, :rank], gB, 1e-3)
            # Beyond the adapter's rank nothing moves.
            assert layer_bank.A.grad[slot, rank:].abs().sum() == 0
            assert layer_bank.B.grad[slot, :, rank:].abs().sum() == 0
    assert bank.grads[0].abs().max() == 0
    assert bank.grads[5].abs().max() == 0  # never allocated


def test_unused_allocated_slot_gets_zero_gradient():
    adapted, bank = _build(tiny_qwen3)
    extra = bank.allocate(AdapterSpec(rank=4, alpha=4.0, seed=99))
    input_ids = torch.randint(0, 96, (3, 5))
    with adapted.routing("train", bank.slot_ids_for_rows([1, 0, 3], 5)):
        adapted.model(input_ids).logits.sum().backward()
    assert bank.grads[extra].abs().max() == 0
    assert bank.grads[2].abs().max() == 0 and bank.grads[4].abs().max() == 0
    assert bank.grads[1].abs().max() > 0 and bank.grads[3].abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_and_loop_kernels_agree_with_uneven_and_empty_groups(dtype):
    outputs = {}
    for kernel in ("grouped", "loop"):
        adapted, bank = _build(tiny_qwen3, kernel=kernel, dtype=dtype)
        gen = torch.Generator().manual_seed(3)
        input_ids = torch.randint(0, 96, (7, 6), generator=gen)
        # Per-token routing: slot 2 empty, slot 4 one token, others uneven.
        slot_ids = torch.tensor([1, 1, 1, 3, 3, 0] * 6 + [4] + [1] * 5, dtype=torch.int64).view(
            7, 6
        )
        with adapted.routing("train", slot_ids) as routing:
            assert routing.counts[1] == 0
            logits = adapted.model(input_ids).logits
        (logits.float() * _row_loss_weights(96)[:7, :6]).sum().backward()
        outputs[kernel] = (logits.detach().float(), bank.grads.clone())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(outputs["grouped"][0], outputs["loop"][0], atol=tol, rtol=tol)
    gtol = 1e-4 if dtype == torch.float32 else 5e-2
    g_grouped, g_loop = outputs["grouped"][1], outputs["loop"][1]
    scale = g_loop.abs().max()
    assert (g_grouped - g_loop).abs().max() <= gtol * scale
    assert g_grouped[2].abs().max() == 0


def test_grouped_kernel_runs_only_the_span_of_slots_with_tokens():
    """Leading and trailing idle slots are sliced away (a view); results equal the loop's."""
    outputs = {}
    for kernel in ("grouped", "loop"):
        adapted, bank = _build(tiny_qwen3, kernel=kernel)
        input_ids = torch.randint(0, 96, (3, 5), generator=torch.Generator().manual_seed(4))
        slot_ids = torch.tensor([[3] * 5, [0] * 5, [3, 3, 3, 0, 0]])
        with adapted.routing("train", slot_ids) as routing:
            assert (routing.first_active, routing.last_active) == (3, 3)
            logits = adapted.model(input_ids).logits
        logits.sum().backward()
        outputs[kernel] = (logits.detach(), bank.grads.clone())
    torch.testing.assert_close(outputs["grouped"][0], outputs["loop"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outputs["grouped"][1], outputs["loop"][1], atol=1e-5, rtol=1e-4)
    assert outputs["grouped"][1][3].abs().max() > 0
    assert outputs["grouped"][1][[1, 2, 4]].abs().max() == 0


def test_bf16_base_matches_peft_within_dtype_tolerance():
    """Our bf16 logits are at least as close to the fp32 truth as PEFT's own bf16 run is
    (the LoRA path runs in fp32, as PEFT's does with fp32 adapter weights)."""
    adapted, bank = _build(tiny_qwen3, dtype=torch.bfloat16)
    input_ids = torch.randint(
        0, 96, (len(ROW_SLOTS), SEQ), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad(), adapted.routing("train", bank.slot_ids_for_rows(ROW_SLOTS, SEQ)):
        logits = adapted.model(input_ids).logits.float()
    for slot, spec in enumerate(SPECS, start=1):
        rows = [i for i, s in enumerate(ROW_SLOTS) if s == slot]
        weights = bank.slot_weights(slot)
        with torch.no_grad():
            ref32 = _peft_model(tiny_qwen3, spec, weights)(input_ids[rows]).logits
            ref16 = _peft_model(tiny_qwen3, spec, weights, torch.bfloat16)(
                input_ids[rows]
            ).logits.float()
        scale = ref32.abs().max()
        ours_vs_truth = (logits[rows] - ref32).abs().max() / scale
        peft16_vs_truth = (ref16 - ref32).abs().max() / scale
        assert ours_vs_truth < 1.5 * peft16_vs_truth + 0.01, (
            f"slot {slot}: {ours_vs_truth:.3g} vs PEFT's {peft16_vs_truth:.3g}"
        )


def _tiny_llama_odd() -> torch.nn.Module:
    """tiny_llama with an MLP width of 70: in fp32 (the banks' dtype) 70 and the vocab's 90 are
    not multiples of 16 bytes, so down_proj's A, gate/up's B and the tied head's B break
    grouped_mm's stride rule; every other bank view (hidden 48, r_store 8) keeps it."""
    config = LlamaConfig(
        hidden_size=48,
        intermediate_size=70,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=90,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval()


def test_odd_shapes_fall_back_to_loop_kernel_automatically(monkeypatch):
    with pytest.raises(ValueError, match="kernel 'grouped' cannot run"):
        adapted, bank = _build(_tiny_llama_odd, kernel="grouped")
        with adapted.routing("train", bank.slot_ids_for_rows([1, 0], 4)):
            adapted.model(torch.zeros(2, 4, dtype=torch.long))

    ran: list[tuple[tuple[int, ...], str]] = []
    segment_matmul = kernels._segment_matmul

    def spy(xs, W, routing, impl):
        ran.append((tuple(W.shape[1:]), impl))
        return segment_matmul(xs, W, routing, impl)

    monkeypatch.setattr(kernels, "_segment_matmul", spy)
    adapted, bank = _build(_tiny_llama_odd)  # kernel "auto"
    input_ids = torch.randint(
        0, 90, (len(ROW_SLOTS), SEQ), generator=torch.Generator().manual_seed(1)
    )
    loss_w = _row_loss_weights(90)
    # With autograd on, the native CPU kernels never run: the torch kernels pick per shape.
    with adapted.routing("train", bank.slot_ids_for_rows(ROW_SLOTS, SEQ)):
        logits = adapted.model(input_ids).logits
    (logits * loss_w).sum().backward()

    odd = {70, 90}
    assert ran, "no LoRA matmul ran"
    for shape, impl in ran:
        assert impl == ("loop" if odd & set(shape) else "grouped"), (shape, impl)
    assert {impl for _, impl in ran} == {"loop", "grouped"}

    # The fallback computes what PEFT computes, values and gradients.
    odd_paths = [
        p for p, layer in bank.layers.items() if odd & {layer.in_features, layer.out_features}
    ]
    assert any("down_proj" in p for p in odd_paths) and any("lm_head" in p for p in odd_paths)
    for slot, spec in enumerate(SPECS, start=1):
        rows = [i for i, s in enumerate(ROW_SLOTS) if s == slot]
        peft_model = _peft_model(_tiny_llama_odd, spec, bank.slot_weights(slot))
        peft_logits = peft_model(input_ids[rows]).logits
        torch.testing.assert_close(
            logits[rows].detach(), peft_logits.detach(), atol=1e-4, rtol=1e-4
        )
        (peft_logits * loss_w[rows]).sum().backward()
        named = dict(peft_model.named_parameters())
        for path in odd_paths:
            layer_bank = bank.layer_banks[path]
            gA = named[f"base_model.model.{path}.lora_A.default.weight"].grad
            gB = named[f"base_model.model.{path}.lora_B.default.weight"].grad
            _assert_close_to_scale(layer_bank.A.grad[slot, : spec.rank], gA, 1e-3)
            _assert_close_to_scale(layer_bank.B.grad[slot, :, : spec.rank], gB, 1e-3)


def test_init_is_peft_like_deterministic_and_slot_independent():
    _adapted, bank = _build(tiny_qwen3)
    spec = AdapterSpec(rank=4, alpha=8.0, seed=7)
    a = bank.allocate(spec)
    bank.free(a)
    b = bank.allocate(AdapterSpec(rank=2, alpha=2.0))  # occupies the slot the first one had
    c = bank.allocate(spec)
    assert b == a and c != a
    weights = bank.slot_weights(c)
    path = "model.layers.0.self_attn.q_proj"
    A, B = weights[path]
    assert B.abs().max() == 0
    fan_in = A.shape[1]
    assert A.abs().max() <= 1 / math.sqrt(fan_in)
    torch.testing.assert_close(
        A, kaiming_uniform_A(4, fan_in, init_seed(7, path, "A")), atol=0, rtol=0
    )
    # A second model (another process, another slot) initialises the same adapter identically.
    _adapted2, bank2 = _build(tiny_qwen3)
    slot2 = bank2.allocate(spec, slot=7)
    assert slot2 != c
    for p, (A2, _) in bank2.slot_weights(slot2).items():
        torch.testing.assert_close(A2, weights[p][0], atol=0, rtol=0)


def test_target_resolution_peft_and_tinker():
    model = tiny_qwen3()
    all_linear = resolve_target_modules(model, "all-linear")
    assert "lm_head" not in all_linear and len(all_linear) == 14
    assert resolve_target_modules(model, ["q_proj", "v_proj"]) == (
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    )
    assert resolve_target_modules(model, r".*layers\.1\.mlp\.(up|down)_proj") == (
        "model.layers.1.mlp.down_proj",
        "model.layers.1.mlp.up_proj",
    )
    attn = resolve_tinker_targets(model, train_attn=True, train_mlp=False, train_unembed=False)
    assert len(attn) == 8 and all("self_attn" in p for p in attn)
    mlp = resolve_tinker_targets(model, train_attn=False, train_mlp=True, train_unembed=False)
    assert len(mlp) == 6 and all(".mlp." in p for p in mlp)
    assert resolve_tinker_targets(model, train_attn=False, train_mlp=False, train_unembed=True) == (
        "lm_head",
    )


def test_bad_configs_fail_with_clear_errors():
    model = tiny_qwen3()
    with pytest.raises(TargetError, match="'qq_proj'"):
        resolve_target_modules(model, ["q_proj", "qq_proj"])
    with pytest.raises(TargetError, match=r"nomatch\.\*"):
        resolve_target_modules(model, "nomatch.*")
    with pytest.raises(TargetError, match="all false"):
        resolve_tinker_targets(model, train_attn=False, train_mlp=False, train_unembed=False)
    adapted = AdaptedModel(model, resolve_tinker_targets(model))
    bank = adapted.add_bank("train", num_slots=3, r_max=8)
    with pytest.raises(BankError, match="rank 9 exceeds r_max 8"):
        bank.allocate(AdapterSpec(rank=9, alpha=1.0))
    with pytest.raises(BankError, match="alpha"):
        bank.allocate(AdapterSpec(rank=2, alpha=float("nan")))
    bank.allocate(AdapterSpec(rank=2, alpha=1.0))
    bank.allocate(AdapterSpec(rank=2, alpha=1.0))
    with pytest.raises(BankError, match="no free slot"):
        bank.allocate(AdapterSpec(rank=2, alpha=1.0))
    with pytest.raises(BankError, match="slot 7"):
        bank.free(7)
    bank.free(2)
    with pytest.raises(BankError, match="slot 2 .* not allocated"):
        bank.free(2)
    with pytest.raises(BankError, match="'nowhere'"):
        bank.allocate(AdapterSpec(rank=2, alpha=1.0, targets=("nowhere",)))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(RoutingError, match="float32"):
        adapted.make_routing("train", torch.zeros(1, 4, dtype=torch.float32))
    with pytest.raises(RoutingError, match="device meta"):
        adapted.make_routing("train", torch.zeros(1, 4, dtype=torch.long, device="meta"))
    with pytest.raises(RoutingError, match="slot 2, which holds no adapter"):
        adapted.make_routing("train", torch.full((1, 4), 2))
    with pytest.raises(RoutingError, match="slot id 5 is outside"):
        adapted.make_routing("train", torch.full((1, 4), 5))
    with pytest.raises(RoutingError, match="without a routing"):
        adapted.model(ids)
    with pytest.raises(BankError, match="no bank set named 'sample'"):
        adapted.make_routing("sample", ids)


def test_routing_token_count_mismatch_is_an_error():
    adapted, bank = _build(tiny_qwen3)
    slot_ids = bank.slot_ids_for_rows([1, 2], 5)
    with (
        pytest.raises(ValueError, match="routing covers 10 tokens"),
        adapted.routing("train", slot_ids),
    ):
        adapted.model(torch.zeros(2, 4, dtype=torch.long))


def test_two_bank_sets_share_the_base_and_stay_independent():
    adapted, train = _build(tiny_qwen3)
    sample = adapted.add_bank("sample", num_slots=3, r_max=8, trainable=False)
    sample.copy_slot_from(train, 3, 1)
    ids = torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        with adapted.routing("train", train.slot_ids_for_rows([3], 6)):
            train_logits = adapted.model(ids).logits
        with adapted.routing("sample", sample.slot_ids_for_rows([1], 6)):
            sample_logits = adapted.model(ids).logits
        torch.testing.assert_close(train_logits, sample_logits, atol=0, rtol=0)
        train.params[3].add_(0.1)  # training moves on; the published copy does not
        with adapted.routing("sample", sample.slot_ids_for_rows([1], 6)):
            again = adapted.model(ids).logits
    torch.testing.assert_close(again, sample_logits, atol=0, rtol=0)
    assert sample.grads is None and not sample.layer_banks["lm_head"].A.requires_grad
    assert all(not p.requires_grad for p in adapted.model.parameters())


def test_deepcopy_free_state_dict_names_are_the_base_ones():
    model = tiny_qwen3()
    names_before = set(copy.deepcopy(model).state_dict())
    adapted = AdaptedModel(model, resolve_tinker_targets(model))
    adapted.add_bank("train", num_slots=2, r_max=4)
    names_after = {k.replace(".base_layer", "") for k in adapted.model.state_dict()}
    assert names_after == names_before


def test_targets_resolve_the_same_after_wrapping_and_double_wrap_is_refused():
    model = tiny_qwen3()
    before = {
        flags: resolve_tinker_targets(
            model, train_attn=flags[0], train_mlp=flags[1], train_unembed=flags[2]
        )
        for flags in [
            (True, True, True),
            (True, False, False),
            (False, True, False),
            (False, False, True),
        ]
    }
    all_linear = resolve_target_modules(model, "all-linear")
    adapted = AdaptedModel(model, before[(True, True, True)])
    for flags, paths in before.items():
        assert (
            resolve_tinker_targets(
                model, train_attn=flags[0], train_mlp=flags[1], train_unembed=flags[2]
            )
            == paths
        )
    assert resolve_target_modules(model, "all-linear") == all_linear
    with pytest.raises(TargetError, match="already carries adapter banks"):
        AdaptedModel(adapted.model, ["lm_head"])
