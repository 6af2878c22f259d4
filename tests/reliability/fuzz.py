"""Malformed and hostile input, generated with `hypothesis` and sent as raw HTTP to a live
server, so the real decoders (JSON, pydantic, protobuf, zstd, the body reader) see it.

Three tenants share the server: the attacker (whose key the fuzzer uses, with its own models,
checkpoints and sessions to aim at), a bystander (whose ids the attacker tries to reach), and a
victim that trains through the official SDK during the whole attack; the victim's results
are afterwards compared with a replay of its requests on a fresh server with no attack.

Requests: random bytes and structured-but-hostile `ForwardBackwardRequest`s (out-of-vocab and
negative token ids, byte counts that are not whole numbers of tokens, NaN/inf tensors, wrong and
negative shapes, unknown dtypes, broken sparse CSR, unknown loss names, NaN loss configs),
valid requests with bytes flipped or truncated inside a datum, declared lengths of 2^40,
JSON bodies for every route with fields replaced by hostile values (NaN, huge integers,
path-like names such as `../x`, other tenants' ids) or replaced by random JSON, invalid
JSON, deep nesting, oversized and chunked bodies, zstd bombs, odd headers; then slow clients
(`slow_clients`). Expected: a 4xx with a JSON `{"error", "category"}` body, never a 5xx and
never a future failing with category "server"; a 2xx is never the answer to a request that
names another tenant's id; the server stays up; the victim's results do not move.

Seq ids: an attack on one of the attacker's models usually takes the model's next seq_id
(resolved when it is sent), otherwise a used, zero, negative or absurdly distant one; never a
small gap, which would (correctly) hold every later request of that model until the gap
timeout.
"""

from __future__ import annotations

import json
import math
import select
import socket
import threading
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import zstandard
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from tinker.proto import tinker_public_pb2 as pb

from tests.reliability.harness import VOCAB, inprocess_server, tenant_keys
from tests.reliability.load import TenantPlan, TenantTrace, compare, run_tenant

API = "/api/v1"
PROTOBUF = {"Content-Type": "application/x-protobuf"}
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
# Seq markers, resolved when the request is sent (so what hypothesis draws never depends on
# the server's state): NEXT is the model's next seq_id, USED + "k>" the one k before it.
NEXT = "<next-seq>"
USED = "<used-seq-back:"
# The fuzz server's limits: small, so that oversized bodies are cheap to send.
LIMITS = {
    "max_json_bytes": 64 << 10,
    "max_body_bytes": 256 << 10,
    "body_timeout_s": 2.0,
    "max_num_samples": 16,
}

NAMES = [
    "", ".", "..", "../x", "../../etc/passwd", "/etc/passwd", "a/b", "a\\b", "x\x00y", "%2e%2e%2fx",
    ".hidden", "-rf", "CON", "x" * 300, "\u202e", "ünï", "tinker://", "tinker://../weights/x",
    "tinker://a/weights/../../x", "file:///etc/passwd", " ", "ok-name", "~root",
]  # fmt: skip
HOSTILE_TEXT = st.one_of(st.sampled_from(NAMES), st.text(max_size=24))
HOSTILE_INT = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**30, -(10**30)]),
    st.integers(-(2**70), 2**70),
)
HOSTILE_FLOAT = st.one_of(
    st.sampled_from(
        [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e308, -1e308, 5e-324, 1e-3]
    ),
    st.floats(allow_nan=True, allow_infinity=True),
)
JSON_LEAF = st.one_of(st.none(), st.booleans(), HOSTILE_INT, HOSTILE_FLOAT, HOSTILE_TEXT)
JSON_ANY = st.recursive(
    JSON_LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


# ============================================================================ raw client


class Raw:
    """Plain HTTP as one tenant, for set-up and polling."""

    def __init__(self, base_url: str, key: str):
        self.client = httpx.Client(base_url=base_url + API, headers={"X-API-Key": key}, timeout=60)

    def post(self, path: str, obj: Any) -> dict[str, Any]:
        response = self.client.post(path, json=obj)
        if response.status_code != 200:
            raise RuntimeError(f"set-up {path}: {response.status_code} {response.text[:300]}")
        return response.json()

    def result(self, request_id: str, deadline_s: float = 120.0) -> httpx.Response | None:
        """The future's final answer, or None if it is still pending at the deadline."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            response = self.client.post(
                "retrieve_future", json={"request_id": request_id}, timeout=60
            )
            if response.headers.get("content-type", "").startswith("application/json"):
                body = response.json()
                if isinstance(body, dict) and body.get("type") == "try_again":
                    continue
            return response
        return None

    def done(self, promise: dict[str, Any]) -> dict[str, Any]:
        response = self.result(promise["request_id"])
        if response is None or response.status_code != 200 or b'"error"' in response.content[:20]:
            raise RuntimeError(
                f"set-up future failed: {None if response is None else response.text[:300]}"
            )
        try:
            return response.json()
        except json.JSONDecodeError:
            return {}

    def close(self) -> None:
        self.client.close()


def fwdbwd_body(
    model_id: str, seq_id: int, tokens: list[int], loss_fn: str = "cross_entropy"
) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn)
    msg.data.append(_datum(tokens))
    return msg.SerializeToString()


def _datum(tokens: list[int]) -> pb.Datum:
    datum = pb.Datum()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens[:-1], "<i4").tobytes()
    targets = datum.loss_fn_inputs["target_tokens"]
    targets.dtype, targets.dense = pb.DTYPE_INT64, np.asarray(tokens[1:], "<i8").tobytes()
    targets.shape.append(len(tokens) - 1)
    weights = datum.loss_fn_inputs["weights"]
    weights.dtype, weights.dense = pb.DTYPE_FLOAT32, np.ones(len(tokens) - 1, "<f4").tobytes()
    weights.shape.append(len(tokens) - 1)
    return datum


@dataclass
class Tenancy:
    """Ids the fuzzer aims at: the attacker's own, and other tenants' (which must stay 404)."""

    own_sessions: list[str]  # [0] is the attacker's main session (never finished by the fuzzer)
    own_models: list[str]
    own_checkpoints: list[str]
    own_samplers: list[str]
    own_requests: list[str]
    foreign_sessions: list[str] = field(default_factory=list)
    foreign_models: list[str] = field(default_factory=list)
    foreign_checkpoints: list[str] = field(default_factory=list)
    foreign_samplers: list[str] = field(default_factory=list)
    foreign_requests: list[str] = field(default_factory=list)
    base_model: str = "tiny-qwen3"
    next_seq: dict[str, int] = field(default_factory=dict)


def set_up_tenant(raw: Raw, base_model: str, models: int, spare_sessions: int = 0) -> Tenancy:
    """A session, `models` trained models with a training and a sampler checkpoint on the first,
    a sampling session on that checkpoint, and some finished futures."""
    session = raw.post("create_session", {"tags": [], "sdk_version": "fuzz"})["session_id"]
    spares = [raw.post("create_session", {})["session_id"] for _ in range(spare_sessions)]
    out = Tenancy([session, *spares], [], [], [], [], base_model=base_model)
    for n in range(models):
        promise = raw.post(
            "create_model",
            {
                "session_id": session,
                "model_seq_id": n,
                "base_model": base_model,
                "lora_config": {"rank": 4, "seed": n},
            },
        )
        model_id = raw.done(promise)["model_id"]
        out.own_models.append(model_id)
        out.own_requests.append(promise["request_id"])
        out.next_seq[model_id] = 1
    model = out.own_models[0]
    response = raw.client.post(
        "forward_backward", content=fwdbwd_body(model, 1, [3, 5, 7, 9, 11]), headers=PROTOBUF
    )
    out.own_requests.append(response.json()["request_id"])
    steps = [
        ("optim_step", {"model_id": model, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}}),
        ("save_weights", {"model_id": model, "seq_id": 3, "path": "fz-state"}),
        ("save_weights_for_sampler", {"model_id": model, "seq_id": 4, "path": "fz-sampler"}),
    ]
    for path, body in steps:
        promise = raw.post(path, body)
        result = raw.done(promise)
        out.own_requests.append(promise["request_id"])
        if "path" in result:
            out.own_checkpoints.append(result["path"])
    out.next_seq[model] = 5
    sampler = raw.post(
        "create_sampling_session",
        {
            "session_id": session,
            "sampling_session_seq_id": 0,
            "model_path": out.own_checkpoints[-1],
        },
    )["sampling_session_id"]
    out.own_samplers.append(sampler)
    return out


# ============================================================================ attacks


@dataclass
class Attack:
    kind: str
    method: str
    path: str
    body: Any = None  # JSON object (may hold NEXT), bytes, or a builder taking the seq_id
    raw_bytes: bool = False  # body is bytes / builder output, sent as is
    headers: dict[str, str] = field(default_factory=dict)
    seq_model: str | None = None  # the own model whose seq the markers (NEXT, USED) refer to
    seq_marker: str | None = None  # the marker a builder body is called with (resolved)
    foreign: bool = False
    key: str | None = "attacker"  # "attacker" | None (no key) | a literal key
    chunked: bool = False


class _Picker:
    def __init__(self, draw: Callable[[Any], Any], t: Tenancy):
        self.draw, self.t = draw, t
        self.foreign = False
        self.seq_model: str | None = None

    def pick(self, own: list[str], foreign: list[str], hostile: Any = HOSTILE_TEXT) -> Any:
        choice = self.draw(st.integers(0, 9))
        if choice < 6 and own:
            return self.draw(st.sampled_from(own))
        if choice < 8 and foreign:
            self.foreign = True
            return self.draw(st.sampled_from(foreign))
        return self.draw(hostile)

    def model(self) -> str:
        model = self.pick(self.t.own_models, self.t.foreign_models)
        if model in self.t.own_models:
            self.seq_model = model
        return model

    def seq(self, *, proto: bool = False) -> Any:
        """NEXT, or a seq_id that cannot open a gap: used already, <= 0, or absurdly far ahead
        (refused at once), or not an integer at all."""
        choice = self.draw(st.integers(0, 9))
        if choice < 7 and self.seq_model is not None:
            return NEXT
        if choice == 7 and self.seq_model is not None:
            return f"{USED}{self.draw(st.integers(1, 50))}>"
        if proto:  # an int32 field
            return self.draw(st.sampled_from([0, -1, 2**31 - 1, -(2**31)]))
        not_int = st.one_of(st.none(), st.booleans(), HOSTILE_FLOAT, HOSTILE_TEXT)
        return self.draw(
            st.one_of(
                st.sampled_from([0, -1, 2**31 - 1, 2**63 - 1, 2**63, 10**30, -(10**30)]), not_int
            )
        )

    def maybe(self, valid: Any, hostile: Any = JSON_ANY) -> Any:
        """Usually the valid value (a callable is called only then), sometimes a hostile one."""
        if self.draw(st.integers(0, 3)):
            return valid() if callable(valid) else valid
        return self.draw(hostile)


def _tensor(draw: Any) -> pb.Tensor:
    tensor = pb.Tensor()
    tensor.dtype = draw(
        st.sampled_from(
            [pb.DTYPE_FLOAT32, pb.DTYPE_INT64, pb.DTYPE_INT32, pb.DTYPE_BFLOAT16, 0, 99]
        )
    )
    size = draw(st.integers(0, 12))
    tensor.shape.extend(
        draw(
            st.one_of(
                st.just([size]), st.lists(st.integers(-3, 2**40), max_size=3), st.just([size, 2])
            )
        )
    )
    choice = draw(st.integers(0, 4))
    if choice == 0:
        tensor.dense = draw(st.binary(max_size=64))
    elif choice == 1:
        csr = tensor.sparse_csr
        csr.values, csr.crow_indices, csr.col_indices = (
            draw(st.binary(max_size=48)) for _ in range(3)
        )
    else:
        values = draw(
            st.lists(
                st.one_of(HOSTILE_FLOAT, st.integers(-600, 600).map(float)),
                min_size=size,
                max_size=size,
            )
        )
        kind = {pb.DTYPE_INT64: "<i8", pb.DTYPE_INT32: "<i4"}.get(tensor.dtype, "<f4")
        with np.errstate(invalid="ignore", over="ignore"):
            array = np.asarray(values, dtype=np.float64)
            array = (
                np.nan_to_num(array, nan=0, posinf=2**31 - 1, neginf=-(2**31)).astype(kind)
                if kind != "<f4"
                else array.astype("<f4")
            )
        tensor.dense = array.tobytes()
    return tensor


@st.composite
def proto_structured(draw: Any, t: Tenancy) -> Attack:
    p = _Picker(draw, t)
    model, seq = p.model(), p.seq(proto=True)
    loss_fn = draw(st.one_of(st.sampled_from(LOSSES), HOSTILE_TEXT))
    forward_only = draw(st.booleans())
    data = []
    for _ in range(draw(st.integers(0, 3))):
        datum = pb.Datum()
        for _ in range(draw(st.integers(0, 2))):
            tokens = draw(
                st.one_of(
                    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24).map(
                        lambda v: np.asarray(v, "<i4").tobytes()
                    ),
                    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8).map(
                        lambda v: np.asarray(v, "<i4").tobytes()
                    ),
                    st.binary(max_size=30),
                )
            )
            datum.model_input.add().encoded_text.tokens = tokens
        names = st.one_of(
            st.sampled_from(["target_tokens", "weights", "logprobs", "advantages"]), HOSTILE_TEXT
        )
        for name in draw(st.lists(names, max_size=4, unique=True)):
            datum.loss_fn_inputs[name].CopyFrom(_tensor(draw))
        data.append(datum)
    config = draw(st.dictionaries(st.text(max_size=12), HOSTILE_FLOAT, max_size=3))

    def build(seq_id: int) -> bytes:
        msg = pb.ForwardBackwardRequest(
            model_id=model, seq_id=seq_id, loss_fn=loss_fn, forward_only=forward_only
        )
        msg.data.extend(data)
        for key, value in config.items():
            msg.loss_fn_config[key] = value
        return msg.SerializeToString()

    marker = seq if isinstance(seq, str) else None
    return Attack(
        "proto_structured",
        "POST",
        "forward_backward",
        build if marker else build(seq),
        True,
        dict(PROTOBUF),
        p.seq_model if marker else None,
        marker,
        p.foreign,
    )


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@st.composite
def proto_mutated(draw: Any, t: Tenancy) -> Attack:
    """A valid request for an own model with bytes flipped, cut or inserted inside its datum
    (the envelope, and so the seq_id, stays intact), or a datum whose declared length is huge."""
    model = draw(st.sampled_from(t.own_models))
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=20))
    inner = bytearray(_datum(tokens).SerializeToString())
    huge = draw(st.integers(0, 9)) == 0
    for _ in range(draw(st.integers(1, 4))):
        action, where = draw(st.integers(0, 2)), draw(st.integers(0, max(0, len(inner) - 1)))
        if action == 0 and inner:
            inner[where] ^= draw(st.integers(1, 255))
        elif action == 1:
            del inner[where:]
        else:
            inner[where:where] = draw(st.binary(min_size=1, max_size=8))

    def build(seq_id: int) -> bytes:
        envelope = pb.ForwardBackwardRequest(
            model_id=model, seq_id=seq_id, loss_fn="cross_entropy"
        ).SerializeToString()
        length = 2**40 if huge else len(inner)
        return envelope + b"\x1a" + _varint(length) + bytes(inner)

    return Attack(
        "proto_mutated", "POST", "forward_backward", build, True, dict(PROTOBUF), model, NEXT
    )


@st.composite
def proto_random(draw: Any, t: Tenancy) -> Attack:
    headers = dict(PROTOBUF)
    body = draw(st.binary(max_size=512))
    encoding = draw(st.sampled_from([None, None, None, "zstd", "gzip", "identity", "br, zstd"]))
    if encoding:
        headers["Content-Encoding"] = encoding
        if encoding == "zstd" and draw(st.booleans()):  # a bomb: tiny, declares megabytes
            body = zstandard.ZstdCompressor().compress(
                b"\0" * draw(st.sampled_from([1 << 20, 64 << 20]))
            )
    return Attack("proto_random", "POST", "forward_backward", body, True, headers)


def _lora(p: _Picker) -> Any:
    config = {"rank": p.maybe(4, HOSTILE_INT), "seed": p.maybe(1, HOSTILE_INT)}
    for flag in ("train_attn", "train_mlp", "train_unembed"):
        config[flag] = p.maybe(True, JSON_LEAF)
    return p.maybe(config)


def _prompt(p: _Picker) -> Any:
    tokens = p.draw(
        st.one_of(
            st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
            st.lists(HOSTILE_INT, max_size=6),
        )
    )
    chunk = {"type": p.maybe("encoded_text", HOSTILE_TEXT), "tokens": tokens}
    return p.maybe({"chunks": [chunk]})


def _sampling_params(p: _Picker) -> Any:
    params = {
        "max_tokens": p.maybe(p.draw(st.integers(1, 8)), HOSTILE_INT),
        "temperature": p.maybe(1.0, HOSTILE_FLOAT),
        "top_p": p.maybe(1.0, HOSTILE_FLOAT),
        "top_k": p.maybe(-1, HOSTILE_INT),
        "seed": p.maybe(7, HOSTILE_INT),
        "stop": p.maybe(
            [],
            st.one_of(
                HOSTILE_TEXT, st.lists(HOSTILE_TEXT, max_size=3), st.lists(HOSTILE_INT, max_size=3)
            ),
        ),
    }
    return p.maybe(params)


def _sample_source(p: _Picker) -> dict[str, Any]:
    which = p.draw(st.integers(0, 2))
    if which == 0:
        return {"sampling_session_id": p.pick(p.t.own_samplers, p.t.foreign_samplers)}
    if which == 1:
        return {"model_path": _ckpt(p)}
    return {"base_model": p.maybe(p.t.base_model, HOSTILE_TEXT)}


def _ckpt(p: _Picker) -> Any:
    return p.pick(
        p.t.own_checkpoints, p.t.foreign_checkpoints, st.one_of(st.sampled_from(NAMES), JSON_LEAF)
    )


JSON_ROUTES: dict[str, Callable[[_Picker], tuple[str, str, Any]]] = {
    "create_session": lambda p: (
        "POST",
        "create_session",
        p.maybe({"tags": p.maybe([]), "user_metadata": p.maybe({})}),
    ),
    "heartbeat": lambda p: (
        "POST",
        "session_heartbeat",
        {"session_id": p.pick(p.t.own_sessions, p.t.foreign_sessions)},
    ),
    "finish": lambda p: (
        "POST",
        f"sessions/{p.pick(p.t.own_sessions[1:], p.t.foreign_sessions)}/finish",
        p.maybe({"reason": {"type": "success"}}),
    ),
    "create_model": lambda p: (
        "POST",
        "create_model",
        {
            "session_id": p.pick(p.t.own_sessions, p.t.foreign_sessions),
            "model_seq_id": p.maybe(p.draw(st.integers(10, 10**6)), HOSTILE_INT),
            "base_model": p.maybe(p.t.base_model, HOSTILE_TEXT),
            "lora_config": _lora(p),
            "optimizer_config": p.maybe({"type": "adamw"}),
        },
    ),
    "get_info": lambda p: ("POST", "get_info", {"model_id": p.model()}),
    "optim_step": lambda p: (
        "POST",
        "optim_step",
        {
            "model_id": p.model(),
            "seq_id": p.seq(),
            "adam_params": p.maybe(
                {
                    k: p.maybe(v, HOSTILE_FLOAT)
                    for k, v in {
                        "learning_rate": 1e-3,
                        "beta1": 0.9,
                        "beta2": 0.95,
                        "eps": 1e-8,
                    }.items()
                }
            ),
        },
    ),
    "save_weights": lambda p: (
        "POST",
        "save_weights",
        {
            "model_id": p.model(),
            "seq_id": p.seq(),
            "path": p.draw(HOSTILE_TEXT),
            "overwrite": p.maybe(False, JSON_LEAF),
            "ttl_seconds": p.maybe(None, HOSTILE_INT),
        },
    ),
    "save_for_sampler": lambda p: (
        "POST",
        "save_weights_for_sampler",
        {
            "model_id": p.model(),
            "seq_id": p.seq(),
            "path": p.draw(st.one_of(HOSTILE_TEXT, st.none())),
            "sampling_session_seq_id": p.maybe(None, HOSTILE_INT),
        },
    ),
    "load_state": lambda p: (
        "POST",
        "load_weights",
        {
            "model_id": p.model(),
            "seq_id": p.seq(),
            "path": _ckpt(p),
            "optimizer": p.maybe(True, JSON_LEAF),
        },
    ),
    "create_from_state": lambda p: (
        "POST",
        "load_weights",
        {
            "session_id": p.pick(p.t.own_sessions, p.t.foreign_sessions),
            "model_seq_id": p.draw(st.integers(10**6, 10**7)),
            "path": _ckpt(p),
            "optimizer": p.maybe(False, JSON_LEAF),
        },
    ),
    "create_sampling_session": lambda p: (
        "POST",
        "create_sampling_session",
        {
            "session_id": p.pick(p.t.own_sessions, p.t.foreign_sessions),
            "sampling_session_seq_id": p.maybe(p.draw(st.integers(10, 10**6)), HOSTILE_INT),
            "model_path": p.maybe(lambda: _ckpt(p), JSON_LEAF),
            "base_model": p.maybe(None, HOSTILE_TEXT),
        },
    ),
    "asample": lambda p: (
        "POST",
        "asample",
        {
            **_sample_source(p),
            "prompt": _prompt(p),
            "sampling_params": _sampling_params(p),
            "num_samples": p.maybe(p.draw(st.integers(1, 3)), HOSTILE_INT),
            "prompt_logprobs": p.maybe(False, JSON_LEAF),
            "topk_prompt_logprobs": p.maybe(0, HOSTILE_INT),
            "topk_sample_logprobs": p.maybe(0, HOSTILE_INT),
            "prompt_logprobs_last_n": p.maybe(None, HOSTILE_INT),
            "seq_id": p.maybe(None, HOSTILE_INT),
        },
    ),
    "retrieve_future": lambda p: (
        "POST",
        "retrieve_future",
        {
            "request_id": p.pick(p.t.own_requests, p.t.foreign_requests),
            "allow_metadata_only": p.maybe(True, JSON_LEAF),
        },
    ),
    "weights_info": lambda p: ("POST", "weights_info", {"tinker_path": _ckpt(p)}),
    "telemetry": lambda p: ("POST", "telemetry", p.draw(JSON_ANY)),
    "client_config": lambda p: ("POST", "client/config", p.draw(JSON_ANY)),
}


@st.composite
def json_attack(draw: Any, t: Tenancy) -> Attack:
    p = _Picker(draw, t)
    name = draw(st.sampled_from(sorted(JSON_ROUTES)))
    method, path, obj = JSON_ROUTES[name](p)
    if draw(st.integers(0, 7)) == 0:  # the whole body replaced by arbitrary JSON
        obj, p.foreign, p.seq_model = draw(JSON_ANY), False, None
    text = json.dumps(obj, default=str)
    return Attack(
        f"json:{name}",
        method,
        path,
        obj,
        seq_model=p.seq_model if NEXT in text or USED in text else None,
        seq_marker=NEXT if NEXT in text else None,
        foreign=p.foreign,
    )


@st.composite
def json_broken(draw: Any, t: Tenancy) -> Attack:
    """Bodies that are not JSON at all, or JSON no parser should have to hold."""
    path = draw(
        st.sampled_from(
            [
                "create_session",
                "optim_step",
                "asample",
                "retrieve_future",
                "save_weights",
                "load_weights",
                "create_model",
            ]
        )
    )
    body = draw(
        st.one_of(
            st.binary(max_size=200),
            st.sampled_from(
                [
                    b"[" * 100_000,
                    b'{"a":' * 20_000,
                    b"1" * 5000,
                    b"NaN",
                    b"-Infinity",
                    b"1e999",
                    b'"\\ud800"',
                    b"\xff\xfe{}",
                    b"{}" * 1000,
                ]
            ),
            st.text(max_size=100).map(str.encode),
        )
    )
    return Attack(
        "json_broken",
        "POST",
        path,
        body,
        True,
        {
            "Content-Type": draw(
                st.sampled_from(["application/json", "text/plain", "application/x-protobuf"])
            )
        },
    )


@st.composite
def rest_attack(draw: Any, t: Tenancy) -> Attack:
    p = _Picker(draw, t)
    run = p.pick(t.own_models, t.foreign_models)
    checkpoint = p.draw(
        st.one_of(
            st.sampled_from(
                [
                    "weights/fz-state",
                    "sampler_weights/fz-sampler",
                    "weights/../../x",
                    "%2e%2e/x",
                    "weights/",
                ]
            ),
            HOSTILE_TEXT,
        )
    )
    query = p.draw(
        st.sampled_from(
            [
                "",
                "?limit=-1",
                "?limit=abc",
                "?offset=-5",
                "?offset=99999999999999999999999",
                "?limit=1000000",
                "?limit=5&offset=1",
            ]
        )
    )
    choice = draw(
        st.sampled_from(
            [
                "runs",
                "run",
                "run_checkpoints",
                "ttl",
                "delete",
                "checkpoints",
                "sampler",
                "stats",
                "unknown",
            ]
        )
    )
    quoted_run = urllib.parse.quote(str(run), safe=":./")
    checkpoint = urllib.parse.quote(checkpoint, safe="/.%")
    if choice == "runs":
        return Attack("rest:runs", "GET", f"training_runs{query}")
    if choice == "run":
        return Attack("rest:run", "GET", f"training_runs/{quoted_run}", foreign=p.foreign)
    if choice == "run_checkpoints":
        return Attack(
            "rest:run_checkpoints",
            "GET",
            f"training_runs/{quoted_run}/checkpoints",
            foreign=p.foreign,
        )
    if choice == "ttl":
        return Attack(
            "rest:ttl",
            "PUT",
            f"training_runs/{quoted_run}/checkpoints/{checkpoint}/ttl",
            {"ttl_seconds": p.maybe(3600, HOSTILE_INT)},
            foreign=p.foreign,
        )
    if choice == "delete":
        # only ever on junk names or other tenants' runs: the attacker's own checkpoints stay
        if not p.foreign:
            checkpoint = "weights/never-saved-" + uuid.uuid4().hex[:6]
        return Attack(
            "rest:delete",
            "DELETE",
            f"training_runs/{quoted_run}/checkpoints/{checkpoint}",
            foreign=p.foreign,
        )
    if choice == "checkpoints":
        return Attack("rest:checkpoints", "GET", f"checkpoints{query}")
    if choice == "sampler":
        p.foreign = False  # only the sampler id counts here, not the run drawn above
        sampler = p.pick(t.own_samplers, t.foreign_samplers)
        return Attack(
            "rest:sampler",
            "GET",
            f"samplers/{urllib.parse.quote(str(sampler), safe=':./')}",
            foreign=p.foreign,
        )
    if choice == "stats":
        return Attack("rest:stats", "GET", "lorafleet/stats")
    return Attack(
        "rest:unknown",
        draw(st.sampled_from(["GET", "POST", "PATCH"])),
        draw(st.sampled_from(["../../etc/passwd", "nope", "%00", "sessions//finish"])),
    )


@st.composite
def header_attack(draw: Any, t: Tenancy) -> Attack:
    key = draw(
        st.sampled_from(
            [
                None,
                "",
                "tml-",
                "tml-wrong-key-000000000000",
                "Bearer " + "x" * 20,
                "eyJhbGciOiJub25lIn0.e30.",
                "tml-" + "x" * 5000,
            ]
        )
    )
    path = draw(
        st.sampled_from(
            [
                "create_session",
                "forward_backward",
                "get_server_capabilities",
                "training_runs",
                "asample",
            ]
        )
    )
    method = "GET" if path in ("get_server_capabilities", "training_runs") else "POST"
    return Attack(
        "headers:bad_key", method, path, b"{}", True, {"Content-Type": "application/json"}, key=key
    )


@st.composite
def oversized(draw: Any, t: Tenancy) -> Attack:
    proto = draw(st.booleans())
    limit = LIMITS["max_body_bytes"] if proto else LIMITS["max_json_bytes"]
    body = b"\x0a" * (limit + draw(st.integers(1, 4096)))
    path = (
        "forward_backward"
        if proto
        else draw(st.sampled_from(["create_session", "asample", "optim_step"]))
    )
    return Attack(
        "oversized",
        "POST",
        path,
        body,
        True,
        dict(PROTOBUF) if proto else {"Content-Type": "application/json"},
        chunked=draw(st.booleans()),
    )


FAMILIES: dict[str, tuple[Callable[[Tenancy], Any], float]] = {
    "proto_structured": (proto_structured, 0.20),
    "proto_mutated": (proto_mutated, 0.10),
    "proto_random": (proto_random, 0.07),
    "json": (json_attack, 0.35),
    "json_broken": (json_broken, 0.08),
    "rest": (rest_attack, 0.10),
    "headers": (header_attack, 0.05),
    "oversized": (oversized, 0.05),
}
"""Attack families and their share of the requests (each family is its own hypothesis run, so
the shares hold exactly)."""


# ============================================================================ sending and judging


def _resolve(obj: Any, next_seq: int) -> Any:
    if obj == NEXT:
        return next_seq
    if isinstance(obj, str) and obj.startswith(USED):
        return max(0, next_seq - int(obj[len(USED) : -1]))
    if isinstance(obj, dict):
        return {k: _resolve(v, next_seq) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_resolve(v, next_seq) for v in obj]
    return obj


@dataclass
class FuzzReport:
    requests: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    by_status: Counter[int] = field(default_factory=Counter)
    server_5xx: int = 0  # HTTP 5xx + futures failed with category "server"
    unclear_errors: int = 0  # a 4xx without a JSON {"error": <non-empty>, "category"} body
    forbidden_403: int = 0
    foreign_2xx: int = 0  # a request naming another tenant's id answered with success
    futures_checked: int = 0
    futures_unresolved: int = 0
    server_down: bool = False
    examples: list[str] = field(default_factory=list)  # the first few failures, for the log
    slow_clients: dict[str, Any] = field(default_factory=dict)
    victim: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["by_kind"], out["by_status"] = (
            dict(self.by_kind),
            {str(k): v for k, v in sorted(self.by_status.items())},
        )
        return out

    def fail(self, what: str) -> None:
        if len(self.examples) < 25:
            self.examples.append(what[:600])


class Fuzzer:
    def __init__(
        self, base_url: str, keys: dict[str, str], t: Tenancy, report: FuzzReport, log: Any = None
    ):
        self.base_url, self.keys, self.t, self.report = base_url, keys, t, report
        self.log = log or (lambda _msg: None)
        self.client = httpx.Client(base_url=base_url + API, timeout=60)
        self.futures: list[tuple[str, Attack]] = []

    def send(self, attack: Attack) -> None:
        seq = self.t.next_seq.get(attack.seq_model, 1) if attack.seq_model else 1
        if callable(attack.body):
            content: Any = attack.body(_resolve(attack.seq_marker, seq))
        elif attack.raw_bytes:
            content = attack.body
        elif attack.body is not None:
            content = json.dumps(_resolve(attack.body, seq), default=str).encode()
        else:
            content = None
        headers = dict(attack.headers)
        if attack.key == "attacker":
            headers["X-API-Key"] = self.keys["attacker"]
        elif attack.key is not None:
            headers["X-API-Key"] = attack.key
        if content is not None and "Content-Type" not in headers:
            headers["Content-Type"] = "application/json"
        if attack.chunked and content is not None:
            data, content = content, None
            stream: Any = iter([data[i : i + 65536] for i in range(0, len(data), 65536)])
        else:
            stream = None
        report = self.report
        try:  # what the HTTP client itself refuses to send (a NUL in the URL) is not an attack
            request = self.client.build_request(
                attack.method,
                attack.path,
                content=content if stream is None else stream,
                headers=headers,
            )
        except (httpx.InvalidURL, UnicodeEncodeError):
            return
        report.requests += 1
        report.by_kind[attack.kind] += 1
        try:
            response = self.client.send(request)
        except httpx.HTTPError as exc:
            if (
                isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError)
                and attack.kind == "oversized"
            ):
                report.by_status[413] += (
                    1  # the server answered 413 and closed while we were still sending
                )
                return
            report.by_status[0] += 1
            report.fail(f"{attack.kind} {attack.path}: transport error {type(exc).__name__}: {exc}")
            if not self.alive():
                report.server_down = True
            return
        status = response.status_code
        report.by_status[status] += 1
        summary = f"{attack.kind} {attack.method} {attack.path} -> {status} {response.text[:300]!r}"
        if status >= 500:
            report.server_5xx += 1
            report.fail(summary)
        if status == 403:
            report.forbidden_403 += 1
            report.fail(summary)
        if attack.foreign and 200 <= status < 300:
            # A request on an own model that names another tenant's checkpoint takes its seq_id
            # place (a promise) and is judged by its future in check_futures; anything else is
            # a success on someone else's id.
            try:
                deferred = "request_id" in response.json()
            except json.JSONDecodeError:
                deferred = False
            if not deferred:
                report.foreign_2xx += 1
                report.fail("FOREIGN " + summary)
        if 400 <= status < 500:
            try:
                body = response.json()
                clear = (
                    isinstance(body, dict)
                    and isinstance(body.get("error"), str)
                    and body["error"]
                    and "category" in body
                )
            except json.JSONDecodeError:
                clear = False
            if not clear:
                report.unclear_errors += 1
                report.fail("UNCLEAR " + summary)
        if status == 200 and response.headers.get("content-type", "").startswith(
            "application/json"
        ):
            body = response.json()
            if (
                isinstance(body, dict)
                and isinstance(body.get("request_id"), str)
                and attack.path != "retrieve_future"
            ):
                self.futures.append((body["request_id"], attack))
                if attack.seq_model is not None and attack.seq_marker == NEXT:
                    self.t.next_seq[attack.seq_model] = seq + 1

    def alive(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}{API}/healthz", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def _reveals_nothing(self, body: Any) -> bool:
        """A future on another tenant's id must fail as a user error that either calls it
        unknown (as for an id that never existed) or does not mention it at all."""
        if not isinstance(body, dict) or body.get("category") != "user" or not body.get("error"):
            return False
        error = str(body["error"])
        t = self.t
        theirs = [
            *t.foreign_models,
            *t.foreign_checkpoints,
            *t.foreign_samplers,
            *t.foreign_sessions,
        ]
        return error.startswith("unknown ") or not any(i in error for i in theirs)

    def check_futures(self, raw: Raw) -> None:
        for request_id, attack in self.futures:
            self.report.futures_checked += 1
            response = raw.result(request_id, deadline_s=90)
            if response is None:
                self.report.futures_unresolved += 1
                self.report.fail(f"future of {attack.kind} {attack.path} never resolved")
                continue
            if response.status_code >= 500:
                self.report.server_5xx += 1
                self.report.fail(
                    f"retrieve of {attack.kind}: {response.status_code} {response.text[:300]}"
                )
                continue
            body = None
            if response.headers.get("content-type", "").startswith("application/json"):
                body = response.json()
            if attack.foreign and not self._reveals_nothing(body):
                self.report.foreign_2xx += 1
                self.report.fail(
                    f"FOREIGN future of {attack.kind} {attack.path}: {response.text[:300]}"
                )
            if isinstance(body, dict) and body.get("category") == "server":
                self.report.server_5xx += 1
                error = str(body.get("error", ""))[:400]
                self.report.fail(
                    f"future of {attack.kind} {attack.path} failed as a server error: {error}"
                )


def run_attacks(fuzzer: Fuzzer, examples: int, seed: int) -> None:
    """Sends `examples` generated attacks, split over FAMILIES by their shares."""
    for index, (name, (family, share)) in enumerate(FAMILIES.items()):
        goal = fuzzer.report.requests + max(1, math.ceil(examples * share))
        for round_ in range(10):  # hypothesis may end a run early; top it up
            missing = goal - fuzzer.report.requests
            if missing <= 0 or fuzzer.report.server_down:
                break

            @hypothesis_seed(seed * 1000 + index * 10 + round_)
            @settings(
                max_examples=missing,
                database=None,
                deadline=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(family(fuzzer.t))
            def one(attack: Attack) -> None:
                fuzzer.send(attack)

            one()
        fuzzer.log(f"fuzz: {name}: {fuzzer.report.requests} requests so far")


# ============================================================================ slow clients


def _raw_http(port: int, head: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head)
    return sock


def _wait_status(sock: socket.socket, timeout: float, trickle: bool) -> int | None:
    """Waits for a response (sending one body byte every 0.25 s if `trickle`); its status code."""
    deadline = time.monotonic() + timeout
    data = b""
    while time.monotonic() < deadline:
        readable, _, _ = select.select([sock], [], [], 0.25)
        if readable:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
            if b"\r\n" in data:
                break
        elif trickle:
            try:
                sock.sendall(b" ")
            except OSError:
                break
    try:
        return int(data.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return None


def slow_clients(base_url: str, key: str, body_timeout_s: float, loris: int = 24) -> dict[str, Any]:
    """A body trickled in slower than the deadline gets 408 in about the deadline; connections
    stuck in their headers, and one that hangs up mid-body, hold up nobody else."""
    port = int(base_url.rsplit(":", 1)[1])
    head = (
        "POST /api/v1/create_session HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"X-API-Key: {key}\r\nContent-Length: 400\r\n\r\n"
    ).encode()
    out: dict[str, Any] = {"requests": 0}
    began = time.monotonic()
    trickle = _raw_http(port, head + b"{")
    out["requests"] += 1
    out["trickled_body_status"] = _wait_status(trickle, body_timeout_s + 30, trickle=True)
    out["trickled_body_answered_s"] = round(time.monotonic() - began, 2)
    trickle.close()
    stuck = [
        _raw_http(port, b"POST /api/v1/create_session HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-")
        for _ in range(loris)
    ]
    out["requests"] += loris
    hangup = _raw_http(port, head + b'{"tags": [')
    hangup.close()
    out["requests"] += 1
    others = []
    for _ in range(10):
        started = time.monotonic()
        response = httpx.get(
            f"{base_url}{API}/get_server_capabilities", headers={"X-API-Key": key}, timeout=30
        )
        others.append((response.status_code, time.monotonic() - started))
    out["others_ok_while_stuck"] = all(code == 200 for code, _ in others)
    out["others_max_s"] = round(max(t for _, t in others), 3)
    for sock in stuck:
        sock.close()
    return out


# ============================================================================ the whole scenario


def run_fuzz(
    workdir: Path, examples: int, seed: int = 0, victim_max_steps: int = 40, log: Any = None
) -> FuzzReport:
    say = log or (lambda _msg: None)
    attacker, bystander, victim = tenant_keys(3, "fuzz")
    keys = {"attacker": attacker, "bystander": bystander, "victim": victim}
    report = FuzzReport()
    began = time.perf_counter()
    victim_plan = TenantPlan(victim, seed=4242, rank=8, steps=victim_max_steps, learning_rate=5e-3)
    with inprocess_server(
        workdir / "fuzz-data", [attacker, bystander, victim], max_adapters=16, **LIMITS
    ) as server:
        base_model = str(server.service.executor.base_path)
        raw_attacker, raw_bystander = (
            Raw(server.base_url, attacker),
            Raw(server.base_url, bystander),
        )
        t = set_up_tenant(raw_attacker, base_model, models=2, spare_sessions=2)
        other = set_up_tenant(raw_bystander, base_model, models=1)
        t.foreign_sessions += other.own_sessions
        t.foreign_models += other.own_models
        t.foreign_checkpoints += other.own_checkpoints
        t.foreign_samplers += other.own_samplers
        t.foreign_requests += other.own_requests

        ready, stop = threading.Event(), threading.Event()
        victim_trace: list[TenantTrace] = []

        def on_step(trace: TenantTrace, sampler: Any) -> None:
            if not ready.is_set():
                t.foreign_models.append(trace.model_id)
                t.foreign_sessions.append(trace.model_id.split(":train:")[0])
                t.foreign_checkpoints.append(trace.saves[-1])
                t.foreign_samplers.append(sampler._sampling_session_id)
                ready.set()

        def victim_run() -> None:
            victim_trace.append(
                run_tenant(
                    server.base_url,
                    base_model,
                    victim_plan,
                    until=stop,
                    on_step=on_step,
                    pause_s=0.5,
                )
            )

        victim_thread = threading.Thread(target=victim_run, name="fuzz-victim", daemon=True)
        victim_thread.start()
        if not ready.wait(300):
            raise RuntimeError("the victim tenant did not get through its first step")
        fuzzer = Fuzzer(server.base_url, keys, t, report, say)
        run_attacks(fuzzer, examples, seed)
        say(f"fuzz: {report.requests} requests sent, statuses {dict(report.by_status)}")
        report.slow_clients = slow_clients(server.base_url, attacker, LIMITS["body_timeout_s"])
        report.requests += report.slow_clients["requests"]
        report.by_kind["slow_client"] += report.slow_clients["requests"]
        fuzzer.check_futures(raw_attacker)
        stop.set()
        victim_thread.join(600)
        report.server_down = report.server_down or not fuzzer.alive()
        raw_attacker.close()
        raw_bystander.close()
    trace = victim_trace[0] if victim_trace else TenantTrace(victim)
    steps = len(trace.optim)
    replay_plan = TenantPlan(
        victim,
        seed=victim_plan.seed,
        rank=victim_plan.rank,
        steps=steps,
        learning_rate=victim_plan.learning_rate,
    )
    with inprocess_server(workdir / "fuzz-replay", [victim], **LIMITS) as server:
        replay = run_tenant(server.base_url, base_model, replay_plan)
    found = compare(trace, replay, workdir / "fuzz-data", workdir / "fuzz-replay")
    report.victim = {
        "steps": steps,
        "failed": trace.failed + trace.lost,
        "diffs": found.problems[:10],
        "cross_tenant_diffs": int(bool(found.problems or trace.failed or trace.lost)),
        "bit_exact": found.exact,
        "max_logprob_diff": found.max_logprob_diff,
        "max_rel_weight_diff": found.max_rel_weight_diff,
    }
    report.wall_s = time.perf_counter() - began
    return report
