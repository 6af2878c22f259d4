"""`RestClient.list_user_checkpoints` lists newest first, as SDK 0.38 documents ("sorted by
time (newest first)"): its first page, and `tinker checkpoint list --limit N`, which reads only
that page, must show the latest checkpoints, not the oldest. One run's listing
(`list_checkpoints`, which the SDK cannot page) keeps the order the checkpoints were saved in."""

from __future__ import annotations

import tinker
from tinker import types

from tests.server.conftest import KEY_A, sl_datum


def test_user_checkpoints_newest_first_and_paged(server, client_a, base_model):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4).result()
    tc.forward_backward([sl_datum([3, 4, 5, 6])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    saved = [tc.save_state(f"order-{i}").result().path for i in range(3)]

    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    first = rest.list_user_checkpoints(limit=2).result()
    assert [c.tinker_path for c in first.checkpoints] == [saved[2], saved[1]]
    times = [c.time for c in first.checkpoints]
    assert times == sorted(times, reverse=True)
    second = rest.list_user_checkpoints(limit=2, offset=2).result()
    assert second.checkpoints[0].tinker_path == saved[0]

    in_run = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.tinker_path for c in in_run] == saved
