"""Every disk-writing op is refused before it writes while the data disk is full (issue 31: the
kinds lived in several lists and `save_weights_external` was missing from the scheduler's),
and they all succeed again once the disk has room, without a restart."""

from __future__ import annotations

import tinker

from lorafleet.server.main import ServerThread
from lorafleet.server.state.disk import FAULT_ENV
from tests.server.conftest import KEY_A, server_config, trained


def test_every_checkpoint_write_is_refused_on_a_full_disk_and_writes_nothing(tmp_path, monkeypatch):
    flag = tmp_path / "disk-full"
    monkeypatch.setenv(FAULT_ENV, str(flag))
    data_dir = tmp_path / "data"
    server = ServerThread(server_config(data_dir))
    try:
        client = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A)
        tc = trained(client, "tiny-qwen3", seed=5)
        runs = data_dir / "tenants"
        files_before = sorted(p for p in runs.rglob("*") if p.is_file())

        flag.touch()  # the disk is full from now on
        saves = {
            "save_state": lambda: tc.save_state("full-state").result(),
            "save_weights_for_sampler": lambda: tc.save_weights_for_sampler(
                "full-sampler"
            ).result(),
            "save_weights_external": lambda: tc.save_weights_external("full-export").result(),
        }
        for name, save in saves.items():
            try:
                save()
            except tinker.RequestFailedError as exc:
                assert "disk is full" in str(exc), (name, exc)
            else:
                raise AssertionError(f"{name} succeeded on a full disk")
        assert sorted(p for p in runs.rglob("*") if p.is_file()) == files_before
        rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
        assert rest.list_checkpoints(tc.model_id).result().checkpoints == []

        flag.unlink()  # room again: the same saves succeed
        assert tc.save_state("state").result().path.endswith("/weights/state")
        assert tc.save_weights_external("export").result().path.endswith("/external_weights/export")
    finally:
        server.stop()
