"""Resident adapter-seconds are each run's time in a trainer slot, measured at page-in and
page-out, not sampled: before, metering credited the whole interval since its last flush to
whichever runs happened to be hot at the flush, so a run paged in and out (or closed) between
two flushes was billed nothing and one paged in just before a flush the whole interval."""

from __future__ import annotations

import time
from typing import cast

from lorafleet.model.banks import AdapterSpec
from lorafleet.server.engine.live_models import LiveModels
from lorafleet.server.ops.metering import Metering
from lorafleet.server.state.store import Store
from tests.server.test_live_models import _Rows
from tests.train.test_engine import make_engine

HOT_S = 0.3


def _create(live: LiveModels, model_id: str, tenant: str, seed: int) -> None:
    live.require_free_slot()
    slot = live.trainer.create_adapter(AdapterSpec(rank=2, alpha=4.0, seed=seed))
    live.add(model_id, tenant, "s", "base", slot, {"rank": 2}, None)


def test_slot_time_counts_runs_that_left_and_not_before_a_run_came(tmp_path):
    live = LiveModels(
        cast(Store, _Rows()),  # the rows of models only
        make_engine(num_slots=3),  # two adapter slots
        2,
        paged_dir=tmp_path / "paged",
        warm_bytes=1 << 30,
    )
    metering = Metering(Store(tmp_path / "usage.db"), resident=live.resident_seconds)
    _create(live, "a", "t1", 1)
    _create(live, "b", "t2", 2)
    time.sleep(HOT_S)
    _create(live, "c", "t2", 3)  # a, the least recently used, leaves its slot
    live.unload(["b"])  # b closes before any flush
    metering.close()  # collects the slot time so far, then flushes
    runs = {(t, r): v for t, r, c, v in metering.totals(None) if c == "resident_adapter_seconds"}
    assert runs[("t1", "a")] >= HOT_S  # paged out: still counted
    assert runs[("t2", "b")] >= HOT_S  # unloaded: still counted
    assert runs[("t2", "c")] < HOT_S / 2  # hot only since its creation
    # a second collection counts only the time since the first
    time.sleep(0.05)
    again = {(t, r): s for t, r, s in live.resident_seconds()}
    assert set(again) == {("t2", "c")} and again[("t2", "c")] < HOT_S / 2
