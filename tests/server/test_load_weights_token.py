"""`create_training_client_from_state(..., weights_access_token=...)` is refused naming the
field, as `copy_weights` refuses it, rather than accepted and ignored: this server has no access
tokens, so a token must not look as if it had granted anything. Nothing is created."""

from __future__ import annotations

import pytest
import tinker
from tinker import types

from tests.server.conftest import KEY_A, sl_datum


def test_weights_access_token_is_refused_and_creates_nothing(server, client_a, base_model):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4).result()
    tc.forward_backward([sl_datum([3, 4, 5, 6])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    state = tc.save_state("token").result().path
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    before = rest.list_training_runs(limit=1000).result().cursor.total_count

    with pytest.raises(tinker.BadRequestError, match="weights_access_token"):
        client_a.create_training_client_from_state(state, weights_access_token="tok").result()
    assert rest.list_training_runs(limit=1000).result().cursor.total_count == before

    # without a token the same load works, and the session's later creates are unaffected
    again = client_a.create_training_client_from_state(state).result()
    assert again.forward([sl_datum([3, 4, 5, 6])], "cross_entropy").result().metrics
