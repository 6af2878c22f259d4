"""PEFT-format export/import: what we write PEFT loads as the same function, and back."""

from __future__ import annotations

import json
import shutil
import stat

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

from lorafleet.adapters.peft_io import PeftFormatError, export_peft, import_peft, read_peft
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec, BankError
from lorafleet.model.targets import resolve_tinker_targets
from tests._models import tiny_qwen3

SEQ = 7
BASE_ID = "tests/tiny-qwen3"

EXPORT_SPECS = {
    "plain": AdapterSpec(rank=4, alpha=8.0, seed=1),
    "rslora": AdapterSpec(rank=8, alpha=16.0, use_rslora=True, seed=2),
    "subset": AdapterSpec(
        rank=3,
        alpha=5.5,
        seed=3,
        targets=("model.layers.1.self_attn.v_proj", "model.layers.0.mlp.down_proj"),
    ),
    "lm_head": AdapterSpec(
        rank=2, alpha=2.0, seed=4, targets=("lm_head", "model.layers.0.self_attn.q_proj")
    ),
}


def _build(r_max=8, num_slots=6):
    model = tiny_qwen3()
    adapted = AdaptedModel(model, resolve_tinker_targets(model))
    return adapted, adapted.add_bank("train", num_slots=num_slots, r_max=r_max)


def _randomize(bank, slot, seed):
    gen = torch.Generator().manual_seed(seed)
    weights = {
        path: (torch.randn(A.shape, generator=gen) * 0.3, torch.randn(B.shape, generator=gen) * 0.3)
        for path, (A, B) in bank.slot_weights(slot).items()
    }
    bank.load_slot_weights(slot, weights)


def _ids(n=3, seed=1):
    return torch.randint(0, 96, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def _ours(adapted, bank, slot, ids):
    with (
        torch.no_grad(),
        adapted.routing("train", bank.slot_ids_for_rows([slot] * ids.shape[0], ids.shape[1])),
    ):
        return adapted.model(ids).logits


def _assert_same_function(ours, theirs, base):
    effect = float((theirs - base).abs().max())
    assert effect > 0.05, "adapter had no effect"
    torch.testing.assert_close(ours, theirs, atol=1e-4 * effect, rtol=1e-4)


def _bank_snapshot(bank):
    return [None if s is None else s.spec for s in bank.slots], bank.params.clone()


def _assert_unchanged(bank, snapshot):
    specs, params = snapshot
    assert [None if s is None else s.spec for s in bank.slots] == specs
    assert torch.equal(bank.params, params)


@pytest.mark.parametrize("name", list(EXPORT_SPECS))
def test_export_loads_in_peft_with_our_logits(tmp_path, name):
    adapted, bank = _build()
    filler = bank.allocate(AdapterSpec(rank=2, alpha=1.0))
    _randomize(bank, filler, 0)
    slot = bank.allocate(EXPORT_SPECS[name])
    _randomize(bank, slot, 10)
    out = export_peft(bank, slot, tmp_path / "adapter", base_model_name_or_path=BASE_ID)

    ids = _ids()
    ours = _ours(adapted, bank, slot, ids)
    with torch.no_grad():
        base = tiny_qwen3()(ids).logits
        peft_model = PeftModel.from_pretrained(tiny_qwen3(), out)
        theirs = peft_model(ids).logits
    _assert_same_function(ours, theirs, base)

    tensors = load_file(out / "adapter_model.safetensors")
    info = bank.slots[slot]
    assert set(tensors) == {
        f"base_model.model.{p}.lora_{w}.weight" for p in info.targets for w in ("A", "B")
    }
    for path, (A, B) in bank.slot_weights(slot).items():
        assert torch.equal(tensors[f"base_model.model.{path}.lora_A.weight"], A)
        assert torch.equal(tensors[f"base_model.model.{path}.lora_B.weight"], B)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == list(info.targets)
    assert config["r"] == info.spec.rank and config["use_rslora"] == info.spec.use_rslora
    assert config["base_model_name_or_path"] == BASE_ID


def test_export_config_matches_what_peft_writes(tmp_path):
    _adapted, bank = _build()
    spec = AdapterSpec(
        rank=4, alpha=8.0, targets=("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj")
    )
    slot = bank.allocate(spec)
    out = export_peft(bank, slot, tmp_path / "ours", base_model_name_or_path=BASE_ID)

    reference = get_peft_model(
        tiny_qwen3(),
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=list(spec.targets),
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        ),
    )
    reference.save_pretrained(tmp_path / "peft")
    ours = json.loads((out / "adapter_config.json").read_text())
    theirs = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    theirs["base_model_name_or_path"] = BASE_ID
    ours["target_modules"], theirs["target_modules"] = (
        sorted(ours["target_modules"]),
        sorted(theirs["target_modules"]),
    )
    assert ours == theirs
    assert set(load_file(out / "adapter_model.safetensors")) == set(
        load_file(tmp_path / "peft" / "adapter_model.safetensors")
    )

    loaded = LoraConfig.from_pretrained(out)
    assert loaded.r == 4 and loaded.lora_alpha == 8 and loaded.peft_type.value == "LORA"
    assert set(loaded.target_modules) == set(spec.targets)
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    for file in out.iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_export_bf16_and_overwrite(tmp_path):
    _adapted, bank = _build()
    slot = bank.allocate(AdapterSpec(rank=4, alpha=4.0))
    _randomize(bank, slot, 3)
    dest = tmp_path / "adapter"
    export_peft(bank, slot, dest, base_model_name_or_path=BASE_ID)
    with pytest.raises(FileExistsError, match="already exists"):
        export_peft(bank, slot, dest, base_model_name_or_path=BASE_ID, dtype=torch.bfloat16)
    export_peft(
        bank, slot, dest, base_model_name_or_path=BASE_ID, dtype=torch.bfloat16, overwrite=True
    )
    tensors = load_file(dest / "adapter_model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    _, weights = read_peft(dest)
    for path, (A, B) in bank.slot_weights(slot).items():
        assert weights[path][0].dtype == torch.float32
        assert torch.equal(weights[path][0], A.to(torch.bfloat16).float())
        assert torch.equal(weights[path][1], B.to(torch.bfloat16).float())


def _peft_saved(tmp_path, target_modules, seed=5, **config):
    torch.manual_seed(seed)
    peft_model = get_peft_model(
        tiny_qwen3(),
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=target_modules,
            init_lora_weights=False,
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
            **config,
        ),
    )
    peft_model.eval()
    out = tmp_path / "peft"
    peft_model.save_pretrained(out)
    return peft_model, out


def _with_default_keys(src, dst):
    dst.mkdir()
    shutil.copy(src / "adapter_config.json", dst / "adapter_config.json")
    tensors = load_file(src / "adapter_model.safetensors")
    renamed = {
        k.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight"
        ): v
        for k, v in tensors.items()
    }
    save_file(renamed, dst / "adapter_model.safetensors")
    return dst


@pytest.mark.parametrize("key_form", ["saved", "default"])
@pytest.mark.parametrize("use_rslora", [False, True])
def test_import_peft_adapter_gives_peft_logits(tmp_path, key_form, use_rslora):
    peft_model, src = _peft_saved(tmp_path, ["q_proj", "v_proj"], use_rslora=use_rslora)
    if key_form == "default":
        src = _with_default_keys(src, tmp_path / "default")
    adapted, bank = _build()
    filler = bank.allocate(AdapterSpec(rank=8, alpha=3.0))
    _randomize(bank, filler, 0)
    slot = import_peft(bank, src, seed=42)
    assert slot != filler
    info = bank.slots[slot]
    assert info.targets == (
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    )
    assert info.spec.rank == 4 and info.spec.alpha == 8.0 and info.spec.seed == 42
    assert info.spec.use_rslora is use_rslora
    named = dict(peft_model.named_parameters())
    for path, (A, B) in bank.slot_weights(slot).items():
        assert B.abs().max() > 0
        assert torch.equal(A, named[f"base_model.model.{path}.lora_A.default.weight"])
        assert torch.equal(B, named[f"base_model.model.{path}.lora_B.default.weight"])

    ids = _ids()
    with torch.no_grad():
        theirs = peft_model(ids).logits
        base = tiny_qwen3()(ids).logits
    _assert_same_function(_ours(adapted, bank, slot, ids), theirs, base)


@pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`:UserWarning")
def test_import_checks_saved_lm_head_base_weight(tmp_path):
    """PEFT saves lm_head's base weight with an lm_head adapter; fine only if it is ours."""
    peft_model, src = _peft_saved(tmp_path, ["lm_head", "q_proj"])
    assert "base_model.model.lm_head.base_layer.weight" in load_file(
        src / "adapter_model.safetensors"
    )
    adapted, bank = _build()
    slot = import_peft(bank, src)
    ids = _ids()
    with torch.no_grad():
        theirs = peft_model(ids).logits
        base = tiny_qwen3()(ids).logits
    _assert_same_function(_ours(adapted, bank, slot, ids), theirs, base)

    tensors = load_file(src / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.base_layer.weight"] += 1.0
    save_file(tensors, src / "adapter_model.safetensors")
    snapshot = _bank_snapshot(bank)
    with pytest.raises(PeftFormatError, match=r"lm_head\.base_layer\.weight differs"):
        import_peft(bank, src)
    _assert_unchanged(bank, snapshot)


def _rewrite(src, dst, config=None, tensors=None):
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    if config:
        config(cfg)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    ts = load_file(src / "adapter_model.safetensors")
    if tensors:
        tensors(ts)
    save_file(ts, dst / "adapter_model.safetensors")
    return dst


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


def _nan(ts):
    ts[f"{Q0}.lora_B.weight"][0, 0] = float("nan")


def _rename_module(ts):
    ts["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = ts.pop(
        f"{Q0}.lora_A.weight"
    )
    ts["base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight"] = ts.pop(
        f"{Q0}.lora_B.weight"
    )


def _wrong_rank(ts):
    ts[f"{Q0}.lora_A.weight"] = torch.zeros(5, 64)


def _wrong_in(ts):
    ts[f"{Q0}.lora_A.weight"] = torch.zeros(4, 65)


def _drop_b(ts):
    del ts[f"{Q0}.lora_B.weight"]


def _dora_vector(ts):
    ts[f"{Q0}.lora_magnitude_vector"] = torch.ones(64)


def _two_adapters(ts):
    ts[f"{Q0}.lora_A.other.weight"] = ts[f"{Q0}.lora_A.weight"].clone()


BAD = {
    "peft_type": (_set("peft_type", "IA3"), None, "peft_type is 'IA3'"),
    "dora": (_set("use_dora", True), None, "use_dora=True is not supported"),
    "rank_pattern": (_set("rank_pattern", {"q_proj": 2}), None, "rank_pattern="),
    "alpha_pattern": (_set("alpha_pattern", {"q_proj": 2}), None, "alpha_pattern="),
    "modules_to_save": (_set("modules_to_save", ["lm_head"]), None, "modules_to_save="),
    "bias": (_set("bias", "all"), None, "bias='all'"),
    "fan_in_fan_out": (_set("fan_in_fan_out", True), None, "fan_in_fan_out=True"),
    "pissa": (_set("init_lora_weights", "pissa"), None, "init_lora_weights='pissa'"),
    "lora_bias": (_set("lora_bias", True), None, "lora_bias=True"),
    "bad_r": (_set("r", 0), None, "r must be a positive integer"),
    "bad_alpha": (_set("lora_alpha", float("nan")), None, "lora_alpha"),
    "nan": (None, _nan, "q_proj lora_B contains NaN"),
    "unknown_module": (
        None,
        _rename_module,
        r"\['model.layers.7.self_attn.q_proj'\] are not layers",
    ),
    "rank_shape": (None, _wrong_rank, r"lora_A has shape \(5, 64\), expected \(r=4"),
    "in_features": (None, _wrong_in, "in_features=64"),
    "missing_b": (None, _drop_b, "has no lora_B"),
    "dora_tensor": (None, _dora_vector, "not plain LoRA"),
    "two_adapters": (None, _two_adapters, "several adapters"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_peft_dirs_are_rejected_and_allocate_nothing(tmp_path, case):
    config_edit, tensor_edit, message = BAD[case]
    _adapted, bank = _build()
    slot = bank.allocate(
        AdapterSpec(rank=4, alpha=8.0, targets=("model.layers.0.self_attn.q_proj", "lm_head"))
    )
    _randomize(bank, slot, 1)
    good = export_peft(bank, slot, tmp_path / "good", base_model_name_or_path=BASE_ID)
    bad = _rewrite(good, tmp_path / "bad", config_edit, tensor_edit)
    snapshot = _bank_snapshot(bank)
    with pytest.raises(PeftFormatError, match=message):
        import_peft(bank, bad)
    _assert_unchanged(bank, snapshot)


def test_bank_level_rejections_allocate_nothing(tmp_path):
    _adapted, bank = _build(r_max=8)
    slot = bank.allocate(AdapterSpec(rank=8, alpha=8.0))
    _randomize(bank, slot, 1)
    src = export_peft(bank, slot, tmp_path / "r8", base_model_name_or_path=BASE_ID)

    _, small = _build(r_max=4)
    snapshot = _bank_snapshot(small)
    with pytest.raises(PeftFormatError, match="r=8 exceeds r_max 4"):
        import_peft(small, src)
    _assert_unchanged(small, snapshot)

    model = tiny_qwen3()
    attn_only = AdaptedModel(
        model, resolve_tinker_targets(model, train_mlp=False, train_unembed=False)
    )
    attn_bank = attn_only.add_bank("train", num_slots=3, r_max=8)
    snapshot = _bank_snapshot(attn_bank)
    with pytest.raises(PeftFormatError, match=r"'lm_head'.*are not layers of bank"):
        import_peft(attn_bank, src)
    _assert_unchanged(attn_bank, snapshot)

    snapshot = _bank_snapshot(bank)
    with pytest.raises(BankError, match="already in use"):
        import_peft(bank, src, slot=slot)
    _assert_unchanged(bank, snapshot)

    (src / "adapter_model.safetensors").rename(src / "adapter_model.bin")
    with pytest.raises(PeftFormatError, match="missing adapter_model.safetensors"):
        import_peft(bank, src)
    _assert_unchanged(bank, snapshot)


def test_export_refuses_non_finite_weights(tmp_path):
    _adapted, bank = _build()
    slot = bank.allocate(AdapterSpec(rank=2, alpha=2.0))
    bank.layer_banks["lm_head"].A.data[slot, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="lm_head A contains NaN or inf"):
        export_peft(bank, slot, tmp_path / "x", base_model_name_or_path=BASE_ID)
    assert list(tmp_path.iterdir()) == []
