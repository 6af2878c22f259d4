"""A run with more checkpoints than the console lists shows its newest ones, not the first it
saved (a run's listing is oldest first, and a long run saving every few steps passed the
bound with its latest checkpoints out of view, where no TTL could be set on them)."""

from __future__ import annotations

import pytest

from lorafleet.server.console import views as console_views
from lorafleet.server.main import ServerThread
from tests.server.conftest import KEY_A, TRAIN_DATA, connect


def test_the_newest_checkpoints_are_listed(server: ServerThread, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(console_views, "MAX_CHECKPOINTS", 2)
    sc = connect(server, KEY_A)
    try:
        tc = sc.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=11).result()
        tc.forward_backward(TRAIN_DATA, "cross_entropy").result()
        saved = [tc.save_weights_for_sampler(f"many-{i}").result().path for i in range(3)]
        tenant = server.service.authenticate(KEY_A)
        listed = server.service.console.views.checkpoints(tenant, tc.model_id)
        assert [c["tinker_path"] for c in listed] == saved[1:]
        assert all(c["downloadable"] and c["created_at_s"] for c in listed)
    finally:
        sc.close("success").result(timeout=30)
