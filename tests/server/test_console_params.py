"""The console's query parameters are bounded before they reach SQLite: a step past 64 bits
was an OverflowError there, answered 500; it is a 400 naming the parameter and its value."""

from __future__ import annotations

import httpx

from lorafleet.server.console.routes import CONSOLE_API
from lorafleet.server.main import ServerThread
from tests.server.conftest import KEY_A, connect


def test_after_step_out_of_range_is_a_400(server: ServerThread):
    sc = connect(server, KEY_A)
    try:
        run = sc.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=9).result()
        with httpx.Client(base_url=server.base_url) as client:
            assert client.post(f"{CONSOLE_API}/session", json={"key": KEY_A}).status_code == 200
            url = f"{CONSOLE_API}/runs/{run.model_id}"
            for bad in ("99999999999999999999999", "-2", "1.5", "x"):
                r = client.get(url, params={"after_step": bad})
                assert r.status_code == 400, (bad, r.text)
                assert "after_step" in r.json()["error"] and bad in r.json()["error"]
            assert client.get(url, params={"after_step": "3"}).status_code == 200
    finally:
        sc.close("success").result(timeout=30)
