"""Every request's cost is bounded before work starts: sample responses (their estimated wire
size), top-k lists, user_metadata and listing pages, each refused with an error that names the
field, the value and the limit, and the caps are stated in the server's capabilities."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from lorafleet.server.config import ServerConfig
from lorafleet.server.main import ServerThread
from tests.server.conftest import KEY_A

DEFAULTS = ServerConfig(base_model="x", data_dir=Path("x"), api_keys=[])
PROMPT = types.ModelInput.from_ints([5, 6, 7, 8])


def _limits(server: ServerThread) -> dict[str, int]:
    reply = httpx.get(
        f"{server.base_url}/api/v1/get_server_capabilities",
        headers={"X-API-Key": KEY_A},
        timeout=30,
    )
    assert reply.status_code == 200
    return reply.json()["lorafleet_limits"]


def _sample_batches(server: ServerThread) -> int:
    return server.service.scheduler.stats.batches["sample"]


def test_the_caps_are_in_the_capabilities_and_the_sdk_still_reads_them(server, client_a):
    limits = _limits(server)
    assert limits["max_response_bytes"] == DEFAULTS.max_response_bytes
    assert limits["max_topk_logprobs"] == DEFAULTS.max_topk_logprobs
    assert limits["max_num_samples"] == DEFAULTS.max_num_samples
    assert limits["max_metadata_keys"] == 64 and limits["max_metadata_bytes"] == 4096
    assert limits["max_page"] == 1000
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    caps = rest.get_server_capabilities().result(timeout=60)  # the SDK ignores extra keys
    assert caps.supported_models and caps.supported_models[0].max_context_length


@pytest.mark.parametrize("field", ["topk_sample_logprobs", "topk_prompt_logprobs"])
def test_top_k_over_the_cap_is_refused_before_sampling(server, client_a, base_model, field):
    sampler = client_a.create_sampling_client(base_model=base_model).result(timeout=60)
    cap = _limits(server)["max_topk_logprobs"]
    params = types.SamplingParams(max_tokens=2, seed=1)
    ok = sampler.sample(PROMPT, 1, params, **{field: cap}).result(timeout=120)
    assert len(ok.sequences) == 1  # the cap itself is allowed
    before = _sample_batches(server)
    with pytest.raises(tinker.RequestFailedError) as caught:
        sampler.sample(PROMPT, 1, params, **{field: cap + 1}).result(timeout=120)
    message = str(caught.value)
    assert field in message and str(cap + 1) in message and f"at most {cap}" in message
    assert _sample_batches(server) == before  # nothing reached the sampler


def test_a_response_over_the_byte_cap_is_refused_before_sampling(server, client_a, base_model):
    sampler = client_a.create_sampling_client(base_model=base_model).result(timeout=60)
    limit = _limits(server)["max_response_bytes"]
    before = _sample_batches(server)
    big = types.SamplingParams(max_tokens=2000, seed=1)
    with pytest.raises(tinker.RequestFailedError) as caught:
        sampler.sample(PROMPT, 600, big, topk_sample_logprobs=1).result(timeout=120)
    message = str(caught.value)
    assert "num_samples 600" in message and "max_tokens 2000" in message
    assert "topk_sample_logprobs 1" in message and str(limit) in message
    # max_tokens left unset counts as the rest of the context
    with pytest.raises(tinker.RequestFailedError, match="unset: the rest of the context"):
        sampler.sample(PROMPT, 1024, types.SamplingParams(seed=1)).result(timeout=120)
    assert _sample_batches(server) == before


def test_user_metadata_over_its_caps_is_refused_and_creates_nothing(server, client_a, base_model):
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    runs_before = rest.list_training_runs(limit=1000).result(timeout=60).cursor.total_count
    too_many = {f"k{i}": "v" for i in range(65)}
    too_big = {"note": "x" * 4096}
    for metadata, value, limit in (
        (too_many, "has 65 keys", "limit of 64"),
        (too_big, "is 4108 bytes as JSON", "limit of 4096"),
    ):
        with pytest.raises(tinker.BadRequestError) as caught:
            client_a.create_lora_training_client(
                base_model=base_model, rank=4, user_metadata=metadata
            ).result(timeout=60)
        message = str(caught.value)
        assert "user_metadata" in message and value in message and limit in message
    assert rest.list_training_runs(limit=1000).result(timeout=60).cursor.total_count == runs_before

    # a save holds a seq_id in its model's order: its error fails the future, and the model's
    # next request runs (a 400 at the door would leave a gap the next one waits on)
    training = client_a.create_lora_training_client(base_model=base_model, rank=4).result(
        timeout=60
    )
    with pytest.raises(tinker.RequestFailedError, match="user_metadata has 65 keys"):
        training.save_state("caps-meta", user_metadata=too_many).result(timeout=120)
    path = training.save_state("caps-meta", user_metadata={"ok": "yes"}).result(timeout=120).path
    listed = rest.list_checkpoints(training.model_id).result(timeout=60).checkpoints
    assert [c.user_metadata for c in listed if c.tinker_path == path] == [{"ok": "yes"}]


def test_a_session_with_oversized_metadata_or_tags_is_refused(server, base_model):
    service = tinker.ServiceClient(
        base_url=server.base_url, api_key=KEY_A, user_metadata={"note": "y" * 5000}
    )
    try:
        with pytest.raises(tinker.BadRequestError, match="user_metadata: Value error, is 50"):
            service.create_lora_training_client(base_model=base_model, rank=4).result(timeout=60)
    finally:
        service.close("success")
    # tags ride in the session row too (TINKER_TAGS): their number and length are bounded
    for tags, problem in ((["t"] * 65, "at most 64 items"), (["z" * 1025], "at most 1024 char")):
        reply = httpx.post(
            f"{server.base_url}/api/v1/create_session",
            json={"tags": tags, "sdk_version": "0.38.0", "type": "create_session"},
            headers={"X-API-Key": KEY_A},
            timeout=30,
        )
        assert reply.status_code == 400 and "tags" in reply.text and problem in reply.text


def test_a_listing_page_over_the_cap_is_refused_with_the_limit(server, client_a):
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    with pytest.raises(tinker.BadRequestError, match=r"limit must be in \[1, 1000\].*limit=1001"):
        rest.list_training_runs(limit=1001).result(timeout=60)
    assert rest.list_training_runs(limit=1000).result(timeout=60).cursor.limit == 1000
