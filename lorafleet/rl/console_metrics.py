"""`lorafleet rl` posts each step's rewards to its server's run-metrics endpoint, so the web
console draws them beside the server's own loss curve (docs/console.md).

A post that fails does not stop training: the step's metrics are in `metrics.jsonl` either way.
The first failure is logged with its reason and posting stops for that run (a server that is
not lorafleet, a Tinker service say, has no such endpoint; retrying every step would only
repeat the warning)."""

from __future__ import annotations

import logging
import math
from typing import Any
from urllib.parse import quote

import httpx

log = logging.getLogger(__name__)

POSTED = (
    "reward_mean",
    "reward_std",
    "tag_rate",
    "loss_per_token",
    "eval_accuracy",  # held-out rows (rl/evaluation.py)
    "eval_reward",
)
TIMEOUT_S = 10.0


class RewardPoster:
    def __init__(self, base_url: str, api_key: str, tenant: str):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.tenant = tenant
        self.stopped: str | None = None  # why posting stopped

    def post(self, model_id: str, row: dict[str, Any]) -> bool:
        """Posts the row's POSTED values at its step; False once posting has stopped."""
        if self.stopped is not None:
            return False
        points = [
            {"name": name, "step": int(row["step"]), "value": float(row[name])}
            for name in POSTED
            if isinstance(row.get(name), int | float) and math.isfinite(row[name])
        ]
        if not points:
            return True
        url = f"{self.base_url}/api/v1/lorafleet/runs/{quote(model_id, safe=':')}/metrics"
        try:
            response = httpx.post(
                url, json={"points": points}, headers={"X-API-Key": self.api_key}, timeout=TIMEOUT_S
            )
        except httpx.HTTPError as exc:
            return self._stop(f"{type(exc).__name__}: {exc}")
        if response.status_code != 200:
            return self._stop(f"HTTP {response.status_code}: {response.text[:200]}")
        return True

    def _stop(self, reason: str) -> bool:
        self.stopped = reason
        log.warning(
            "tenant %s: posting rewards to the console stopped (%s); metrics.jsonl has them",
            self.tenant,
            reason,
        )
        return False
