"""The checkpoint format's optimizer family: Dimuon state round-trips, a checkpoint written
before the family was recorded reads as AdamW, and mismatched parts are refused."""

from __future__ import annotations

import json

import pytest
import torch

from lorafleet.adapters.checkpoint import CheckpointError, read_training_state, write_training_state
from lorafleet.adapters.hparams import AdamHParams, DimuonHParams
from lorafleet.model.banks import AdapterSpec

SPEC = AdapterSpec(rank=2, alpha=4.0, seed=3, targets=("layer.q", "layer.v"))


def layers(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {
        path: (torch.randn(2, 5, generator=gen), torch.randn(4, 2, generator=gen))
        for path in SPEC.targets or ()
    }


def test_dimuon_state_round_trips(tmp_path) -> None:
    weights, momentum = layers(0), layers(1)
    hp = DimuonHParams(learning_rate=0.02, beta1=0.8, grad_clip_norm=1.0)
    dest = write_training_state(
        tmp_path / "ckpt",
        spec=SPEC,
        base_model_id="base",
        weights=weights,
        moments={"momentum": momentum},
        step=7,
        hparams=hp,
        optimizer="dimuon",
    )
    state = read_training_state(dest)
    assert state.optimizer == "dimuon" and state.step == 7 and state.hparams == hp
    assert state.moments is not None and set(state.moments) == {"momentum"}
    for path, (a, b) in momentum.items():
        assert torch.equal(state.moments["momentum"][path][0], a)
        assert torch.equal(state.moments["momentum"][path][1], b)


def test_checkpoint_without_optimizer_field_is_adamw(tmp_path) -> None:
    dest = write_training_state(
        tmp_path / "old",
        spec=SPEC,
        base_model_id="base",
        weights=layers(0),
        moments={
            "exp_avg": layers(1),
            "exp_avg_sq": {p: (a.abs(), b.abs()) for p, (a, b) in layers(2).items()},
        },
        step=1,
        hparams=AdamHParams(learning_rate=1e-3),
    )
    doc = json.loads((dest / "state.json").read_text())
    del doc["optimizer"]  # as written before Dimuon existed
    (dest / "state.json").write_text(json.dumps(doc))
    state = read_training_state(dest)
    assert state.optimizer == "adamw" and isinstance(state.hparams, AdamHParams)


@pytest.mark.parametrize(
    ("moments", "hparams", "fragment"),
    [
        ({"exp_avg": layers(1)}, None, "dimuon optimizer state is ['momentum']"),
        ({"momentum": layers(1)}, AdamHParams(learning_rate=1e-3), "must be DimuonHParams"),
    ],
)
def test_mismatched_parts_are_refused(tmp_path, moments, hparams, fragment) -> None:
    with pytest.raises(CheckpointError) as info:
        write_training_state(
            tmp_path / "bad",
            spec=SPEC,
            base_model_id="base",
            weights=layers(0),
            moments=moments,
            step=1,
            hparams=hparams,
            optimizer="dimuon",
        )
    assert fragment in str(info.value)
    assert not (tmp_path / "bad").exists()


def test_unknown_optimizer_in_state_json_is_refused(tmp_path) -> None:
    dest = write_training_state(
        tmp_path / "x",
        spec=SPEC,
        base_model_id="base",
        weights=layers(0),
        moments=None,
        step=None,
        hparams=None,
    )
    doc = json.loads((dest / "state.json").read_text())
    doc["optimizer"] = "lion"
    (dest / "state.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="optimizer must be one of"):
        read_training_state(dest)
