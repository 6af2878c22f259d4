"""Issue 34, item 10: dropped OpenAI streams and abandoned SDK samples stop at once (the
streams) or after the long-poll's grace (the SDK), charged for what they produced."""

from __future__ import annotations

import dataclasses

from lorafleet.server.config import ServerConfig
from tests.reliability import hangup


def test_dropped_streams_and_abandoned_sdk_samples_stop(tmp_path, monkeypatch):
    real = hangup.server_config

    def short_grace(*args, **kwargs) -> ServerConfig:
        return dataclasses.replace(real(*args, **kwargs), abandon_grace_s=0.5)

    monkeypatch.setattr(hangup, "server_config", short_grace)
    out = hangup.run_hangup(
        tmp_path, streams=3, n=2, max_tokens=1500, sdk_calls=2, log=lambda _m: None
    )
    # (generous bounds: a busy CI machine; before, each ran all 1,500 tokens)
    assert 0 < out["hangup_metered_tokens"] < out["hangup_max_tokens"] / 4
    assert 0 < out["sdk_metered_tokens"] < out["sdk_max_tokens"] / 2
    assert out["abandoned_cancelled"] == 2
