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
        tmp_path,
        streams=3,
        n=2,
        max_tokens=2000,
        sdk_calls=2,
        sdk_timeout_s=2.0,
        log=lambda _m: None,
    )
    # (generous bounds for a busy CI machine; before, the SDK samples ran all 1,500 tokens)
    assert 0 < out["hangup_metered_tokens"] < out["hangup_max_tokens"] / 4
    # each abandoned call was still running when its grace ran out, and was cancelled
    assert out["abandoned_cancelled"] == 2
    assert 0 < out["sdk_metered_tokens"] < out["sdk_max_tokens"]
