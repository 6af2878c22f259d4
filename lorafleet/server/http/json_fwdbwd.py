"""A JSON forward_backward body into the protobuf `ForwardBackwardRequest` the rest of the server
reads (proto.py), so that JSON clients (SDKs before 0.25, curl, other languages) get exactly
the protobuf path's checks, including provenance spans (ops/stability.py).

The JSON shape is the SDK's pydantic one: `{"model_id", "seq_id", "forward_backward_input":
{"data": [Datum], "loss_fn", "loss_fn_config"?}, "forward_only"?}` (`forward_input` for a
forward-only call), a Datum being `{"model_input": {"chunks": [{"type": "encoded_text",
"tokens": [int]}]}, "loss_fn_inputs": {key: {"data": [number], "dtype": "int64"|"float32",
"shape"?: [int]}}, "model_input_spans"?: [Span], "loss_fn_input_spans"?: [Span]}` and a Span
either `{"type": "prompt"|"sampled", "sequence_id", "offset"?, "length"}` or protobuf's JSON
form `{"prompt_tokens"|"sampled_tokens": {"sequence_id", "offset"?, "length"}}`.

`envelope` reads only the model id and seq id (a request whose data is bad still takes its
place in the model's order, as with protobuf); `to_proto` converts the rest.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from lorafleet.server.errors import UserError

_DTYPES = {"int64": (pb.DTYPE_INT64, "<i8"), "float32": (pb.DTYPE_FLOAT32, "<f4")}


def _input(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    for key, forward_only in (("forward_backward_input", False), ("forward_input", True)):
        value = body.get(key)
        if value is not None:
            if not isinstance(value, dict):
                raise UserError(f"{key} must be an object, got {type(value).__name__}")
            return value, forward_only or body.get("forward_only") is True
    raise UserError("a JSON forward_backward body needs forward_backward_input (or forward_input)")


def envelope(body: Any) -> tuple[str, int, bool]:
    """(model_id, seq_id, forward_only); UserError when the body has no usable envelope."""
    if not isinstance(body, dict):
        raise UserError(f"the JSON body must be an object, got {type(body).__name__}")
    model_id, seq_id = body.get("model_id"), body.get("seq_id")
    if not isinstance(model_id, str) or not model_id:
        raise UserError(f"model_id must be a non-empty string, got {model_id!r}")
    if type(seq_id) is not int or seq_id < 1:
        raise UserError(
            f"seq_id must be an integer >= 1 (seq 0 is the model's creation), got {seq_id!r}"
        )
    forward_only = body.get("forward_only") is True or "forward_input" in body
    return model_id, seq_id, forward_only


def _int(value: Any, label: str, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise UserError(f"{label} must be an integer >= {minimum}, got {value!r}")
    return value


def _span(value: Any, label: str, out: pb.ProvenanceSpan) -> None:
    if not isinstance(value, dict):
        raise UserError(f"{label} must be an object, got {type(value).__name__}")
    if "prompt_tokens" in value or "sampled_tokens" in value:
        kind = "prompt" if "prompt_tokens" in value else "sampled"
        arm_json = value[f"{kind}_tokens"]
        if not isinstance(arm_json, dict):
            raise UserError(f"{label}.{kind}_tokens must be an object")
    else:
        given, arm_json = value.get("type"), value
        if given not in ("prompt", "sampled"):
            raise UserError(f"{label}.type must be 'prompt' or 'sampled', got {given!r}")
        kind = str(given)
    sequence_id = arm_json.get("sequence_id")
    if not isinstance(sequence_id, str) or not sequence_id:
        raise UserError(f"{label}.sequence_id must be a non-empty string, got {sequence_id!r}")
    arm = out.prompt_tokens if kind == "prompt" else out.sampled_tokens
    arm.sequence_id = sequence_id
    arm.offset = _int(arm_json.get("offset", 0), f"{label}.offset")
    arm.length = _int(arm_json.get("length"), f"{label}.length")


def _tensor(value: Any, label: str, out: pb.Tensor) -> None:
    if isinstance(value, list):
        value = {"data": value, "dtype": "int64" if "target_tokens" in label else "float32"}
    if not isinstance(value, dict):
        raise UserError(f"{label} must be an object with data and dtype")
    if value.get("sparse_crow_indices") is not None or value.get("sparse_col_indices") is not None:
        raise UserError(f"{label} is sparse: send sparse tensors in a protobuf body")
    dtype = value.get("dtype")
    if dtype not in _DTYPES:
        raise UserError(f"{label}.dtype must be 'int64' or 'float32', got {dtype!r}")
    data = value.get("data")
    if not isinstance(data, list) or not all(
        isinstance(x, int | float) and not isinstance(x, bool) for x in data
    ):
        raise UserError(f"{label}.data must be a flat list of numbers")
    enum, np_dtype = _DTYPES[dtype]
    if dtype == "int64" and not all(isinstance(x, int) for x in data):
        raise UserError(f"{label}.data must hold integers for dtype int64")
    if dtype == "float32" and not all(math.isfinite(float(x)) for x in data):
        raise UserError(f"{label}.data has a value that is not finite")
    try:
        out.dense = np.asarray(data, dtype=np_dtype).tobytes()
    except OverflowError:
        raise UserError(f"{label}.data has a value outside {dtype}") from None
    out.dtype = enum
    shape = value.get("shape")
    if shape is not None:
        if not isinstance(shape, list):
            raise UserError(f"{label}.shape must be a list of integers")
        out.shape.extend(_int(s, f"{label}.shape[{i}]") for i, s in enumerate(shape))


def _datum(value: Any, where: str, out: pb.Datum) -> None:
    if not isinstance(value, dict):
        raise UserError(f"{where} must be an object, got {type(value).__name__}")
    model_input = value.get("model_input")
    chunks = model_input.get("chunks") if isinstance(model_input, dict) else None
    if not isinstance(chunks, list):
        raise UserError(f"{where}.model_input.chunks must be a list")
    for c, chunk in enumerate(chunks):
        label = f"{where}.model_input.chunks[{c}]"
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else type(chunk).__name__
            raise UserError(f"{label} is a {kind!r} chunk; this server takes encoded_text only")
        tokens = chunk.get("tokens")
        if not isinstance(tokens, list) or not all(
            type(t) is int and 0 <= t < 2**31 for t in tokens
        ):
            raise UserError(f"{label}.tokens must be a list of non-negative int32 token ids")
        out.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype="<i4").tobytes()
    inputs = value.get("loss_fn_inputs", {})
    if not isinstance(inputs, dict):
        raise UserError(f"{where}.loss_fn_inputs must be an object")
    for key, tensor in inputs.items():
        _tensor(tensor, f"{where}.loss_fn_inputs[{key!r}]", out.loss_fn_inputs[key])
    for field in ("model_input_spans", "loss_fn_input_spans"):
        spans = value.get(field)
        if spans is None:
            continue
        if not isinstance(spans, list):
            raise UserError(f"{where}.{field} must be a list of spans")
        for j, span in enumerate(spans):
            _span(span, f"{where}.{field}[{j}]", getattr(out, field).add())


def to_proto(body: dict[str, Any]) -> pb.ForwardBackwardRequest:
    """The whole request as protobuf; UserError naming the field that does not convert."""
    model_id, seq_id, _ = envelope(body)
    payload, forward_only = _input(body)
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, forward_only=forward_only)
    loss_fn = payload.get("loss_fn")
    if not isinstance(loss_fn, str):
        raise UserError(f"loss_fn must be a string, got {loss_fn!r}")
    msg.loss_fn = loss_fn
    config = payload.get("loss_fn_config") or {}
    if not isinstance(config, dict):
        raise UserError("loss_fn_config must be an object of numbers")
    for key, number in config.items():
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise UserError(f"loss_fn_config[{key!r}] must be a number, got {number!r}")
        msg.loss_fn_config_v2[key].number = float(number)
    data = payload.get("data")
    if not isinstance(data, list):
        raise UserError("data must be a list of datums")
    for i, datum in enumerate(data):
        _datum(datum, f"data[{i}]", msg.data.add())
    return msg
