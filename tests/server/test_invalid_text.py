"""Issue 34, item 6: a string that is not valid Unicode (a lone UTF-16 surrogate, which JSON can
spell as "\\ud800") is a 400 naming its field on every route a string enters, never a 500 from
the tokenizer or SQLite; a surrogate *pair* (an emoji escaped as two halves) is ordinary text."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from lorafleet.server.http.text_check import invalid_text_field
from tests.server.conftest import KEY_A

LONE = "x\ud800y"
CASES: list[tuple[str, str, dict[str, Any], str]] = [
    ("POST", "/v1/completions", {"model": "m", "prompt": LONE, "max_tokens": 1}, "prompt"),
    (
        "POST",
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": LONE}], "max_tokens": 1},
        "messages[0].content",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
        "messages[0].content[0].text",
    ),
    ("POST", "/v1/completions", {"model": LONE, "prompt": "hi"}, "model"),
    ("PUT", "/api/v1/lorafleet/aliases/mine", {"target": LONE}, "target"),
    ("POST", "/api/v1/weights_info", {"tinker_path": f"tinker://{LONE}/weights/a"}, "tinker_path"),
    ("POST", "/api/v1/retrieve_future", {"request_id": LONE}, "request_id"),
    ("POST", "/api/v1/copy_weights", {"source_path": LONE}, "source_path"),
    (
        "POST",
        "/api/v1/create_session",
        {"tags": [], "user_metadata": {"k": LONE}, "sdk_version": "0.38.0"},
        "user_metadata.k",
    ),
    ("POST", "/api/v1/create_session", {"tags": [LONE], "sdk_version": "0.38.0"}, "tags[0]"),
    ("POST", "/api/v1/sessions/search", {"project_id": LONE}, "project_id"),
    (
        "POST",
        "/api/v1/asample",
        {
            "sampling_session_id": "s",
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
            "sampling_params": {"max_tokens": 1, "stop": [LONE]},
            "num_samples": 1,
        },
        "sampling_params.stop[0]",
    ),
    ("POST", "/console/api/session", {"key": LONE}, "key"),
]


def _raw(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: the surrogate goes out as "\ud800"


@pytest.mark.parametrize(("method", "path", "body", "field"), CASES)
def test_a_lone_surrogate_is_a_400_naming_the_field(server, method, path, body, field):
    raw = _raw(body)
    assert b"\\ud800" in raw
    headers = {"X-API-Key": KEY_A, "Authorization": f"Bearer {KEY_A}"}
    headers["Content-Type"] = "application/json"
    answer = httpx.request(method, f"{server.base_url}{path}", content=raw, headers=headers)
    assert answer.status_code == 400, (path, answer.status_code, answer.text)
    text = answer.text
    assert field in text and "not valid Unicode" in text, text
    if path.startswith("/v1/"):
        assert answer.json()["error"]["param"] == field


def test_a_surrogate_pair_is_text(server):
    """An emoji escaped as its two UTF-16 halves is one valid character."""
    body = {"model": "nope-model", "prompt": "hi \ud83d\ude00", "max_tokens": 1}
    raw = json.dumps(body).encode()
    assert b"\\ud83d\\ude00" in raw
    answer = httpx.post(
        f"{server.base_url}/v1/completions",
        content=raw,
        headers={"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"},
    )
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "model"


def test_the_walk_names_nested_fields_and_keys():
    assert invalid_text_field({"a": [{"b": "ok"}, {"c": LONE}]}) == "a[1].c"
    assert invalid_text_field([LONE]) == "[0]"
    assert invalid_text_field({"ok": "\U0001f600"}) is None
    assert invalid_text_field({"m": {LONE: 1}}) == "m.? (a key)"
