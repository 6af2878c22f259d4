"""The RestClient surface of SDK 0.38 beyond listing: publish/unpublish (and what another tenant
may do with a published checkpoint), copy_weights, the session routes (get, list, search,
project, trace export), checkpoint storage usage, and the project/access_scope filters."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import warnings
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.server.conftest import (
    KEY_A,
    KEY_B,
    forward_logprobs,
    trained,
)

PROMPT = types.ModelInput.from_ints([10, 20, 30, 40])


def _rest(server, key: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=server.base_url, api_key=key)


def _session_id(tc: tinker.TrainingClient) -> str:
    return tc.model_id.split(":train:")[0]


def _checkpoint(rc: tinker.RestClient, run_id: str, checkpoint_id: str) -> types.Checkpoint:
    (found,) = [
        c
        for c in rc.list_checkpoints(run_id).result().checkpoints
        if c.checkpoint_id == checkpoint_id
    ]
    return found


def test_publish_shares_weights_but_not_the_optimizer(server, client_a, client_b, base_model):
    rc_a, rc_b = _rest(server, KEY_A), _rest(server, KEY_B)
    tc = trained(client_a, base_model, seed=11)
    state = tc.save_state("shared").result().path
    sampler = tc.save_weights_for_sampler("shared").result().path
    for path in (state, sampler):
        with pytest.raises(tinker.NotFoundError):  # private: another tenant sees nothing
            client_b.create_training_client_from_state(path).result()
    assert tc.model_id not in [
        r.training_run_id
        for r in rc_b.list_training_runs(limit=1000, access_scope="accessible")
        .result()
        .training_runs
    ]

    with pytest.raises(tinker.NotFoundError):  # only the owner publishes
        rc_b.publish_checkpoint_from_tinker_path(state).result()
    rc_a.publish_checkpoint_from_tinker_path(state).result()
    rc_a.publish_checkpoint_from_tinker_path(state).result()  # idempotent (a retry)
    rc_a.publish_checkpoint_from_tinker_path(sampler).result()
    assert _checkpoint(rc_a, tc.model_id, "weights/shared").public
    assert _checkpoint(rc_a, tc.model_id, "sampler_weights/shared").public

    # B: weights only. A run from the state has A's weights; the optimizer state is refused.
    from_state = client_b.create_training_client_from_state(state).result()
    for ours, theirs in zip(forward_logprobs(tc), forward_logprobs(from_state), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    with pytest.raises(tinker.PermissionDeniedError, match="weights only"):
        client_b.create_training_client_from_state_with_optimizer(state).result()
    sampled_b = client_b.create_sampling_client(model_path=sampler)
    sampled_a = client_a.create_sampling_client(model_path=sampler)
    params = types.SamplingParams(max_tokens=4, temperature=0.0)
    seq_b = sampled_b.sample(PROMPT, 1, params).result().sequences[0]
    seq_a = sampled_a.sample(PROMPT, 1, params).result().sequences[0]
    assert seq_b.tokens == seq_a.tokens
    assert rc_b.get_weights_info_by_tinker_path(state).result().lora_rank == 8

    # B sees the run under "accessible", with its published checkpoints only
    accessible = rc_b.list_training_runs(limit=1000, access_scope="accessible").result()
    assert tc.model_id in [r.training_run_id for r in accessible.training_runs]
    owned = rc_b.list_training_runs(limit=1000).result()
    assert tc.model_id not in [r.training_run_id for r in owned.training_runs]
    tc.save_state("private-later").result()  # newer, unpublished: not shown to B
    seen_by_b = rc_b.get_training_run(tc.model_id, access_scope="accessible").result()
    assert seen_by_b.last_checkpoint.checkpoint_id == "weights/shared"
    assert seen_by_b.last_sampler_checkpoint.checkpoint_id == "sampler_weights/shared"
    seen_by_a = rc_a.get_training_run(tc.model_id).result()
    assert seen_by_a.last_checkpoint.checkpoint_id == "weights/private-later"
    with pytest.raises(tinker.NotFoundError):
        rc_b.get_training_run(tc.model_id).result()
    with pytest.raises(tinker.NotFoundError):  # B cannot delete it
        rc_b.delete_checkpoint_from_tinker_path(state).result()

    rc_a.unpublish_checkpoint_from_tinker_path(state).result()
    assert not _checkpoint(rc_a, tc.model_id, "weights/shared").public
    with pytest.raises(tinker.NotFoundError):
        client_b.create_training_client_from_state(state).result()
    assert [c.checkpoint_id for c in rc_b.list_checkpoints(tc.model_id).result().checkpoints] == [
        "sampler_weights/shared"
    ]
    rc_a.unpublish_checkpoint_from_tinker_path(sampler).result()
    with pytest.raises(tinker.NotFoundError):
        rc_b.list_checkpoints(tc.model_id).result()
    # the owner's checkpoint is untouched by all this
    assert forward_logprobs(client_a.create_training_client_from_state(state).result())[
        0
    ].shape == (9,)


def test_copy_weights_into_a_project(server, client_a, client_b, base_model):
    rc_a, rc_b = _rest(server, KEY_A), _rest(server, KEY_B)
    tc = trained(client_a, base_model, seed=12)
    state = tc.save_state("to-copy", user_metadata={"k": "v"}).result().path
    sampler = tc.save_weights_for_sampler("to-copy").result().path

    copy = rc_a.copy_weights(state, "archive-proj", ttl_seconds=7200).result()
    assert copy.startswith("tinker://") and copy.endswith("/weights/to-copy") and copy != state
    run_id = copy.split("/")[2]
    listed = _checkpoint(rc_a, run_id, "weights/to-copy")
    assert listed.user_metadata == {"k": "v"} and listed.expires_at is not None
    in_project = rc_a.list_training_runs(limit=1000, project_id="archive-proj").result()
    assert [r.training_run_id for r in in_project.training_runs] == [run_id]

    # the copy is its own files: deleting the source leaves it loadable, with the same weights
    before = forward_logprobs(client_a.create_training_client_from_state(state).result())
    rc_a.delete_checkpoint_from_tinker_path(state).result()
    for x, y in zip(
        before,
        forward_logprobs(client_a.create_training_client_from_state(copy).result()),
        strict=True,
    ):
        np.testing.assert_array_equal(x, y)

    # another tenant: nothing private, and not a published training state (its optimizer)
    with pytest.raises(tinker.NotFoundError):
        rc_b.copy_weights(sampler, "b-proj").result()
    rc_a.publish_checkpoint_from_tinker_path(sampler).result()
    b_copy = rc_b.copy_weights(sampler, "b-proj").result()
    assert _checkpoint(rc_b, b_copy.split("/")[2], "sampler_weights/to-copy").public is False
    seq = client_b.create_sampling_client(model_path=b_copy).sample(
        PROMPT, 1, types.SamplingParams(max_tokens=3, temperature=0.0)
    )
    assert len(seq.result().sequences[0].tokens) == 3
    state2 = tc.save_state("to-copy-2").result().path
    rc_a.publish_checkpoint_from_tinker_path(state2).result()
    with pytest.raises(tinker.PermissionDeniedError, match="optimizer state"):
        rc_b.copy_weights(state2, "b-proj").result()
    with pytest.raises(tinker.BadRequestError, match="weights_access_token"):
        rc_b.copy_weights(sampler, "b-proj", weights_access_token="secret").result()


def test_copy_weights_into_a_session_slot_and_its_retry(server, client_a, base_model):
    """The request's other form (session_id + model_seq_id), which RestClient.copy_weights
    cannot send, over raw HTTP; and a retry with the same idempotency key gets the same copy."""
    tc = trained(client_a, base_model, seed=15)
    sampler = tc.save_weights_for_sampler("slot").result().path
    sid = _session_id(tc)
    url = f"{server.base_url}/api/v1/copy_weights"
    headers = {"X-API-Key": KEY_A, "X-Idempotency-Key": "copy-retry-1"}
    body = {"source_path": sampler, "session_id": sid, "model_seq_id": 7}
    first = httpx.post(url, json=body, headers=headers, timeout=30)
    assert first.status_code == 200, first.text
    assert first.json() == {"tinker_path": f"tinker://{sid}:train:7/sampler_weights/slot"}
    again = httpx.post(url, json=body, headers=headers, timeout=30)
    assert again.json() == first.json()
    taken = httpx.post(url, json=body, headers={"X-API-Key": KEY_A}, timeout=30)
    assert taken.status_code == 400 and "already exists" in taken.json()["error"]
    neither = httpx.post(url, json={"source_path": sampler}, headers={"X-API-Key": KEY_A})
    assert neither.status_code == 400 and "destination_project_id" in neither.json()["error"]
    external = tc.save_weights_external("x").result().path
    with pytest.raises(tinker.BadRequestError, match="only training"):
        _rest(server, KEY_A).publish_checkpoint_from_tinker_path(external).result()


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


def test_sessions_get_list_search_project_and_trace(server, client_a, client_b, base_model):
    rc_a, rc_b = _rest(server, KEY_A), _rest(server, KEY_B)
    tc = trained(client_a, base_model, seed=13)
    sampling = tc.save_weights_and_get_sampling_client()
    sampling.sample(PROMPT, 1, types.SamplingParams(max_tokens=2)).result()
    sid = _session_id(tc)

    got = rc_a.get_session(sid).result()
    assert tc.model_id in got.training_run_ids
    assert any(s.startswith(f"{sid}:sample:") for s in got.sampler_ids)
    assert sid in rc_a.list_sessions(limit=1000).result().sessions
    assert sid not in rc_b.list_sessions(limit=1000).result().sessions
    with pytest.raises(tinker.NotFoundError):
        rc_b.get_session(sid).result()
    with pytest.raises(tinker.NotFoundError):
        rc_b.assign_session_project(sid, "stolen").result()

    rc_a.assign_session_project(sid, "proj-h7").result()
    runs = rc_a.list_training_runs(limit=1000, project_id="proj-h7").result().training_runs
    assert [r.training_run_id for r in runs] == [tc.model_id]
    with pytest.raises(tinker.BadRequestError, match="project_id"):
        rc_a.assign_session_project(sid, "").result()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tinker.ExperimentalWarning)
        found = rc_a.search_sessions(types.SessionSearchRequest(project_ids=["proj-h7"])).result()
        assert [s.session_id for s in found.sessions] == [sid]
        summary = found.sessions[0]
        assert summary.project_id == "proj-h7" and summary.status.type == "active"
        assert summary.checkpoints_count == 0 and summary.owner
        assert (
            not rc_b.search_sessions(types.SessionSearchRequest(project_ids=["proj-h7"]))
            .result()
            .sessions
        )
        # paging: one at a time, newest first, every session once
        seen, request = [], types.SessionSearchRequest(limit=1)
        while True:
            page = rc_a.search_sessions(request).result()
            seen += [s.session_id for s in page.sessions]
            if page.next_cursor is None:
                break
            request = request.model_copy(update={"cursor": page.next_cursor})
        assert sid in seen and len(seen) == len(set(seen))
        assert seen == rc_a.list_sessions(limit=1000).result().sessions

    url = rc_a.export_session_trace(sid).result()
    trace = json.loads(_fetch(url))
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"create_model", "forward_backward", "optim_step", "sample"} <= names
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    with pytest.raises(urllib.error.HTTPError) as denied:
        _fetch(urlunsplit(parts._replace(query=urlencode({**query, "sig": "0" * 64}))))
    assert denied.value.code == 403
    with pytest.raises(tinker.NotFoundError):
        rc_b.export_session_trace(sid).result()


def test_checkpoint_storage_usage_counts_the_tenants_bytes(server, client_a, base_model):
    admin = tinker.AdminClient(base_url=server.base_url, api_key=KEY_A)
    rc = _rest(server, KEY_A)
    tc = trained(client_a, base_model, seed=14)
    rc.assign_session_project(_session_id(tc), "usage-proj").result()
    tc.save_state("u1").result()
    tc.save_weights_for_sampler("u1").result()

    usage = admin.get_current_checkpoint_storage_usage(project_id="usage-proj").result()
    (item,) = usage.data
    listed = rc.list_checkpoints(tc.model_id).result().checkpoints
    assert item.project_id == "usage-proj" and item.checkpoint_count == 2
    assert item.size_bytes == sum(c.size_bytes for c in listed) > 0
    total = admin.get_current_checkpoint_storage_usage().result()
    everything = rc.list_user_checkpoints(limit=1000).result().checkpoints
    assert sum(i.size_bytes for i in total.data) == sum(c.size_bytes or 0 for c in everything)
