"""The sharded trainer's driver refuses Dimuon by name, before any rank is asked to do anything
(its ranks shard AdamW moments only)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lorafleet.adapters.checkpoint import TrainingState
from lorafleet.adapters.hparams import DimuonHParams
from lorafleet.distributed.remote import DistTrainEngine
from lorafleet.model.banks import AdapterSpec


class NoRanks:
    """A RankClient whose every call is a test failure: a refusal must not reach the ranks."""

    def __init__(self) -> None:
        self.info: dict[str, Any] = {
            "base_model_id": "base",
            "vocab_size": 10,
            "max_length": None,
            "world": 2,
            "num_slots": 3,
            "r_max": 4,
            "row_size": 8,
            "layout": [],
            "layers": [["layer", 2, 2, 1]],
        }

    def call(self, name: str, **kwargs: Any) -> Any:
        raise AssertionError(f"the ranks were called: {name}")

    def close(self) -> None:
        pass


SPEC = AdapterSpec(rank=1, alpha=1.0, seed=0, targets=("layer",))


def test_create_with_dimuon_is_refused() -> None:
    engine = DistTrainEngine(NoRanks())
    with pytest.raises(ValueError, match="supports only the adamw optimizer"):
        engine.create_adapter(SPEC, optimizer="dimuon")
    assert engine.bank.used_slots() == []


def test_dimuon_step_and_dimuon_checkpoint_are_refused() -> None:
    engine = DistTrainEngine(NoRanks())
    engine.bank._set(1, SPEC)
    with pytest.raises(ValueError, match="DimuonHParams refused"):
        engine.optim_step({1: DimuonHParams(learning_rate=0.1)})
    pair = (torch.zeros(1, 2), torch.zeros(2, 1))
    state = TrainingState(
        spec=SPEC,
        base_model_id="base",
        weights={"layer": pair},
        moments={"momentum": {"layer": pair}},
        step=1,
        hparams=None,
        metadata={},
        created_at="now",
        optimizer="dimuon",
    )
    with pytest.raises(ValueError, match="'dimuon' refused"):
        engine.load_state(state, slot=2)
