"""Merged weights: exact math, a pristine base that never moves, no rounding carried over."""

from __future__ import annotations

import stat

import pytest
import torch
from safetensors.torch import load_file

from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec
from lorafleet.sync.base import AdapterUpdate, AdapterVersion, SyncError
from lorafleet.sync.merged import PristineBase
from lorafleet.train.engine import TrainEngine
from tests._models import tiny_llama, tiny_qwen3
from tests.sync._helpers import randomize

Q = "model.layers.0.self_attn.q_proj"


def trainer_over(model, paths) -> TrainEngine:
    adapted = AdaptedModel(model, paths)
    adapted.add_bank("train", num_slots=3, r_max=8)
    return TrainEngine(adapted, base_model_id="tiny")


@pytest.fixture
def base_dir(tmp_path):
    tiny_qwen3().save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def update_for(trainer, slot, version):
    return AdapterUpdate(AdapterVersion("m", version), trainer.bank, slot, "tiny")


def test_merge_is_w_plus_scaled_ba_and_the_rest_is_untouched(base_dir, tmp_path):
    trainer = trainer_over(tiny_qwen3(), [Q, "model.layers.1.mlp.down_proj"])
    slot = trainer.create_adapter(AdapterSpec(rank=4, alpha=16.0, seed=1))
    randomize(trainer, slot, 2)
    pristine = PristineBase(base_dir, torch.float32)
    update = update_for(trainer, slot, 0)
    pristine.write(update, tmp_path / "out")
    merged = load_file(tmp_path / "out" / "model.safetensors")
    original = load_file(base_dir / "model.safetensors")
    A, B = update.weights()[Q]
    torch.testing.assert_close(
        merged[f"{Q}.weight"], original[f"{Q}.weight"] + 4.0 * B @ A, rtol=1e-6, atol=1e-6
    )
    untouched = [
        n for n in original if n not in (f"{Q}.weight", "model.layers.1.mlp.down_proj.weight")
    ]
    assert untouched and all(torch.equal(merged[n], original[n]) for n in untouched)
    assert set(merged) == set(original)  # a complete checkpoint, never a partial one
    assert (tmp_path / "out" / "config.json").is_file()
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in (tmp_path / "out").iterdir())


def test_rounding_never_accumulates_across_versions(base_dir):
    """bf16 engine: version 2 merged after version 1 is bit-identical to version 2 merged
    alone, because both start from the pristine base, which itself never changes."""
    trainer = trainer_over(tiny_qwen3(), [Q])
    slot = trainer.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=1))
    pristine = PristineBase(base_dir, torch.bfloat16)
    snapshot = pristine.base_tensor(f"{Q}.weight").clone()
    randomize(trainer, slot, 3, scale=1e-3)
    pristine.merge(update_for(trainer, slot, 1))
    randomize(trainer, slot, 4, scale=1e-3)
    second = pristine.merge(update_for(trainer, slot, 2))[f"{Q}.weight"]
    alone = PristineBase(base_dir, torch.bfloat16).merge(update_for(trainer, slot, 2))[
        f"{Q}.weight"
    ]
    assert torch.equal(second, alone)
    assert torch.equal(pristine.base_tensor(f"{Q}.weight"), snapshot)
    assert second.dtype == torch.bfloat16


def test_tied_lm_head_cannot_be_merged(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "llama")
    trainer = trainer_over(tiny_llama(), ["lm_head"])
    slot = trainer.create_adapter(AdapterSpec(rank=2, alpha=4.0))
    randomize(trainer, slot, 1)
    pristine = PristineBase(tmp_path / "llama", torch.float32)
    with pytest.raises(SyncError, match="tied embeddings"):
        pristine.merge(update_for(trainer, slot, 0))


def test_dtype_and_directory_are_checked(tmp_path, base_dir):
    with pytest.raises(ValueError, match="merged dtype"):
        PristineBase(base_dir, torch.int8)
    with pytest.raises(SyncError, match="not a model directory"):
        PristineBase(tmp_path, torch.float32)
