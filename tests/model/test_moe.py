"""MoE expert LoRA: structure detection, mixed-adapter parity with a per-token per-expert loop,
mixed training steps, and bank plumbing (checkpoints, slot copy) on the tiny-qwen3-moe preset."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.experts import (
    ExpertProjection,
    LoRAExperts,
    experts_layout,
    fused_expert_params,
)
from lorafleet.model.loader import load_base
from lorafleet.model.targets import (
    TargetError,
    linear_layers,
    resolve_target_parameters,
    resolve_tinker_targets,
)
from lorafleet.train.checkpointing import restore_training_state, save_training_state
from lorafleet.train.engine import TrainEngine, TrainItem
from lorafleet.train.optim import AdamHParams

PRESET = "tiny-qwen3-moe"
EXPERTS = 4
DEAD = EXPERTS - 1  # the router hook below never picks it
VOCAB = 512


def _model() -> nn.Module:
    return load_base(PRESET).model


def _kill_last_expert(model: nn.Module) -> None:
    """Re-runs each router's top-k without its last expert, so that expert receives no token."""

    def hook(router, _inputs, output):
        logits = output[0]
        masked = logits.clone()
        masked[:, DEAD] = float("-inf")
        probs = torch.softmax(masked, dim=-1, dtype=torch.float32)
        top, index = torch.topk(probs, router.top_k, dim=-1)
        if router.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), index

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(hook)


def _per_expert(
    A: torch.Tensor, B: torch.Tensor, experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bank form (experts side by side: A[r, E*in], B[E*out, r]) -> A[E, r, in], B[E, out, r]."""
    return A.view(A.shape[0], experts, -1).transpose(0, 1), B.view(experts, -1, B.shape[1])


# ------------------------------------------------------------------------- the reference


class _RefLinear(nn.Module):
    """Per-token gathered LoRA (slow, obviously right): y_t = W x_t + s B[slot_t] A[slot_t] x_t."""

    def __init__(self, base: nn.Linear, A: torch.Tensor, B: torch.Tensor, scales, ctx):
        super().__init__()
        self.base, self.A, self.B, self.scales, self.ctx = base, A, B, scales, ctx

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        slots = self.ctx["slots"]
        hidden = torch.einsum("ni,nri->nr", flat, self.A[slots])
        delta = torch.einsum("nr,nor->no", hidden, self.B[slots]) * self.scales[slots, None]
        return (self.base(flat) + delta).view(*x.shape[:-1], -1)


class _RefExperts(nn.Module):
    """Token by token, expert by expert: each (token, expert) pair uses its token's adapter."""

    def __init__(self, base, lora, scales, ctx):
        super().__init__()
        self.base, self.lora, self.scales, self.ctx = base, lora, scales, ctx

    def forward(self, hidden, top_k_index, top_k_weights):
        slots = self.ctx["slots"]
        (A_gu, B_gu), (A_d, B_d) = self.lora["gate_up_proj"], self.lora["down_proj"]
        rows = []
        for t in range(hidden.shape[0]):
            s, x, total = int(slots[t]), hidden[t], 0
            for k in range(top_k_index.shape[1]):
                e = int(top_k_index[t, k])
                gu = self.base.gate_up_proj[e] @ x + self.scales[s] * (
                    B_gu[s, e] @ (A_gu[s, e] @ x)
                )
                gate, up = gu.chunk(2)
                h = self.base.act_fn(gate) * up
                out = self.base.down_proj[e] @ h + self.scales[s] * (B_d[s, e] @ (A_d[s, e] @ h))
                total = total + top_k_weights[t, k] * out
            rows.append(total)
        return torch.stack(rows)


def _reference(bank, slots_in_use: list[int]):
    """A fresh base whose targeted layers compute LoRA per token from leaf copies of the bank."""
    model = _model()
    _kill_last_expert(model)
    ctx: dict[str, torch.Tensor] = {}
    S = bank.num_slots
    leaves: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for path, layer in bank.layers.items():
        E = getattr(layer, "num_experts", 1)
        shape_a = (
            (S, E, bank.r_max, layer.in_features // E)
            if E > 1
            else (S, bank.r_max, layer.in_features)
        )
        shape_b = (
            (S, E, layer.out_features // E, bank.r_max)
            if E > 1
            else (S, layer.out_features, bank.r_max)
        )
        A, B = torch.zeros(shape_a), torch.zeros(shape_b)
        for slot in slots_in_use:
            info = bank.slots[slot]
            if path not in info.targets:
                continue
            a, b = bank.slot_weights(slot)[path]
            rank = info.spec.rank
            if E > 1:
                a, b = _per_expert(a, b, E)
                A[slot, :, :rank], B[slot, :, :, :rank] = a, b
            else:
                A[slot, :rank], B[slot, :, :rank] = a, b
        leaves[path] = (A.requires_grad_(), B.requires_grad_())
    scales = bank.scales.clone()
    experts_modules: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for path, (A, B) in leaves.items():
        module_path, _, leaf = path.rpartition(".")
        if leaf in ("gate_up_proj", "down_proj"):
            experts_modules.setdefault(module_path, {})[leaf] = (A, B)
            continue
        parent = model.get_submodule(module_path) if module_path else model
        setattr(parent, leaf, _RefLinear(getattr(parent, leaf), A, B, scales, ctx))
    for module_path, lora in experts_modules.items():
        parent_path, _, leaf = module_path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, leaf, _RefExperts(getattr(parent, leaf), lora, scales, ctx))
    return model, ctx, leaves


def _fill(bank, slot, seed):
    gen = torch.Generator().manual_seed(seed)
    bank.load_slot_weights(
        slot,
        {
            p: (
                torch.randn(A.shape, generator=gen) * 0.2,
                torch.randn(B.shape, generator=gen) * 0.2,
            )
            for p, (A, B) in bank.slot_weights(slot).items()
        },
    )


SPECS = [
    AdapterSpec(rank=4, alpha=8.0, seed=1),
    AdapterSpec(rank=8, alpha=4.0, use_rslora=True, seed=2),
    AdapterSpec(
        rank=2,
        alpha=3.0,
        seed=3,
        targets=("model.layers.1.mlp.experts.down_proj", "model.layers.0.self_attn.q_proj"),
    ),
]


# ------------------------------------------------------------------------------ structure


def test_preset_experts_are_found_from_structure_and_routers_stay_frozen():
    model = _model()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    params, unsupported = fused_expert_params(model)
    assert not unsupported
    assert sorted(params) == [
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("down_proj", "gate_up_proj")
    ]
    gate_up = params["model.layers.0.mlp.experts.gate_up_proj"]
    assert (gate_up.num_experts, gate_up.in_features, gate_up.out_features) == (EXPERTS, 64, 64)
    # the router (a 2-D weight) and the attention are no fused experts
    assert all(".experts." in p for p in params)
    down = params["model.layers.0.mlp.experts.down_proj"]
    assert (down.in_features, down.out_features) == (32, 64)
    targets = resolve_tinker_targets(model)
    assert set(params) <= set(targets)
    assert not any(".mlp.gate" in t for t in targets)  # the router is never a target
    assert resolve_tinker_targets(model, train_mlp=False, train_unembed=False) == tuple(
        sorted(p for p, i in linear_layers(model).items() if i.role == "attn")
    )
    assert resolve_target_parameters(model, ["mlp.experts.down_proj"]) == (
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.1.mlp.experts.down_proj",
    )
    with pytest.raises(TargetError, match="'mlp.experts.w9' matches no fused expert"):
        resolve_target_parameters(model, ["mlp.experts.w9"])

    adapted = AdaptedModel(model, targets)
    wrapper = model.model.layers[0].mlp.experts
    assert isinstance(wrapper, LoRAExperts) and sorted(wrapper.projections) == [
        "down_proj",
        "gate_up_proj",
    ]
    projection = adapted.layers["model.layers.0.mlp.experts.gate_up_proj"]
    assert isinstance(projection, ExpertProjection)
    assert (projection.in_features, projection.out_features) == (EXPERTS * 64, EXPERTS * 64)
    assert not isinstance(model.model.layers[0].mlp.gate, LoRAExperts)
    assert all(not p.requires_grad for p in model.parameters())
    # Re-resolving on the wrapped model gives the same targets; wrapping twice is refused.
    assert resolve_tinker_targets(model) == targets
    with pytest.raises(TargetError, match="already carries adapter banks"):
        AdaptedModel(model, ["model.layers.0.mlp.experts.down_proj"])


def test_detection_does_not_depend_on_names_and_refuses_unknown_expert_modules():
    from transformers.integrations import use_experts_implementation

    @use_experts_implementation
    class Bag(nn.Module):  # a name no list could contain
        def __init__(self, config):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(3, 16, 8))
            self.down_proj = nn.Parameter(torch.randn(3, 8, 8))
            self.act_fn = nn.SiLU()

        def forward(self, hidden, top_k_index, top_k_weights):
            raise AssertionError("replaced by LoRAExperts")

    class Config:
        _experts_implementation = "eager"

    layout = experts_layout(Bag(Config()))
    assert layout is not None and (layout.num_experts, layout.hidden, layout.intermediate) == (
        3,
        8,
        8,
    )

    class Opaque(nn.Module):  # fused experts, but no experts interface to reproduce
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(3, 16, 8))
            self.w2 = nn.Parameter(torch.randn(3, 8, 8))

        def forward(self, hidden, index, weights):
            return hidden

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Module()
            self.mlp.experts = Opaque()
            self.mlp.up = nn.Linear(8, 8)

    with pytest.raises(
        TargetError, match="experts cannot carry LoRA.*not through transformers' experts interface"
    ):
        resolve_tinker_targets(Holder(), train_unembed=False)


def test_shared_experts_get_dense_banks_and_their_gate_stays_frozen():
    config = Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
    )
    model = Qwen2MoeForCausalLM(config)
    targets = resolve_tinker_targets(model, train_attn=False, train_unembed=False)
    assert targets == (
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.shared_expert.down_proj",
        "model.layers.0.mlp.shared_expert.gate_proj",
        "model.layers.0.mlp.shared_expert.up_proj",
    )


# -------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("kernel", ["grouped", "loop"])
def test_mixed_batch_matches_per_token_per_expert_reference(kernel, one_torch_thread):
    model = _model()
    _kill_last_expert(model)
    adapted = AdaptedModel(model, resolve_tinker_targets(model), kernel=kernel)
    bank = adapted.add_bank("train", num_slots=6, r_max=8)
    slots = [bank.allocate(spec) for spec in SPECS]
    for i, slot in enumerate(slots):
        _fill(bank, slot, 100 + i)
    # Unsorted rows, a base-model row, an adapter on two rows.
    row_slots = [slots[1], 0, slots[0], slots[2], slots[0]]
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (len(row_slots), 6), generator=gen)
    probe = torch.randn(len(row_slots), 6, VOCAB, generator=gen)
    slot_ids = bank.slot_ids_for_rows(row_slots, ids.shape[1])

    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    with adapted.routing("train", slot_ids):
        ours = model(inputs_embeds=embeds).logits
    (ours * probe).sum().backward()

    ref_model, ctx, leaves = _reference(bank, slots)
    ctx["slots"] = slot_ids.reshape(-1)
    ref_embeds = embeds.detach().clone().requires_grad_()
    theirs = ref_model(inputs_embeds=ref_embeds).logits
    (theirs * probe).sum().backward()

    effect = float((theirs[0].detach() - ref_model_base_logits(ids[:1])).abs().max())
    assert effect > 0.1, "the adapters had no visible effect"
    # fp32 both sides; measured: logits 9e-6 abs, gradients <= 2e-6 of their max (the fp32
    # reference itself is 2e-6 off an fp64 run). A mis-ordered row would be O(1) off.
    _assert_near(ours, theirs, "logits")
    _assert_near(embeds.grad, ref_embeds.grad, "input gradient")

    for slot in slots:
        info = bank.slots[slot]
        rank = info.spec.rank
        grads = bank.split_row(bank.grads[slot], rank, info.targets)
        for path in info.targets:
            gA, gB = grads[path]
            A, B = leaves[path]
            E = getattr(bank.layers[path], "num_experts", 1)
            if E > 1:
                gA, gB = _per_expert(gA, gB, E)
                want_A, want_B = A.grad[slot, :, :rank], B.grad[slot, :, :, :rank]
                # An expert that received no token: exactly zero gradient, like the reference.
                assert not gA[DEAD].any() and not gB[DEAD].any()
                assert gB[:DEAD].abs().sum() > 0
            else:
                want_A, want_B = A.grad[slot, :rank], B.grad[slot, :, :rank]
            _assert_near(gA, want_A, f"{path} A, slot {slot}")
            _assert_near(gB, want_B, f"{path} B, slot {slot}")
        # Outside its targets and rank an adapter's gradient row stays exactly zero.
        residual = bank.grads[slot].clone()
        for gA, gB in bank.split_row(residual, rank, info.targets).values():
            gA.zero_()
            gB.zero_()
        assert not residual.any()
    assert not bank.grads[0].any()


def _assert_near(ours: torch.Tensor, theirs: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    """Max abs difference within `tol` of the reference's largest magnitude (fp32 noise grows
    with the magnitude; a wrong row or expert would be off by the magnitude itself)."""
    assert ours.shape == theirs.shape, what
    ours, theirs = ours.detach(), theirs.detach()
    scale = float(theirs.abs().max())
    err = float((ours - theirs).abs().max())
    assert err <= tol * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def ref_model_base_logits(ids):
    model = _model()
    _kill_last_expert(model)
    with torch.no_grad():
        return model(ids).logits[0]


def test_base_rows_equal_the_unwrapped_model_and_bf16_runs(one_torch_thread):
    ids = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = _model()(ids).logits
    model = _model()
    adapted = AdaptedModel(model, resolve_tinker_targets(model))
    bank = adapted.add_bank("train", num_slots=3, r_max=4)
    slot = bank.allocate(AdapterSpec(rank=4, alpha=8.0))
    _fill(bank, slot, 5)
    with torch.no_grad(), adapted.routing("train", bank.slot_ids_for_rows([0, slot, 0], 5)):
        ours = model(ids).logits
    torch.testing.assert_close(ours[0::2], plain[0::2], rtol=0, atol=1e-6)
    assert (ours[1] - plain[1]).abs().max() > 0.1

    # bf16 (the random router's near-ties flip between dtypes, so compare within bf16):
    # base rows are the plain bf16 model's, and the grouped kernel agrees with the loop.
    with torch.no_grad():
        plain16 = load_base(PRESET, torch.bfloat16).model(ids).logits
    model16 = load_base(PRESET, torch.bfloat16).model
    adapted16 = AdaptedModel(model16, resolve_tinker_targets(model16))
    bank16 = adapted16.add_bank("train", num_slots=3, r_max=4)
    bank16.allocate(AdapterSpec(rank=4, alpha=8.0))
    bank16.load_slot_weights(slot, bank.slot_weights(slot))
    runs = {}
    for kernel in ("grouped", "loop"):
        adapted16.set_kernel(kernel)
        with torch.no_grad(), adapted16.routing("train", bank16.slot_ids_for_rows([0, slot, 0], 5)):
            runs[kernel] = model16(ids).logits.float()
    assert torch.equal(runs["grouped"][0::2], plain16[0::2].float())
    assert (
        torch.isfinite(runs["grouped"]).all()
        and (runs["grouped"][1] - plain16[1].float()).abs().max() > 0.1
    )
    torch.testing.assert_close(runs["grouped"], runs["loop"], rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------- train


def _sft(slot: int, seed: int, length: int) -> TrainItem:
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (length + 1,), generator=gen)
    weights = (torch.rand(length, generator=gen) > 0.2).float()
    return TrainItem(
        slot, seq[:-1], "cross_entropy", {"target_tokens": seq[1:], "weights": weights}
    )


def _items(index: int, slot: int, step: int) -> list[TrainItem]:
    return [_sft(slot, 1000 * index + 10 * step + j, length=4 + index + j) for j in range(2)]


HPARAMS = [
    AdamHParams(learning_rate=1e-2),
    AdamHParams(learning_rate=3e-3, weight_decay=0.1),
    AdamHParams(learning_rate=2e-2, grad_clip_norm=0.5),
]


def test_mixed_step_over_three_adapters_equals_training_each_alone(one_torch_thread):
    model = _model()
    adapted = AdaptedModel(model, resolve_tinker_targets(model))
    adapted.add_bank("mixed", num_slots=4, r_max=8)
    adapted.add_bank("alone", num_slots=4, r_max=8)
    mixed = TrainEngine(adapted, bank="mixed", base_model_id=PRESET)
    alone = TrainEngine(adapted, bank="alone", base_model_id=PRESET)
    slots = [mixed.create_adapter(spec) for spec in SPECS]
    for step in range(2):
        mixed.forward_backward(
            [item for i, slot in enumerate(slots) for item in _items(i, slot, step)]
        )
        mixed.optim_step(dict(zip(slots, HPARAMS, strict=True)))
    for i, spec in enumerate(SPECS):
        slot = alone.create_adapter(spec, slot=3 - i)  # another slot: placement must not matter
        for step in range(2):
            alone.forward_backward(_items(i, slot, step))
            alone.optim_step({slot: HPARAMS[i]})
        ours, theirs = mixed.bank.slot_weights(slots[i]), alone.bank.slot_weights(slot)
        moved = 0.0
        for path, (A, B) in ours.items():
            torch.testing.assert_close(
                A, theirs[path][0], atol=2e-6, rtol=1e-5, msg=f"adapter {i} {path} A"
            )
            torch.testing.assert_close(
                B, theirs[path][1], atol=2e-6, rtol=1e-5, msg=f"adapter {i} {path} B"
            )
            if "experts" in path:
                moved += float(B.abs().sum())
        assert moved > 0, f"adapter {i}'s experts did not train"
        alone.free_adapter(slot)


def test_expert_lora_checkpoints_and_slot_copies_like_dense(tmp_path, one_torch_thread):
    model = _model()
    adapted = AdaptedModel(model, resolve_tinker_targets(model))
    adapted.add_bank("train", num_slots=3, r_max=8)
    sampler = adapted.add_bank("sample", num_slots=3, r_max=8, trainable=False)
    engine = TrainEngine(adapted, base_model_id=PRESET)
    slot = engine.create_adapter(SPECS[0])
    engine.forward_backward(_items(0, slot, 0))
    engine.optim_step({slot: HPARAMS[0]})
    engine.forward_backward(_items(0, slot, 1))
    engine.optim_step({slot: HPARAMS[0]})
    out = save_training_state(
        tmp_path / "ckpt",
        bank=engine.bank,
        slot=slot,
        optimizer=engine.optimizer,
        base_model_id=PRESET,
        hparams=HPARAMS[0],
    )
    restored = restore_training_state(
        out, bank=engine.bank, optimizer=engine.optimizer, base_model_id=PRESET
    )
    assert torch.equal(engine.bank.params[restored], engine.bank.params[slot])
    sampler.copy_slot_from(engine.bank, slot, 1)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with adapted.routing("train", engine.bank.slot_ids_for_rows([slot], 6)):
            trained = model(ids).logits
        with adapted.routing("sample", sampler.slot_ids_for_rows([1], 6)):
            sampled = model(ids).logits
    assert torch.equal(trained, sampled)


def test_sampler_mixed_batch_equals_each_alone_and_matches_the_trainer(one_torch_thread):
    from lorafleet.engines import colocate
    from lorafleet.sample import SampleRequest, SamplingParams

    model = _model()
    stack = colocate(
        model,
        resolve_tinker_targets(model),
        base_model_id=PRESET,
        r_max=8,
        sample_slots=4,
        max_rows=8,
    )
    keys, slots = [], []
    for i, spec in enumerate(SPECS[:2]):
        slot = stack.trainer.create_adapter(spec)
        _fill(stack.trainer.bank, slot, 200 + i)
        slots.append(slot)
        keys.append(stack.versions.publish(f"moe-{i}", stack.trainer.bank, slot))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    prompts = [
        torch.randint(0, VOCAB, (4 + i,), generator=torch.Generator().manual_seed(i)).tolist()
        for i in range(3)
    ]
    requests = [
        SampleRequest(p, greedy, adapter=a) for p, a in zip(prompts, [*keys, None], strict=True)
    ]
    mixed = stack.sampler.generate(requests)
    for request, result in zip(requests, mixed, strict=True):
        (alone,) = stack.sampler.generate([request])
        assert result.ok and alone.ok and result.sequences[0].tokens == alone.sequences[0].tokens
    for slot, request, result in zip(slots, requests, mixed, strict=False):
        full = torch.tensor(request.prompt + result.sequences[0].tokens)
        item = TrainItem(
            slot,
            full[:-1],
            "cross_entropy",
            {"target_tokens": full[1:], "weights": torch.ones(len(full) - 1)},
        )
        trained = stack.trainer.forward([item]).items[0].logprobs
        torch.testing.assert_close(
            torch.tensor(result.sequences[0].logprobs),
            trained[len(request.prompt) - 1 :],
            atol=1e-4,
            rtol=0,
        )
