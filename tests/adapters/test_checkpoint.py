"""Training-state checkpoints (bit-exact, layout-free, all-or-nothing) and the fsio helpers."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorafleet.adapters.checkpoint import CheckpointError, read_training_state
from lorafleet.fsio import (
    atomic_directory,
    atomic_save_safetensors,
    atomic_write_bytes,
    atomic_write_json,
    ensure_private_dir,
    safe_name,
)
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec, BankError
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.train.checkpointing import restore_training_state, save_training_state
from lorafleet.train.optim import AdamHParams, BankAdamW
from tests._models import tiny_qwen3

BASE_ID = "tests/tiny-qwen3"
HP = AdamHParams(learning_rate=1e-2)
HP_DECAY = AdamHParams(learning_rate=3e-3, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.1)
SPEC = AdapterSpec(
    rank=4,
    alpha=6.5,
    use_rslora=True,
    seed=9,
    targets=("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"),
)


def _build(r_max=8, num_slots=6, layer_paths=None, trainable=True):
    model = tiny_qwen3()
    adapted = AdaptedModel(model, resolve_tinker_targets(model))
    bank = adapted.add_bank(
        "train", num_slots=num_slots, r_max=r_max, layer_paths=layer_paths, trainable=trainable
    )
    optimizer = BankAdamW(bank.params, bank.grads) if trainable else None
    return adapted, bank, optimizer


def _fake_step(bank, optimizer, slot, grad_seed, hp=HP):
    """A deterministic gradient confined to the adapter (as a real backward's is), then a step."""
    info = bank.slots[slot]
    gen = torch.Generator().manual_seed(grad_seed)
    views = bank.split_row(bank.params[slot], info.spec.rank, info.targets)
    # Drawn in sorted path order, so banks with another layer order get the same gradient.
    grads = {
        p: (
            torch.randn(views[p][0].shape, generator=gen),
            torch.randn(views[p][1].shape, generator=gen),
        )
        for p in sorted(views)
    }
    bank.grads[slot].copy_(bank.join_row(grads, info.spec.rank, info.targets))
    optimizer.note_gradient([slot])
    optimizer.step({slot: hp})


def _trained(tmp_path, steps=3):
    adapted, bank, optimizer = _build()
    other = bank.allocate(AdapterSpec(rank=8, alpha=1.0, seed=1))
    _fake_step(bank, optimizer, other, 100)
    slot = bank.allocate(SPEC)
    for i in range(steps):
        _fake_step(bank, optimizer, slot, i, HP_DECAY)
    ckpt = save_training_state(
        tmp_path / "ckpt",
        bank=bank,
        slot=slot,
        optimizer=optimizer,
        base_model_id=BASE_ID,
        hparams=HP_DECAY,
        metadata={"run": "r1", "tags": [1, 2]},
    )
    return adapted, bank, optimizer, slot, ckpt


def _per_layer(bank, row, spec):
    return bank.split_row(row, spec.rank, spec.targets)


def _assert_layers_equal(a, b):
    assert list(a) == list(b) or set(a) == set(b)
    for path in a:
        assert torch.equal(a[path][0], b[path][0]), path
        assert torch.equal(a[path][1], b[path][1]), path


def _snapshot(bank, optimizer):
    opt = (
        None
        if optimizer is None
        else (optimizer.exp_avg.clone(), optimizer.exp_avg_sq.clone(), optimizer.step_count.clone())
    )
    return [None if s is None else s.spec for s in bank.slots], bank.params.clone(), opt


def _assert_unchanged(bank, optimizer, snapshot):
    specs, params, opt = snapshot
    assert [None if s is None else s.spec for s in bank.slots] == specs
    assert torch.equal(bank.params, params)
    if optimizer is not None:
        assert torch.equal(optimizer.exp_avg, opt[0])
        assert torch.equal(optimizer.exp_avg_sq, opt[1])
        assert torch.equal(optimizer.step_count, opt[2])


# -------------------------------------------------------------------------- round trips


def test_round_trip_into_other_slot_is_bit_exact(tmp_path):
    _adapted, bank, optimizer, slot, ckpt = _trained(tmp_path)
    new = restore_training_state(
        ckpt, bank=bank, optimizer=optimizer, base_model_id=BASE_ID, slot=5
    )
    assert new == 5
    assert bank.slots[new].spec == bank.slots[slot].spec
    assert torch.equal(bank.params[new], bank.params[slot])
    assert float(bank.scales[new]) == float(bank.scales[slot])
    src, dst = optimizer.slot_state(slot), optimizer.slot_state(new)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(src[key], dst[key]), key
    assert int(dst["step"]) == 3
    assert not optimizer.has_pending_gradient(new)

    state = read_training_state(ckpt)
    assert state.spec == bank.slots[slot].spec and set(state.spec.targets) == set(SPEC.targets)
    assert state.base_model_id == BASE_ID and state.step == 3
    assert state.hparams == HP_DECAY
    assert state.metadata == {"run": "r1", "tags": [1, 2]}


def test_round_trip_into_bank_with_other_layout_is_bit_exact(tmp_path):
    _adapted, bank, optimizer, slot, ckpt = _trained(tmp_path)
    # Different r_max, slot count and layer order (the flat rows share nothing).
    _, other, other_opt = _build(r_max=16, num_slots=3, layer_paths=list(reversed(SPEC.targets)))
    assert other.row_size != bank.row_size
    new = restore_training_state(ckpt, bank=other, optimizer=other_opt, base_model_id=BASE_ID)
    assert new == 1
    spec = bank.slots[slot].spec
    _assert_layers_equal(other.slot_weights(new), bank.slot_weights(slot))
    src, dst = optimizer.slot_state(slot), other_opt.slot_state(new)
    for key in ("exp_avg", "exp_avg_sq"):
        _assert_layers_equal(_per_layer(other, dst[key], spec), _per_layer(bank, src[key], spec))
    assert torch.equal(src["step"], dst["step"])

    # And training continues identically in the other layout (elementwise AdamW, no clipping).
    _fake_step(bank, optimizer, slot, 77)
    _fake_step(other, other_opt, new, 77)
    _assert_layers_equal(other.slot_weights(new), bank.slot_weights(slot))


def test_training_resumes_identically(tmp_path):
    _adapted, bank, optimizer, slot, _ = _trained(tmp_path, steps=1)
    _fake_step(bank, optimizer, slot, 5, HP)
    ckpt = save_training_state(
        tmp_path / "after",
        bank=bank,
        slot=slot,
        optimizer=optimizer,
        base_model_id=BASE_ID,
        hparams=HP,
    )
    new = restore_training_state(ckpt, bank=bank, optimizer=optimizer, base_model_id=BASE_ID)
    for i in range(3):
        _fake_step(bank, optimizer, slot, 1000 + i, HP)
        _fake_step(bank, optimizer, new, 1000 + i, HP)
    assert torch.equal(bank.params[new], bank.params[slot])
    assert torch.equal(optimizer.exp_avg[new], optimizer.exp_avg[slot])
    assert torch.equal(optimizer.exp_avg_sq[new], optimizer.exp_avg_sq[slot])
    assert optimizer.slot_step(new) == optimizer.slot_step(slot) == 5


def test_restore_into_inference_only_bank(tmp_path):
    adapted, bank, _optimizer, slot, ckpt = _trained(tmp_path)
    sample = adapted.add_bank("sample", num_slots=3, r_max=8, trainable=False)
    new = restore_training_state(ckpt, bank=sample, optimizer=None, base_model_id=BASE_ID)
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with adapted.routing("train", bank.slot_ids_for_rows([slot, slot], 6)):
            train_logits = adapted.model(ids).logits
        with adapted.routing("sample", sample.slot_ids_for_rows([new, new], 6)):
            sample_logits = adapted.model(ids).logits
    torch.testing.assert_close(sample_logits, train_logits, atol=0, rtol=0)


def test_optimizer_state_optional_both_ways(tmp_path):
    _adapted, bank, optimizer, slot, ckpt = _trained(tmp_path)
    weights_only = save_training_state(
        tmp_path / "w", bank=bank, slot=slot, optimizer=None, base_model_id=BASE_ID, hparams=None
    )
    assert not (weights_only / "optimizer.safetensors").exists()
    state = read_training_state(weights_only)
    assert state.moments is None and state.step is None and state.hparams is None
    # A slot restored without optimizer state starts as a fresh AdamW, even if it was used before.
    new = restore_training_state(
        weights_only, bank=bank, optimizer=optimizer, base_model_id=BASE_ID, slot=4
    )
    assert optimizer.slot_step(new) == 0 and optimizer.exp_avg[new].abs().max() == 0
    assert torch.equal(bank.params[new], bank.params[slot])
    bank.free(new)
    new = restore_training_state(
        ckpt, bank=bank, optimizer=optimizer, base_model_id=BASE_ID, load_optimizer=False
    )
    assert optimizer.slot_step(new) == 0 and optimizer.exp_avg_sq[new].abs().max() == 0


def test_files_are_private_and_layout_free(tmp_path):
    _adapted, bank, optimizer, slot, ckpt = _trained(tmp_path)
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o700
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "optimizer.safetensors",
        "state.json",
        "weights.safetensors",
    ]
    for file in ckpt.iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file
    doc = json.loads((ckpt / "state.json").read_text())
    assert doc["signature"] == {
        "rank": 4,
        "alpha": 6.5,
        "use_rslora": True,
        "targets": list(bank.slots[slot].targets),
        "base_model_id": BASE_ID,
    }
    assert doc["seed"] == 9 and doc["step"] == 3 and doc["format_version"] == 1
    assert doc["hparams"] == HP_DECAY.to_dict()
    weights = load_file(ckpt / "weights.safetensors")
    assert weights["lm_head.A"].shape == (4, 64) and weights["lm_head.B"].shape == (96, 4)
    assert all(t.dtype == torch.float32 for t in weights.values())
    opt = load_file(ckpt / "optimizer.safetensors")
    assert opt["step"].dtype == torch.int64 and opt["step"].dim() == 0 and int(opt["step"]) == 3
    assert opt["exp_avg_sq.lm_head.B"].shape == (96, 4)
    with pytest.raises(FileExistsError, match="already exists"):
        save_training_state(
            ckpt, bank=bank, slot=slot, optimizer=optimizer, base_model_id=BASE_ID, hparams=HP
        )
    save_training_state(
        ckpt,
        bank=bank,
        slot=slot,
        optimizer=None,
        base_model_id=BASE_ID,
        hparams=HP,
        overwrite=True,
    )
    assert sorted(p.name for p in ckpt.iterdir()) == ["state.json", "weights.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# ------------------------------------------------------------------------------ errors


def test_wrong_base_model_is_refused(tmp_path):
    _adapted, bank, optimizer, _slot, ckpt = _trained(tmp_path)
    snapshot = _snapshot(bank, optimizer)
    with pytest.raises(CheckpointError, match=r"'tests/tiny-qwen3'.*'org/other-model'"):
        restore_training_state(
            ckpt, bank=bank, optimizer=optimizer, base_model_id="org/other-model"
        )
    _assert_unchanged(bank, optimizer, snapshot)


def _edit_weights(ckpt, edit, name="weights.safetensors"):
    tensors = load_file(ckpt / name)
    edit(tensors)
    save_file(tensors, ckpt / name)


def _edit_state(ckpt, edit):
    doc = json.loads((ckpt / "state.json").read_text())
    edit(doc)
    (ckpt / "state.json").write_text(json.dumps(doc))


def test_restore_errors_change_nothing(tmp_path):
    _adapted, bank, optimizer, slot, ckpt = _trained(tmp_path)

    def check(target_bank, target_opt, message, **kwargs):
        snapshot = _snapshot(target_bank, target_opt)
        with pytest.raises((CheckpointError, BankError), match=message):
            restore_training_state(
                ckpt, bank=target_bank, optimizer=target_opt, base_model_id=BASE_ID, **kwargs
            )
        _assert_unchanged(target_bank, target_opt, snapshot)

    _, small, small_opt = _build(r_max=2)
    check(small, small_opt, "rank 4 exceeds r_max 2")
    _, attn, attn_opt = _build(
        layer_paths=["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]
    )
    check(attn, attn_opt, r"\['lm_head', 'model.layers.1.mlp.down_proj'\] are not layers")
    check(bank, optimizer, "already in use", slot=slot)
    _, other, _ = _build()
    check(other, optimizer, "optimizer does not manage bank")

    for edit, message, name in [
        (
            lambda t: t.__setitem__("lm_head.A", torch.zeros(5, 64)),
            r"lm_head\.A has shape \(5, 64\)",
            "weights.safetensors",
        ),
        (
            lambda t: t.__setitem__("lm_head.A", torch.zeros(4, 63)),
            "does not have the weights' shapes",
            "weights.safetensors",
        ),
        (lambda t: t.pop("lm_head.B"), r"missing \['lm_head.B'\]", "weights.safetensors"),
        (lambda t: t["lm_head.B"].fill_(float("nan")), "NaN", "weights.safetensors"),
        (lambda t: t["exp_avg_sq.lm_head.B"].fill_(-1.0), "negative", "optimizer.safetensors"),
        (
            lambda t: t.__setitem__("step", torch.tensor(7)),
            "does not match state.json step 3",
            "optimizer.safetensors",
        ),
    ]:
        backup = load_file(ckpt / name)
        _edit_weights(ckpt, edit, name)
        check(bank, optimizer, message)
        save_file(backup, ckpt / name)

    # Consistent files whose shapes do not fit the bank's layer.
    backups = {
        name: load_file(ckpt / name) for name in ("weights.safetensors", "optimizer.safetensors")
    }
    _edit_weights(ckpt, lambda t: t.__setitem__("lm_head.A", torch.zeros(4, 63)))
    for m in ("exp_avg", "exp_avg_sq"):
        _edit_weights(
            ckpt,
            lambda t, m=m: t.__setitem__(f"{m}.lm_head.A", torch.zeros(4, 63)),
            "optimizer.safetensors",
        )
    check(bank, optimizer, "layer is 64 -> 96")
    for name, tensors in backups.items():
        save_file(tensors, ckpt / name)

    for edit, message in [
        (lambda d: d.__setitem__("format_version", 99), "format_version 99"),
        (lambda d: d["signature"].__setitem__("rank", "4"), "'rank' has a wrong type"),
        (lambda d: d.__setitem__("hparams", {"learning_rate": -1.0}), "learning_rate must be >= 0"),
    ]:
        backup = (ckpt / "state.json").read_text()
        _edit_state(ckpt, edit)
        check(bank, optimizer, message)
        (ckpt / "state.json").write_text(backup)

    os.remove(ckpt / "optimizer.safetensors")
    check(bank, optimizer, "missing optimizer.safetensors")


def test_save_refuses_state_the_checkpoint_could_not_restore(tmp_path):
    _adapted, bank, _optimizer, slot, _ = _trained(tmp_path)
    # A value beyond the adapter's rank would be silently dropped by the per-layer form.
    bank.layer_banks["lm_head"].A.data[slot, 6, 0] = 1.0
    with pytest.raises(CheckpointError, match="outside the adapter's rank"):
        save_training_state(
            tmp_path / "x",
            bank=bank,
            slot=slot,
            optimizer=None,
            base_model_id=BASE_ID,
            hparams=None,
        )
    bank.layer_banks["lm_head"].A.data[slot, 6, 0] = 0.0
    bank.layer_banks["lm_head"].A.data[slot, 0, 0] = float("nan")
    with pytest.raises(CheckpointError, match="NaN"):
        save_training_state(
            tmp_path / "x",
            bank=bank,
            slot=slot,
            optimizer=None,
            base_model_id=BASE_ID,
            hparams=None,
        )
    with pytest.raises(CheckpointError, match="metadata is not plain JSON"):
        save_training_state(
            tmp_path / "x",
            bank=bank,
            slot=1,
            optimizer=None,
            base_model_id=BASE_ID,
            hparams=None,
            metadata={"t": object()},
        )
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------- fsio


def _hidden(directory):
    return [p.name for p in directory.iterdir() if p.name.startswith(".")]


def test_atomic_directory_failure_leaves_nothing(tmp_path):
    dest = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"), atomic_directory(dest) as tmp:
        assert stat.S_IMODE(tmp.stat().st_mode) == 0o700 and tmp.parent == tmp_path
        atomic_write_bytes(tmp / "half", b"partial")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_atomic_directory_overwrite_swaps_whole_trees(tmp_path):
    dest = tmp_path / "out"
    with atomic_directory(dest) as tmp:
        (tmp / "old").write_text("1")
        os.chmod(tmp / "old", 0o644)
    assert stat.S_IMODE((dest / "old").stat().st_mode) == 0o600  # tightened before publishing
    with pytest.raises(FileExistsError), atomic_directory(dest) as tmp:
        pass
    with pytest.raises(RuntimeError), atomic_directory(dest, overwrite=True) as tmp:
        (tmp / "new").write_text("2")
        raise RuntimeError
    assert [p.name for p in dest.iterdir()] == ["old"]
    with atomic_directory(dest, overwrite=True) as tmp:
        (tmp / "new").write_text("2")
    assert [p.name for p in dest.iterdir()] == ["new"]
    assert _hidden(tmp_path) == []


def test_atomic_file_writes(tmp_path):
    path = tmp_path / "f.json"
    atomic_write_json(path, {"b": 1, "a": [1.5]})
    assert json.loads(path.read_text()) == {"a": [1.5], "b": 1}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(ValueError):
        atomic_write_json(path, {"x": float("nan")})
    assert json.loads(path.read_text()) == {"a": [1.5], "b": 1}
    atomic_write_bytes(path, b"raw")
    assert path.read_bytes() == b"raw"
    atomic_save_safetensors(
        tmp_path / "t.safetensors", {"x": torch.arange(6.0).view(2, 3).t()}, {"k": "v"}
    )
    assert torch.equal(load_file(tmp_path / "t.safetensors")["x"], torch.arange(6.0).view(2, 3).t())
    assert _hidden(tmp_path) == []


def test_ensure_private_dir(tmp_path):
    leaf = ensure_private_dir(tmp_path / "a" / "b")
    assert leaf.is_dir()
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700
    assert stat.S_IMODE(leaf.stat().st_mode) == 0o700
    assert ensure_private_dir(leaf) == leaf


@pytest.mark.parametrize(
    "bad", ["../x", "a/b", ".hidden", "", "x" * 200, "..", ".", "a b", "é", None]
)
def test_safe_name_rejects(bad):
    with pytest.raises(ValueError, match="adapter_id"):
        safe_name(bad, "adapter_id")


def test_safe_name_accepts():
    assert safe_name("run-1_v2.final", "name") == "run-1_v2.final"
    assert safe_name("x" * 128, "name") == "x" * 128


def test_failure_after_allocation_frees_the_slot(tmp_path, monkeypatch):
    _adapted, bank, optimizer, _slot, ckpt = _trained(tmp_path)
    snapshot = _snapshot(bank, optimizer)

    def fail(*_args, **_kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(optimizer, "load_slot_state", fail)
    with pytest.raises(RuntimeError, match="device lost"):
        restore_training_state(ckpt, bank=bank, optimizer=optimizer, base_model_id=BASE_ID)
    _assert_unchanged(bank, optimizer, snapshot)
