"""The OpenAI-compatible routes through the official `openai` package, against the session's
tiny-qwen3 server (conftest) and one adapter trained a step through the `tinker` SDK: the same
tokens and log-probs as the Tinker `sample` route for the same seed and greedy settings, tenant
isolation (404 model_not_found, 401), fields refused by name, aliases, n > 1, stop, streaming."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tinker
from tinker import types

from lorafleet.server.main import ServerThread
from lorafleet.server.openai.errors import OpenAIError
from lorafleet.server.openai.service import Completions, StreamHook
from lorafleet.server.openai.text import Text
from lorafleet.server.ops.intake import Promise
from lorafleet.server.state.keys import hash_key, tenant_id
from tests.server.conftest import KEY_A, KEY_B, connect, trained

PROMPT = [5, 17, 33, 60, 91, 120, 200, 7, 44]
ALIASES = "/api/v1/lorafleet/aliases"


@pytest.fixture(scope="module")
def adapter(server: ServerThread) -> dict[str, Any]:
    """Tenant A's sampler path of a run one step into training, its Tinker sampling client and
    the served base's name."""
    sc = connect(server, KEY_A)
    base = server.service.served.names[0]
    tc = trained(sc, base, seed=11)
    path = tc.save_weights_for_sampler("openai-a").result().path
    yield {
        "path": path,
        "tinker": sc.create_sampling_client(model_path=path).result(timeout=60),
        "base": base,
    }
    sc.close("success").result(timeout=30)


def client(server: ServerThread, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def tinker_sample(
    sampler: tinker.SamplingClient, prompt: list[int], n: int = 1, **params: Any
) -> list[types.SampledSequence]:
    out = sampler.sample(
        types.ModelInput.from_ints(prompt), n, types.SamplingParams(**params)
    ).result()
    return list(out.sequences)


def tokenizer(server: ServerThread) -> Any:
    return server.service.completions.text.tokenizer()


def test_completion_equals_tinker_sample(server: ServerThread, adapter: dict[str, Any]) -> None:
    out = client(server).completions.create(
        model=adapter["path"], prompt=PROMPT, max_tokens=12, temperature=0.0, logprobs=2
    )
    (ref,) = tinker_sample(adapter["tinker"], PROMPT, max_tokens=12, temperature=0.0)
    (choice,) = out.choices
    assert out.usage is not None and out.usage.completion_tokens == len(ref.tokens)
    assert out.usage.prompt_tokens == len(PROMPT)
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-6)
    assert choice.text == tokenizer(server).decode(ref.tokens, skip_special_tokens=True)
    assert choice.finish_reason == ("length" if ref.stop_reason == "length" else "stop")
    assert all(len(row) <= 2 for row in choice.logprobs.top_logprobs or [])
    # the adapter is used: the base answers otherwise
    base_out = client(server).completions.create(
        model=adapter["base"], prompt=PROMPT, max_tokens=12, temperature=0.0, logprobs=0
    )
    assert base_out.choices[0].logprobs is not None
    assert base_out.choices[0].logprobs.token_logprobs != pytest.approx(ref.logprobs, abs=1e-6)


def test_seeded_n_equals_tinker_sample(server: ServerThread, adapter: dict[str, Any]) -> None:
    out = client(server).completions.create(
        model=adapter["path"], prompt=PROMPT, max_tokens=10, temperature=1.0, seed=1234, n=3
    )
    refs = tinker_sample(adapter["tinker"], PROMPT, 3, max_tokens=10, temperature=1.0, seed=1234)
    tok = tokenizer(server)
    assert [c.text for c in out.choices] == [
        tok.decode(r.tokens, skip_special_tokens=True) for r in refs
    ]
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1  # the samples differ: n is honoured
    assert out.usage is not None
    assert out.usage.completion_tokens == sum(len(r.tokens) for r in refs)


def test_chat_equals_tinker_sample(server: ServerThread, adapter: dict[str, Any]) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    out = client(server).chat.completions.create(
        model=adapter["path"],
        messages=messages,
        max_completion_tokens=10,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
    )
    prompt = tokenizer(server).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    (ref,) = tinker_sample(adapter["tinker"], list(prompt), max_tokens=10, temperature=0.0)
    (choice,) = out.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer(server).decode(ref.tokens, skip_special_tokens=True)
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [e.logprob for e in choice.logprobs.content] == pytest.approx(ref.logprobs, abs=1e-6)
    assert all(len(e.top_logprobs) == 3 for e in choice.logprobs.content)
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt)


def test_stop_string_ends_text_before_it(server: ServerThread, adapter: dict[str, Any]) -> None:
    oai = client(server)
    full = oai.completions.create(
        model=adapter["path"], prompt=PROMPT, max_tokens=24, temperature=0.0
    ).choices[0]
    visible = full.text.strip("\ufffd")
    assert len(visible) >= 6, f"the greedy text is too short to test a stop on: {full.text!r}"
    stop = visible[3:5]
    cut = oai.completions.create(
        model=adapter["path"], prompt=PROMPT, max_tokens=24, temperature=0.0, stop=[stop, "\x00"]
    ).choices[0]
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.finish_reason == "stop"


def test_streams_increments_equal_to_the_whole(
    server: ServerThread, adapter: dict[str, Any]
) -> None:
    oai = client(server)
    whole = oai.completions.create(
        model=adapter["path"], prompt=PROMPT, max_tokens=24, temperature=0.0
    )
    chunks = list(
        oai.completions.create(
            model=adapter["path"],
            prompt=PROMPT,
            max_tokens=24,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    # tokens arrived while the sample ran, not only with the result
    assert sum(1 for c in text_chunks[:-1] if c.choices[0].text) >= 2
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_stream_n2_equals_non_streamed(server: ServerThread, adapter: dict[str, Any]) -> None:
    oai = client(server)
    ask: dict[str, Any] = {
        "model": adapter["path"],
        "messages": [{"role": "user", "content": "tell me"}],
        "max_tokens": 12,
        "seed": 99,
        "n": 2,
    }
    whole = oai.chat.completions.create(**ask)
    texts = ["", ""]
    finish: list[str | None] = [None, None]
    for chunk in oai.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]


def test_tenant_isolation_and_keys(server: ServerThread, adapter: dict[str, Any]) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client(server, KEY_B).completions.create(model=adapter["path"], prompt=PROMPT, max_tokens=2)
    assert err.value.code == "model_not_found" and err.value.param == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        client(server, KEY_A).completions.create(
            model=adapter["path"] + "x", prompt=PROMPT, max_tokens=2
        )
    assert missing.value.message == err.value.message.replace(
        adapter["path"], adapter["path"] + "x"
    )
    with pytest.raises(openai.AuthenticationError):
        client(server, "tml-wrong-key-0123456789").models.list()
    listed_b = [m.id for m in client(server, KEY_B).models.list()]
    assert adapter["path"] not in listed_b and adapter["base"] in listed_b
    listed_a = [m.id for m in client(server, KEY_A).models.list()]
    assert listed_a[0] == adapter["base"] and adapter["path"] in listed_a
    # X-API-Key works too, and the base answers by its served name
    reply = httpx.post(
        f"{server.base_url}/v1/completions",
        headers={"X-API-Key": KEY_B},
        json={"model": adapter["base"], "prompt": "hello", "max_tokens": 2},
    )
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("response_format", {"type": "json_object"}),
        ("logit_bias", {"5": 10}),
        ("presence_penalty", 0.5),
        ("n", 0),
        ("temperature", 3),
        ("top_logprobs", 2),
        ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        ("max_tokens", 10**9),
    ],
)
def test_bad_fields_are_named(
    server: ServerThread, adapter: dict[str, Any], field: str, value: Any
) -> None:
    body: dict[str, Any] = {
        "model": adapter["path"],
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        field: value,
    }
    reply = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY_A}"},
        json=body,
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] is not None and error["param"].startswith(
        "max_completion_tokens" if field == "max_tokens" else field
    )


def test_aliases(server: ServerThread, adapter: dict[str, Any]) -> None:
    a = httpx.Client(base_url=server.base_url, headers={"X-API-Key": KEY_A})
    b = httpx.Client(base_url=server.base_url, headers={"X-API-Key": KEY_B})
    assert a.put(f"{ALIASES}/my-model.v1", json={"target": adapter["path"]}).status_code == 200
    assert a.get(f"{ALIASES}/my-model.v1").json()["target"] == adapter["path"]
    assert a.put(f"{ALIASES}/bad name", json={"target": adapter["path"]}).status_code == 400
    assert a.put(f"{ALIASES}/{'x' * 65}", json={"target": adapter["path"]}).status_code == 400
    assert (
        a.put(f"{ALIASES}/ok", json={"target": "tinker://nope/sampler_weights/x"}).status_code
        == 404
    )
    # B cannot point an alias at A's path, nor see A's alias
    assert b.put(f"{ALIASES}/stolen", json={"target": adapter["path"]}).status_code == 404
    assert b.get(f"{ALIASES}/my-model.v1").status_code == 404
    via_alias = client(server).completions.create(
        model="my-model.v1", prompt=PROMPT, max_tokens=6, temperature=0.0
    )
    via_path = client(server).completions.create(
        model=adapter["path"], prompt=PROMPT, max_tokens=6, temperature=0.0
    )
    assert via_alias.choices[0].text == via_path.choices[0].text
    assert via_alias.model == "my-model.v1"
    models = {m.id for m in client(server).models.list()}
    assert "my-model.v1" in models
    with pytest.raises(openai.NotFoundError):
        client(server, KEY_B).completions.create(model="my-model.v1", prompt=PROMPT, max_tokens=2)
    assert a.delete(f"{ALIASES}/my-model.v1").status_code == 200
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="my-model.v1", prompt=PROMPT, max_tokens=2)


def test_stream_disconnect_leaves_server_working(
    server: ServerThread, adapter: dict[str, Any]
) -> None:
    body = {"model": adapter["path"], "prompt": PROMPT, "max_tokens": 40, "stream": True}
    with (
        httpx.Client(base_url=server.base_url, headers={"X-API-Key": KEY_A}) as http,
        http.stream("POST", "/v1/completions", json=body) as reply,
    ):
        assert reply.status_code == 200
        first = next(reply.iter_lines())
        assert first.startswith("data: {")
    # the disconnected request runs to its end; the next one is served as usual
    out = client(server).completions.create(
        model=adapter["path"], prompt=PROMPT, max_tokens=3, temperature=0.0
    )
    assert out.usage is not None and out.usage.completion_tokens >= 1


def test_no_chat_template_is_a_clear_400(server: ServerThread, tmp_path: Path) -> None:
    source = server.service.executor.base_path
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(source / name, tmp_path / name)
    with pytest.raises(OpenAIError, match="no chat template") as err:
        Text(tmp_path).chat([{"role": "user", "content": "hi"}], 1 << 20)
    assert err.value.param == "messages" and err.value.status == 400


def test_sse_format_and_metering(server: ServerThread, adapter: dict[str, Any]) -> None:
    """Raw server-sent events end with `data: [DONE]`; the tokens are metered to the tenant
    like the Tinker route's (the same intake and scheduler). Tenant B on the base: A may still
    have the disconnected stream of another test running."""
    tenant = tenant_id(hash_key(KEY_B))

    def sampled() -> float:
        totals = server.service.metering.totals(tenant)
        return sum(v for _t, _run, counter, v in totals if counter == "sampled_tokens")

    before = sampled()
    body = {
        "model": adapter["base"],
        "prompt": PROMPT,
        "max_tokens": 5,
        "temperature": 0.0,
        "stream": True,
    }
    reply = httpx.post(f"{server.base_url}/v1/completions", headers={"X-API-Key": KEY_B}, json=body)
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = [line for line in reply.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    whole = client(server, KEY_B).completions.create(**{**body, "stream": False})
    assert whole.usage is not None
    assert sampled() - before == 2 * whole.usage.completion_tokens


def test_stream_hook_goes_quiet_once_closed() -> None:
    loop = asyncio.new_event_loop()
    try:
        queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        hook = StreamHook(loop, queue)
        hook(1, 7)
        loop.run_until_complete(asyncio.sleep(0))
        assert queue.qsize() == 1 and queue.get_nowait() == (1, 7)
        hook.close()
        hook(0, 9)
        loop.run_until_complete(asyncio.sleep(0))
        assert queue.empty()
    finally:
        loop.close()


class _RecordingIntake:
    """Takes requests as the scheduler's intake would, keeping what it was given."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def submit(self, tenant: Any, op: Any, place: Any, fingerprint: str) -> Promise:
        self.sent.append(op)
        return Promise("recorded")


def with_features(server: ServerThread, intake: Any = None, **features: Any) -> Completions:
    """The server's OpenAI completions over a sampler that declares `features` instead."""
    mine = server.service.completions
    return Completions(
        intake or mine.intake,
        mine.futures,
        mine.models,
        mine.served,
        mine.text,
        1.0,
        dataclasses.replace(mine.features, **features),
    )


@pytest.mark.parametrize("streams", [True, False])
def test_only_a_sampler_that_streams_tokens_is_handed_the_hook(
    server: ServerThread, adapter: dict[str, Any], streams: bool
) -> None:
    """A sampler whose batches run in another process (Ray or vLLM replicas declare
    `token_streaming` false) could not call the stream's hook there: it is not given one, and
    the stream gets the tokens with the result."""
    intake = _RecordingIntake()
    completions = with_features(server, intake, token_streaming=streams)
    tenant = server.service.authenticate(KEY_A)
    body = {"model": adapter["path"], "prompt": "hi", "max_tokens": 2, "stream": True}
    ask, target = completions.parse(tenant, body, False)
    loop = asyncio.new_event_loop()
    try:
        hook = StreamHook(loop, asyncio.Queue())
        assert completions.submit(tenant, body, ask, target, hook) == "recorded"
    finally:
        loop.close()
    (args,) = intake.sent
    assert args.on_token is (hook if streams else None)


def test_stream_error_after_start_is_an_error_event(
    server: ServerThread, adapter: dict[str, Any]
) -> None:
    """A sample that fails in the sampler (here a prompt longer than the context) after the
    stream began ends it with an error event, which the openai package raises."""
    context = server.service.served.context_length
    assert context is not None
    prompt = [5] * (context + 1)
    stream = client(server).completions.create(
        model=adapter["path"], prompt=prompt, max_tokens=2, stream=True
    )
    with pytest.raises(openai.APIError, match="context|prompt"):
        list(stream)


@pytest.mark.parametrize(
    ("chat", "fields", "param"),
    [
        (False, {"stop": "x"}, "stop"),
        (True, {"stop": ["x", "y"]}, "stop"),
        (False, {"logprobs": 3}, "logprobs"),
        (True, {"logprobs": True, "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_what_the_sampler_declares_it_cannot_honour_is_refused_naming_the_openai_field(
    server: ServerThread, adapter: dict[str, Any], chat: bool, fields: dict[str, Any], param: str
) -> None:
    """A sampler that declares no stop strings and no top log-probs (as vLLM/SGLang replicas
    do, `SamplerFeatures`): refused at the door as 400s naming OpenAI's field (not as a failed
    sample naming the Tinker fields `topk_sample_logprobs` / stop strings with the EOS text
    added), while what it does serve (logprobs without alternatives) passes. Whatever the
    engine is called: the declaration decides, and the name is only quoted."""
    mine = server.service.completions
    limited = with_features(server, engine="fake", stop_strings=False, top_logprobs=False)
    tenant = server.service.authenticate(KEY_A)
    body: dict[str, Any] = {"model": adapter["path"], "max_tokens": 4, **fields}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    with pytest.raises(OpenAIError) as caught:
        limited.parse(tenant, body, chat)
    assert caught.value.param == param and caught.value.status == 400
    assert "fake rollout engine" in caught.value.message
    plain = {k: v for k, v in body.items() if k not in ("stop", "top_logprobs")}
    plain["logprobs"] = True if chat else 0
    limited.parse(tenant, plain, chat)
    assert mine.features.stop_strings and mine.features.top_logprobs  # the embedded sampler
    mine.parse(tenant, body, chat)  # serves them all
    # one feature at a time: a sampler with top log-probs but no stop strings
    no_stops = with_features(server, engine="fake", stop_strings=False)
    if param == "stop":
        with pytest.raises(OpenAIError, match="stop is not supported with the fake"):
            no_stops.parse(tenant, body, chat)
    else:
        no_stops.parse(tenant, body, chat)
