"""A moved data directory keeps every checkpoint (the scenario is tests/reliability/moved_dir.py;
bench/reliability.py can run it larger)."""

from __future__ import annotations

import pytest

from tests.reliability.moved_dir import run_moved_dir


@pytest.mark.parametrize("schema_1", [False, True], ids=["relative", "from-schema-1"])
def test_moving_the_data_dir_loses_no_checkpoint(tmp_path, schema_1):
    report = run_moved_dir(tmp_path, tenants=2, saves=1, schema_1=schema_1)
    assert report["checkpoints_saved"] == 4
    assert report["checkpoints_lost_on_move"] == 0, report
    assert report["checkpoints_listed"] == report["checkpoints_identical"] == 4
    assert report["recovered"]["orphans_removed"] == 0
    assert report["recovered"]["missing_dirs"] == 0
    assert report["problems"] == []
    assert not report["old_dir_left"]
    assert report["rows_rewritten_as_schema_1"] == (4 if schema_1 else 0)
