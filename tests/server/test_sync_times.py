"""`/api/v1/lorafleet/stats` counts the seconds spent putting trainer slots into the sampler
(sync and canary), so an RL loop's `sync_share` can be read from outside (bench/rollout.py)."""

from __future__ import annotations

import httpx

from tests.server.conftest import KEY_B, trained


def _sync(server) -> dict:
    response = httpx.get(
        f"{server.base_url}/api/v1/lorafleet/stats", headers={"X-API-Key": KEY_B}, timeout=30
    )
    response.raise_for_status()
    return response.json()["sampler_sync"]


def test_every_published_version_adds_its_sync_and_canary_seconds(client_b, base_model, server):
    tc = trained(client_b, base_model, seed=41)
    before = _sync(server)
    tc.save_weights_and_get_sampling_client()
    tc.save_weights_for_sampler("sync-times").result()
    after = _sync(server)
    assert after["versions"] == before["versions"] + 2
    assert after["failed"] == before["failed"]
    assert after["last_s"] > 0.0
    assert after["seconds"] >= before["seconds"] + after["last_s"]
