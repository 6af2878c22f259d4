"""`copy_weights`' `destination_project_id` becomes the new session's project id, stored and
shown again in every session search and storage-usage row, so it is bounded like the project id
`create_session` accepts: an oversized one is refused naming the field, and nothing is copied."""

from __future__ import annotations

import httpx
import tinker

from lorafleet.server.http.schemas import MAX_LABEL_CHARS
from tests.server.conftest import KEY_A, sl_datum


def test_oversized_destination_project_is_refused_and_copies_nothing(server, client_a, base_model):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4).result()
    tc.forward_backward([sl_datum([3, 4, 5, 6])], "cross_entropy").result()
    state = tc.save_state("bounded").result().path
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    before = rest.list_training_runs(limit=1000).result().cursor.total_count

    reply = httpx.post(
        f"{server.base_url}/api/v1/copy_weights",
        json={"source_path": state, "destination_project_id": "p" * (MAX_LABEL_CHARS + 1)},
        headers={"X-API-Key": KEY_A},
    )
    assert reply.status_code == 400, reply.text
    assert "destination_project_id" in reply.json()["error"]
    assert rest.list_training_runs(limit=1000).result().cursor.total_count == before

    ok = rest.copy_weights(state, "p" * MAX_LABEL_CHARS).result()
    assert ok.endswith("/weights/bounded")
    assert any(
        item.project_id == "p" * MAX_LABEL_CHARS
        for item in rest.get_current_checkpoint_storage_usage().result().data
    )
