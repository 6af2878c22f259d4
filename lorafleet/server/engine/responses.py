"""Engine results in the SDK's protobuf wire format: `ForwardBackwardOutput` carries per-datum
arrays as `BatchedTensor`s (all datums' bytes concatenated, int64 byte offsets, shared trailing
shape), `SampleResponse` carries int32 tokens and float32 log-probs (NaN where a prompt position
has none)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb

from lorafleet.sample.types import PromptAltTokens, SampleResult, TopK
from lorafleet.server.ops.types import PromptTargets

EMPTY_TOPK_LOGPROB = -99999.0  # what the SDK expects in unused top-k cells


def forward_backward_output(logprobs: Sequence[torch.Tensor], metrics: dict[str, float]) -> bytes:
    """One ArrayRecord per run of datums sharing a trailing shape ([T] or [T, K] targets)."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    start = 0
    while start < len(logprobs):
        trailing = tuple(logprobs[start].shape[1:])
        end = start
        while end < len(logprobs) and tuple(logprobs[end].shape[1:]) == trailing:
            end += 1
        arrays = [
            t.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False)
            for t in logprobs[start:end]
        ]
        offsets = np.zeros(len(arrays) + 1, dtype="<i8")
        offsets[1:] = np.cumsum([a.nbytes for a in arrays])
        record = out.loss_fn_outputs.add(num_datums=len(arrays))
        field = record.fields["logprobs"]
        field.data = b"".join(a.tobytes() for a in arrays)
        field.offsets = offsets.tobytes()
        field.dtype = pb.DTYPE_FLOAT32
        field.trailing_shape.extend(trailing)
        start = end
    return out.SerializeToString()


def _topk(rows: Sequence[Sequence[tuple[int, float]] | None], k: int) -> pb.TopkLogprobs:
    ids = np.zeros((len(rows), k), dtype="<i4")
    values = np.full((len(rows), k), EMPTY_TOPK_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate((row or [])[:k]):
            ids[i, j] = token
            values[i, j] = logprob
    return pb.TopkLogprobs(
        token_ids=ids.tobytes(), logprobs=values.tobytes(), k=k, length=len(rows)
    )


def _dense(array: torch.Tensor, dtype: pb.DType.ValueType, np_dtype: str) -> pb.Tensor:
    values = array.detach().cpu().contiguous().numpy().astype(np_dtype, copy=False)
    return pb.Tensor(dense=values.tobytes(), dtype=dtype, shape=list(array.shape))


def _target_logprobs(targets: PromptTargets, values: torch.Tensor) -> pb.Tensor:
    """The request's layout: dense, or its own CSR indices with a value per listed cell."""
    if targets.crow is None or targets.col is None:
        return _dense(values, pb.DTYPE_FLOAT32, "<f4")
    row_of = np.repeat(np.arange(values.shape[0], dtype=np.int64), np.diff(targets.crow))
    listed = values.numpy()[row_of, targets.col].astype("<f4")
    return pb.Tensor(
        sparse_csr=pb.SparseCsr(
            values=listed.tobytes(),
            crow_indices=targets.crow.astype("<i8").tobytes(),
            col_indices=targets.col.astype("<i8").tobytes(),
        ),
        dtype=pb.DTYPE_FLOAT32,
        shape=list(values.shape),
    )


def _alt_tokens(alt: PromptAltTokens) -> pb.PromptAltTokens:
    return pb.PromptAltTokens(
        tokens=_dense(alt.tokens, pb.DTYPE_INT32, "<i4"),
        logprobs=_dense(alt.logprobs, pb.DTYPE_FLOAT32, "<f4"),
    )


def sample_response(
    result: SampleResult,
    *,
    prompt_logprobs: bool,
    topk_prompt: int,
    topk_sample: int,
    last_n: int | None,
    targets: PromptTargets | None = None,
) -> bytes:
    """`last_n` blanks only prompt_logprobs and their top-k; target ids and alternative tokens
    cover the whole prompt (Tinker's semantics)."""
    out = pb.SampleResponse(prompt_cache_hit_tokens=result.prompt_cache_hit_tokens)
    for seq in result.sequences:
        item = out.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes(),
        )
        if topk_sample and seq.topk_logprobs is not None:
            item.topk_sampled_logprobs.CopyFrom(_topk(seq.topk_logprobs, topk_sample))
    if prompt_logprobs and result.prompt_logprobs is not None:
        values = np.array(
            [math.nan if v is None else v for v in result.prompt_logprobs], dtype="<f4"
        )
        if last_n is not None:
            values[: max(0, values.size - last_n)] = math.nan
        out.prompt_logprobs = values.tobytes()
    if topk_prompt and result.topk_prompt_logprobs is not None:
        rows = list(result.topk_prompt_logprobs)
        if last_n is not None:
            blanks: list[TopK | None] = [None] * max(0, len(rows) - last_n)
            rows = blanks + rows[max(0, len(rows) - last_n) :]
        out.topk_prompt_logprobs.CopyFrom(_topk(rows, topk_prompt))
    if targets is not None and result.target_prompt_logprobs is not None:
        out.target_prompt_logprobs.CopyFrom(
            _target_logprobs(targets, result.target_prompt_logprobs)
        )
    if result.prompt_alt_tokens is not None:
        out.prompt_alt_tokens.CopyFrom(_alt_tokens(result.prompt_alt_tokens))
    return out.SerializeToString()
