"""The paging policy of training runs (live_models.py) on a real TrainEngine with two slots:
which run leaves a slot (least recently used, idle before busy, never one held by the running
batch), host memory bounded by bytes, and a trainer that cannot page keeping hard slots."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet.model.banks import AdapterSpec
from lorafleet.server.engine.live_models import LiveModels
from lorafleet.server.errors import ServerFault, UserError
from lorafleet.server.ops.scheduler import Scheduler
from lorafleet.server.state.store import ModelRow
from tests.server.jobs import job
from tests.train.test_engine import make_engine


class _ModelRows:
    """The store's models table as LiveModels uses it, kept in memory."""

    def __init__(self) -> None:
        self.status: dict[str, str] = {}

    def add(self, row: ModelRow) -> None:
        self.status[row.model_id] = row.status

    def set_status(self, model_id: str, status: str) -> None:
        self.status[model_id] = status


class _Rows:
    """The store's side of LiveModels (rows of models), kept in memory."""

    def __init__(self) -> None:
        self.models = _ModelRows()


def _live(tmp_path: Path, busy: set[str], warm_bytes: int = 1 << 30) -> LiveModels:
    engine = make_engine(num_slots=3)  # two adapter slots
    return LiveModels(
        _Rows(),  # type: ignore[arg-type]
        engine,
        2,
        paged_dir=tmp_path / "paged",
        warm_bytes=warm_bytes,
        has_work=lambda model_id: model_id in busy,
    )


def _create(live: LiveModels, model_id: str, seed: int) -> None:
    live.require_free_slot()
    slot = live.trainer.create_adapter(AdapterSpec(rank=2, alpha=4.0, seed=seed))
    live.add(model_id, "t", "s", "base", slot, {"rank": 2}, None)


def _tier(live: LiveModels, model_id: str) -> str:
    return live._runs[model_id].tier


def test_the_least_recently_used_idle_run_leaves_and_comes_back_on_use(tmp_path):
    busy = {"a"}
    live = _live(tmp_path, busy)
    _create(live, "a", 1)
    _create(live, "b", 2)
    _create(live, "c", 3)  # a is older, but has queued work: b leaves
    assert (_tier(live, "a"), _tier(live, "b"), _tier(live, "c")) == ("hot", "warm", "hot")
    busy.update({"b", "c"})  # everyone busy: the least recently used leaves after all
    live.get("b")
    assert (_tier(live, "a"), _tier(live, "b"), _tier(live, "c")) == ("warm", "hot", "hot")
    paging = live.paging()
    assert paging["misses"] == 1 and paging["page_ins"]["warm"] == 1
    assert paging["page_outs"]["warm"] == 2 and paging["runs"] == {"hot": 2, "warm": 1, "cold": 0}


def test_a_held_run_never_leaves_and_host_memory_spills_to_disk(tmp_path):
    live = _live(tmp_path, set(), warm_bytes=0)  # nothing stays in host memory
    _create(live, "a", 1)
    _create(live, "b", 2)
    with live.hold(["a", "b"]), pytest.raises(ServerFault, match="holds a run of the batch"):
        _create(live, "c", 3)
    assert live.trainer.bank.used_slots() == [1, 2]  # nothing was evicted, nothing claimed
    with live.hold(["a"]):
        _create(live, "c", 3)
    assert (_tier(live, "a"), _tier(live, "b"), _tier(live, "c")) == ("hot", "cold", "hot")
    assert (tmp_path / "paged").is_dir() and any((tmp_path / "paged").iterdir())
    live.unload(["b"])
    assert not any((tmp_path / "paged").iterdir())  # its disk is given back


def test_a_trainer_that_cannot_page_keeps_hard_slots(tmp_path):
    class HardSlots:  # a trainer that declares it cannot page (as the sharded ones do)
        pager = None

        def __init__(self) -> None:
            self.bank = make_engine(num_slots=2).bank

    trainer = HardSlots()
    trainer.bank.allocate(AdapterSpec(rank=2, alpha=4.0, seed=1))
    live = LiveModels(_Rows(), trainer, 1, paged_dir=tmp_path / "paged")  # type: ignore[arg-type]
    assert not live.pages
    with pytest.raises(UserError, match="all 1 training adapter slots of this server are in use"):
        live.require_free_slot()


class _NoFutures:
    def complete(self, request_id, result):
        raise AssertionError(f"{request_id} completed, but nothing runs here")


def test_the_scheduler_says_which_models_have_work():
    """The policy's question (`Scheduler.has_work`): an op queued, even behind a gap, counts."""
    scheduler = Scheduler(_NoFutures())  # type: ignore[arg-type]
    scheduler.register_model("a")
    scheduler.register_model("b")
    assert not scheduler.has_work("a")
    scheduler.submit(job("r1", "forward_backward", "t", model_id="a", seq_id=2))
    assert scheduler.has_work("a") and not scheduler.has_work("b")
    scheduler.submit(job("r2", "create_model", "t", model_id="c"))
    assert scheduler.has_work("c")


def test_a_paged_state_that_cannot_be_read_back_fails_that_use_and_is_kept(tmp_path):
    live = _live(tmp_path, set(), warm_bytes=0)
    for i, model_id in enumerate("abc"):
        _create(live, model_id, i)
    assert _tier(live, "a") == "cold"
    (state_json,) = (tmp_path / "paged").glob("*/state/state.json")
    state_json.write_text("{")
    with pytest.raises(ServerFault, match="'a': its paged-out state could not be read back"):
        live.get("a")
    # nothing moved: the other runs are where they were, the state stays on disk
    assert [_tier(live, m) for m in "abc"] == ["cold", "hot", "hot"]
    assert state_json.parent.is_dir()


def test_a_tenant_at_its_resident_quota_pages_out_its_own_runs(tmp_path):
    engine = make_engine(num_slots=4)  # three adapter slots
    live = LiveModels(
        _Rows(),  # type: ignore[arg-type]
        engine,
        3,
        paged_dir=tmp_path / "paged",
        warm_bytes=1 << 30,
        max_resident=lambda tenant: 1 if tenant == "small" else None,
    )

    def create(model_id: str, tenant: str, seed: int) -> None:
        live.require_free_slot(tenant)
        slot = engine.create_adapter(AdapterSpec(rank=2, alpha=4.0, seed=seed))
        live.add(model_id, tenant, "s", "base", slot, {"rank": 2}, None)

    create("big-1", "big", 1)
    create("small-1", "small", 2)
    create("small-2", "small", 3)  # a slot is free, but "small" may hold one: its own run leaves
    assert [_tier(live, m) for m in ("big-1", "small-1", "small-2")] == ["hot", "warm", "hot"]
    live.get("small-1")
    assert [_tier(live, m) for m in ("big-1", "small-1", "small-2")] == ["hot", "hot", "warm"]
    with live.hold(["small-1"]):  # the batch needs its resident run: the quota yields to it
        live.get("small-2")
    assert [_tier(live, m) for m in ("big-1", "small-1", "small-2")] == ["hot", "hot", "hot"]
