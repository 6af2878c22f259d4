"""Start-up recovery refuses to delete more than a crash explains (the outside tester's
`mv data data2` lost every checkpoint: the rows held absolute paths and recovery deleted the
directories as orphans). The store's side (paths stored relative to the data dir, schema 1
migrated, no stored path leading outside) is tested in tests/server/state/."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet import cli
from lorafleet.server.main import ServerThread
from lorafleet.server.state import recovery
from lorafleet.server.state.recovery import MAX_UNASKED_DELETES, RecoveryRefused
from lorafleet.server.state.store import CheckpointRow, Store
from tests.server.conftest import server_config

WEIGHTS = "tenants/t1/runs/m1/weights"


def _row(path: str, directory: Path | str) -> CheckpointRow:
    return CheckpointRow(
        path, "t1", "m1", "training", path.rsplit("/", 1)[1], str(directory), 0.0, 1, None, None, {}
    )


def _checkpoint_dirs(data: Path, names: list[str]) -> list[Path]:
    made = []
    for name in names:
        (data / WEIGHTS / name).mkdir(parents=True)
        (data / WEIGHTS / name / "state.json").write_text("{}")
        made.append(data / WEIGHTS / name)
    return made


def test_recovery_refuses_to_delete_more_than_a_crash_leaves(tmp_path):
    data = tmp_path / "data"
    dirs = _checkpoint_dirs(data, [f"o{i}" for i in range(MAX_UNASKED_DELETES + 1)])
    (data / WEIGHTS / ".x.ab12.tmp").mkdir()
    store = Store(data / "lorafleet.db")
    try:
        with pytest.raises(RecoveryRefused) as refused:
            recovery.sweep(data, store)
        message = str(refused.value)
        assert f"delete {MAX_UNASKED_DELETES + 1} checkpoint directories" in message
        assert "--allow-recovery-deletes" in message and "allow_recovery_deletes" in message
        assert all(d.is_dir() for d in dirs) and (data / WEIGHTS / ".x.ab12.tmp").is_dir()
        counts = recovery.sweep(data, store, allow_deletes=True)
        assert counts["orphans_removed"] == MAX_UNASKED_DELETES + 1
        assert counts["temp_removed"] == 1
        assert not any(d.exists() for d in dirs)
    finally:
        store.close()


def test_recovery_refuses_when_the_rows_files_are_gone_and_others_are_there(tmp_path):
    """The tester's report: every row's directory missing, as many unnamed ones present."""
    data = tmp_path / "data"
    dirs = _checkpoint_dirs(data, ["x", "y"])
    store = Store(data / "lorafleet.db")
    try:
        for name in ("a", "b"):
            store.checkpoints.put(_row(f"tinker://m1/weights/{name}", data / WEIGHTS / name))
        with pytest.raises(RecoveryRefused, match="2 checkpoint directories .* 2 of 2 rows"):
            recovery.sweep(data, store)
        assert all(d.is_dir() for d in dirs)
    finally:
        store.close()


def test_recovery_keeps_a_directory_where_a_rows_tinker_path_belongs(tmp_path):
    """Even when the row names another place, its checkpoint's own place is never an orphan."""
    data = tmp_path / "data"
    (kept,) = _checkpoint_dirs(data, ["a"])
    store = Store(data / "lorafleet.db")
    try:
        store.checkpoints.put(_row("tinker://m1/weights/a", data / "tenants/t1/elsewhere/a"))
        counts = recovery.sweep(data, store)
        assert counts["orphans_removed"] == 0 and counts["missing_dirs"] == 1
        assert kept.is_dir()
    finally:
        store.close()


def test_the_server_does_not_start_over_a_refused_recovery_unless_allowed(tmp_path):
    data = tmp_path / "data"
    dirs = _checkpoint_dirs(data, [f"o{i}" for i in range(MAX_UNASKED_DELETES + 1)])
    with pytest.raises(RecoveryRefused, match="--allow-recovery-deletes"):
        ServerThread(server_config(data))
    assert all(d.is_dir() for d in dirs)
    server = ServerThread(server_config(data, allow_recovery_deletes=True))
    try:
        assert server.service.recovered["orphans_removed"] == MAX_UNASKED_DELETES + 1
        assert not any(d.exists() for d in dirs)
    finally:
        server.stop()


def test_lorafleet_serve_names_the_counts_and_the_flag(tmp_path, monkeypatch):
    data = tmp_path / "data"
    dirs = _checkpoint_dirs(data, [f"o{i}" for i in range(MAX_UNASKED_DELETES + 1)])
    monkeypatch.setenv("LORAFLEET_API_KEYS", "tml-cli-refusal-key-0123456")
    args = ["serve", "--base-model", "tiny-qwen3", "--data-dir", str(data), "--port", "1"]
    with pytest.raises(SystemExit) as exited:
        cli.main(args)  # refused before the model loads
    message = str(exited.value.code)
    assert message.startswith("lorafleet serve: start-up recovery")
    assert f"delete {MAX_UNASKED_DELETES + 1} checkpoint directories" in message
    assert "--allow-recovery-deletes" in message
    assert all(d.is_dir() for d in dirs)
