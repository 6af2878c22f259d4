"""A client's metric values at the edges of JSON numbers: an integer too big for a float is
refused as not finite (a 400 naming the field), never a 500 from `float()`."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lorafleet.server.errors import UserError
from lorafleet.server.ops.run_metrics import RunMetrics
from lorafleet.server.state.keys import Tenant
from lorafleet.server.state.store import ModelRow, Store


def _metrics(tmp_path: Path) -> RunMetrics:
    store = Store(tmp_path / "state.db")
    now = time.time()
    store.models.add(ModelRow("run-1", "t", "s", "tiny-qwen3", 4, {}, None, now, now, "active"))
    return RunMetrics(store)


def test_an_integer_past_float_range_is_refused_as_not_finite(tmp_path: Path):
    metrics = _metrics(tmp_path)
    huge = 10**400  # what json.loads makes of 400 digits
    with pytest.raises(UserError, match=r"points\[0\]\.value must be a finite number"):
        metrics.post(Tenant("t"), "run-1", {"points": [{"name": "r", "step": 0, "value": huge}]})
    assert metrics.store.run_metrics.stats("t", "run-1")[1] == 0  # nothing written
    assert (
        metrics.post(
            Tenant("t"), "run-1", {"points": [{"name": "r", "step": 0, "value": 10**300}]}
        )["accepted"]
        == 1
    )  # a big integer that a float holds is a value like any other
