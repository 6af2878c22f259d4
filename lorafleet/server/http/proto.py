"""The protobuf forward_backward request into an op's typed call.

 `parse_forward_backward` only parses the envelope (model id, seq id), so a request
whose data is malformed still takes its place in the model's seq order and fails as a future
(a 4xx there would leave a hole the following requests wait on); `decode_data` then turns each
Datum into tensors, validating byte lengths, dtypes, shapes and sparse CSR structure with
messages that name the datum and field.

"""

from __future__ import annotations

import math

import numpy as np
import torch
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from lorafleet.server.errors import UserError
from lorafleet.server.ops.fair_share import datum_costs
from lorafleet.server.ops.types import Forward, ForwardBackward, WireDatum

_NUMPY_DTYPES: dict[int, tuple[str, np.dtype]] = {
    pb.DTYPE_FLOAT32: ("float32", np.dtype("<f4")),
    pb.DTYPE_INT64: ("int64", np.dtype("<i8")),
    pb.DTYPE_INT32: ("int32", np.dtype("<i4")),
    pb.DTYPE_BFLOAT16: ("bfloat16", np.dtype("<u2")),
}
_MAX_ELEMENTS = 1 << 28  # a declared shape beyond this is an attack or a bug, not data
# Sparse CSR is the one encoding whose decoded size is not bounded by the body: a few hundred
# bytes of row pointers can declare a [16384, 16384] matrix. Densified sizes are capped per
# tensor and per request, so one request cannot make the server allocate gigabytes.
_MAX_SPARSE_ELEMENTS = 1 << 24
_MAX_REQUEST_ELEMENTS = 1 << 26


def parse_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    """Parses the envelope; raises UserError for bytes that are not a ForwardBackwardRequest."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise UserError(
            f"request body is not a valid protobuf ForwardBackwardRequest ({len(body)} bytes): {exc}"
        ) from exc
    if not msg.model_id:
        raise UserError(
            "ForwardBackwardRequest.model_id is empty (is the body really a ForwardBackwardRequest?)"
        )
    if msg.seq_id < 1:
        raise UserError(
            f"ForwardBackwardRequest.seq_id must be >= 1 (seq 0 is the model's creation), got {msg.seq_id}"
        )
    return msg


def decode_call(msg: pb.ForwardBackwardRequest) -> Forward | ForwardBackward:
    """The request's op, its datums decoded into tensors and measured (their tokens, and what
    fair share counts of each: `fair_share.datum_costs`)."""
    if not msg.loss_fn:
        raise UserError("loss_fn is empty")
    if not msg.data:
        raise UserError("data is empty: a forward_backward needs at least one datum")
    data = _data(msg)
    op = Forward if msg.forward_only else ForwardBackward
    return op(
        loss_fn=msg.loss_fn,
        loss_config=_loss_config(msg),
        data=data,
        datum_tokens=tuple(int(d.tokens.numel()) for d in data),
        datum_costs=tuple(datum_costs([d.tokens for d in data])),
    )


def _loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, float] | None:
    config: dict[str, float] = {}
    if msg.loss_fn_config_v2:
        for key, value in msg.loss_fn_config_v2.items():
            which = value.WhichOneof("value")
            if which == "number":
                config[key] = value.number
            elif which == "text":
                raise UserError(
                    f"loss_fn_config[{key!r}] = {value.text!r}: text values are not accepted by any loss here"
                )
            else:
                raise UserError(f"loss_fn_config[{key!r}] has no value")
    else:
        config.update(msg.loss_fn_config.items())
    return config or None


def _data(msg: pb.ForwardBackwardRequest) -> list[WireDatum]:
    data, total = [], 0
    for i, d in enumerate(msg.data):
        data.append(_datum(i, d))
        total += sum(t.numel() for t in data[-1].loss_inputs.values())
        if total > _MAX_REQUEST_ELEMENTS:
            raise UserError(
                f"data[0..{i}] already hold {total} loss-input values, more than this server's limit of "
                f"{_MAX_REQUEST_ELEMENTS} per request; split the call"
            )
    return data


def _datum(index: int, datum: pb.Datum) -> WireDatum:
    where = f"data[{index}]"
    pieces: list[np.ndarray] = []
    for c, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UserError(
                f"{where}.model_input.chunks[{c}] is a {kind or 'empty'} chunk; this server takes encoded_text only"
            )
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise UserError(
                f"{where}.model_input.chunks[{c}].tokens has {len(raw)} bytes, not a whole number of int32 tokens"
            )
        pieces.append(np.frombuffer(raw, dtype="<i4"))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype="<i4")
    if tokens.size == 0:
        raise UserError(f"{where}.model_input is empty")
    inputs = {
        key: _tensor(f"{where}.loss_fn_inputs[{key!r}]", tensor)
        for key, tensor in datum.loss_fn_inputs.items()
    }
    return WireDatum(tokens=torch.from_numpy(tokens.astype(np.int64)), loss_inputs=inputs)


def _tensor(label: str, msg: pb.Tensor) -> torch.Tensor:
    if msg.dtype not in _NUMPY_DTYPES:
        raise UserError(
            f"{label} has dtype enum {msg.dtype}; expected FLOAT32, INT64, INT32 or BFLOAT16"
        )
    name, dtype = _NUMPY_DTYPES[msg.dtype]
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise UserError(f"{label} has a negative dimension in shape {shape}")
    if shape and math.prod(shape) > _MAX_ELEMENTS:
        raise UserError(f"{label} declares shape {shape}, more than {_MAX_ELEMENTS} elements")
    encoding = msg.WhichOneof("encoding")
    if encoding == "sparse_csr":
        array = _sparse_csr(label, msg.sparse_csr, dtype, name, shape)
    else:
        raw = msg.dense
        if len(raw) % dtype.itemsize:
            raise UserError(
                f"{label} has {len(raw)} bytes of {name} data, not a multiple of {dtype.itemsize}"
            )
        array = np.frombuffer(raw, dtype=dtype)
        if shape:
            if math.prod(shape) != array.size:
                raise UserError(
                    f"{label} has {array.size} {name} values but its shape {shape} needs {math.prod(shape)}"
                )
            array = array.reshape(shape)
    if msg.dtype == pb.DTYPE_BFLOAT16:
        array = (array.astype(np.uint32) << 16).view(np.float32)
    return torch.from_numpy(np.array(array, dtype=array.dtype.newbyteorder("=")))


def _sparse_csr(
    label: str, csr: pb.SparseCsr, dtype: np.dtype, name: str, shape: list[int]
) -> np.ndarray:
    """Densifies with 0 in unlisted cells (the SDK's default pad value)."""
    if len(shape) != 2:
        raise UserError(f"{label} is sparse CSR, which needs a 2-D shape; got shape {shape}")
    rows, cols = shape
    if rows * cols > _MAX_SPARSE_ELEMENTS:
        raise UserError(
            f"{label} is sparse CSR of shape {shape}, more than {_MAX_SPARSE_ELEMENTS} values once dense"
        )
    for field_name, raw, size in (
        ("values", csr.values, dtype.itemsize),
        ("crow_indices", csr.crow_indices, 8),
        ("col_indices", csr.col_indices, 8),
    ):
        if len(raw) % size:
            raise UserError(
                f"{label}.sparse_csr.{field_name} has {len(raw)} bytes, not a multiple of {size}"
            )
    values = np.frombuffer(csr.values, dtype=dtype)
    crow = np.frombuffer(csr.crow_indices, dtype="<i8")
    col = np.frombuffer(csr.col_indices, dtype="<i8")
    if crow.size != rows + 1:
        raise UserError(
            f"{label}.sparse_csr.crow_indices has {crow.size} entries; shape {shape} needs {rows + 1}"
        )
    if crow[0] != 0 or np.any(np.diff(crow) < 0) or crow[-1] != col.size:
        raise UserError(
            f"{label}.sparse_csr.crow_indices must start at 0, never decrease and end at nnz={col.size}"
        )
    if values.size != col.size:
        raise UserError(f"{label}.sparse_csr has {values.size} values but {col.size} col_indices")
    if col.size and (col.min() < 0 or col.max() >= cols):
        bad = int(col.min()) if col.min() < 0 else int(col.max())
        raise UserError(f"{label}.sparse_csr.col_indices has {bad}, outside [0, {cols})")
    dense = np.zeros((rows, cols), dtype=dtype)
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    dense[row_of, col] = values
    return dense
