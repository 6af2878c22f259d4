"""Unpublishing a checkpoint makes it private again for sampling clients another tenant already
holds, not only for new ones: every sample request re-checks publication, so tenant B cannot
keep reading tenant A's weights through a client made while they were public."""

from __future__ import annotations

import pytest
import tinker
from tinker import types

from tests.server.conftest import KEY_A, sl_datum

PROMPT = types.ModelInput.from_ints([5, 6, 7, 8])


def test_unpublish_stops_an_existing_foreign_sampling_client(
    server, client_a, client_b, base_model
):
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4).result()
    tc.forward_backward([sl_datum([5, 6, 7, 8, 9])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = tc.save_weights_for_sampler("shared").result().path
    rest_a = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)

    rest_a.publish_checkpoint_from_tinker_path(path).result()
    theirs = client_b.create_sampling_client(model_path=path).result()
    published = theirs.compute_logprobs(PROMPT).result()

    rest_a.unpublish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.RequestFailedError, match="not published any more"):
        theirs.compute_logprobs(PROMPT).result()
    # the owner's own client is unaffected
    mine = client_a.create_sampling_client(model_path=path).result()
    assert mine.compute_logprobs(PROMPT).result() == published

    rest_a.publish_checkpoint_from_tinker_path(path).result()
    assert theirs.compute_logprobs(PROMPT).result() == published
