"""The op union: every member declares how the stages treat it, and the stages' `match`
statements are exhaustive (mypy checks the `assert_never`s; this checks the declarations)."""

from __future__ import annotations

import typing

from lorafleet.server.ops import types
from lorafleet.server.ops.types import Meter, Op, Quota, Stage


def _members() -> list[type]:
    return list(typing.get_args(Op))


def test_every_op_declares_kind_stage_disk_quota_and_meters():
    members = _members()
    assert len(members) == 11
    kinds = [member.kind for member in members]
    assert len(set(kinds)) == len(kinds), kinds
    for member in members:
        assert isinstance(member.stage, Stage), member
        assert isinstance(member.writes_disk, bool), member
        assert isinstance(member.quota, Quota), member
        assert all(isinstance(m, Meter) for m in member.meters), member


def test_checkpoint_writes_are_the_disk_writers_and_draw_on_storage():
    """What the scheduler refuses on a full disk and what quotas reserve storage for are the
    same set: the ops that write a checkpoint (save_weights_external was once left out)."""
    writers = {m.kind for m in _members() if m.writes_disk}
    assert writers == {"save_weights", "save_sampler", "save_external"}
    assert {m.kind for m in _members() if m.quota is Quota.STORAGE} == writers


def test_stages_group_the_ops_as_the_scheduler_runs_them():
    by_stage: dict[Stage, set[str]] = {}
    for member in _members():
        by_stage.setdefault(member.stage, set()).add(member.kind)
    assert by_stage[Stage.TRAIN] == {"forward", "forward_backward"}
    assert by_stage[Stage.OPTIM] == {"optim_step"}
    assert by_stage[Stage.SAMPLE] == {"sample"}
    assert types.Refused.stage is Stage.CONTROL
