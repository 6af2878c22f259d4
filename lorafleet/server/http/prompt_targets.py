"""The prompt-scoring fields of a sample request off the JSON wire: `target_prompt_logprobs`
(Tinker's TensorData, dense or sparse CSR) into the sampler's dense id matrix, and
`prompt_alt_tokens_k`, both checked and bounded before anything runs. Token ids are checked
against the vocabulary by the sampler, which knows it.

Sparse CSR lists only the cells that ask for something: an unlisted cell is unused (-1), whatever
pad value the client densifies with, and the response keeps the request's CSR indices.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lorafleet.sample.validate import MAX_PROMPT_SCORES
from lorafleet.server.errors import UserError
from lorafleet.server.ops.types import PromptTargets

FIELD = "target_prompt_logprobs"
_KEYS = frozenset({"data", "dtype", "shape", "sparse_crow_indices", "sparse_col_indices"})


def _ints(value: object, label: str, limit: int) -> np.ndarray:
    """A JSON list of at most `limit` integers as int64 (bools and floats are not ids)."""
    if not isinstance(value, list):
        raise UserError(f"{label} must be a list of integers, got {type(value).__name__}")
    if len(value) > limit:
        raise UserError(f"{label} has {len(value)} entries; its shape allows at most {limit}")
    for i, v in enumerate(value):
        if type(v) is not int or not -(1 << 63) <= v < (1 << 63):
            raise UserError(f"{label}[{i}] = {v!r} is not an int64")
    return np.asarray(value, dtype=np.int64).reshape(-1)


def _shape(value: object, prompt_len: int) -> tuple[int, int]:
    rows = prompt_len - 1
    if (
        not isinstance(value, list)
        or len(value) != 2
        or any(type(s) is not int or s < 0 for s in value)
    ):
        raise UserError(f"{FIELD}.shape must be [len(prompt) - 1, K] = [{rows}, K], got {value!r}")
    if value[0] != rows or value[1] < 1:
        raise UserError(
            f"{FIELD}.shape must be [len(prompt) - 1, K] = [{rows}, K] with K >= 1, got {value}"
        )
    if rows * value[1] > MAX_PROMPT_SCORES:
        raise UserError(
            f"{FIELD} of shape {value} asks for {rows * value[1]} scores, more than this "
            f"server's limit of {MAX_PROMPT_SCORES} ((len(prompt) - 1) * K)"
        )
    return rows, value[1]


def _sparse(
    data: np.ndarray, crow_raw: object, col_raw: object, rows: int, width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    crow = _ints(crow_raw, f"{FIELD}.sparse_crow_indices", rows + 1)
    col = _ints(col_raw, f"{FIELD}.sparse_col_indices", rows * width)
    if crow.size != rows + 1:
        raise UserError(
            f"{FIELD}.sparse_crow_indices has {crow.size} entries; {rows} rows need {rows + 1}"
        )
    if crow[0] != 0 or np.any(np.diff(crow) < 0) or crow[-1] != col.size:
        raise UserError(
            f"{FIELD}.sparse_crow_indices must start at 0, never decrease and end at "
            f"nnz = {col.size}, got {crow.tolist()[:8]}{'...' if crow.size > 8 else ''}"
        )
    if data.size != col.size:
        raise UserError(f"{FIELD} has {data.size} values but {col.size} sparse_col_indices")
    if col.size and (col.min() < 0 or col.max() >= width):
        bad = int(col.min()) if col.min() < 0 else int(col.max())
        raise UserError(f"{FIELD}.sparse_col_indices has {bad}, outside [0, {width})")
    row_of = np.repeat(np.arange(rows, dtype=np.int64), np.diff(crow))
    if np.any(np.diff(row_of * width + col) <= 0):
        raise UserError(
            f"{FIELD}.sparse_col_indices must be increasing within each row (a cell listed twice?)"
        )
    ids = np.full((rows, width), -1, dtype=np.int64)
    ids[row_of, col] = data
    return ids, crow, col


def parse_targets(raw: dict[str, Any], prompt_len: int) -> PromptTargets:
    """Raises UserError naming the first bad part of the tensor."""
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise UserError(f"{FIELD} has unknown field(s) {unknown}; known: {sorted(_KEYS)}")
    if prompt_len < 2:
        raise UserError(
            f"{FIELD} needs a prompt of at least 2 tokens (position 0 has no preceding context), "
            f"got {prompt_len}"
        )
    if raw.get("dtype") != "int64":
        raise UserError(f"{FIELD}.dtype must be 'int64' (token ids), got {raw.get('dtype')!r}")
    rows, width = _shape(raw.get("shape"), prompt_len)
    data = _ints(raw.get("data"), f"{FIELD}.data", rows * width)
    crow_raw, col_raw = raw.get("sparse_crow_indices"), raw.get("sparse_col_indices")
    crow: np.ndarray | None = None
    col: np.ndarray | None = None
    if crow_raw is None and col_raw is None:
        if data.size != rows * width:
            raise UserError(
                f"{FIELD}.data has {data.size} values but shape [{rows}, {width}] needs {rows * width}"
            )
        ids = data.reshape(rows, width)
    elif crow_raw is None or col_raw is None:
        raise UserError(
            f"{FIELD}: sparse_crow_indices and sparse_col_indices come together (sparse CSR) "
            "or not at all (dense)"
        )
    else:
        ids, crow, col = _sparse(data, crow_raw, col_raw, rows, width)
    if data.size and int(data.min()) < -1:
        where = int(np.argmin(data))
        raise UserError(
            f"{FIELD}.data[{where}] = {int(data[where])}: a cell is a token id or -1 (unused)"
        )
    if not bool((ids >= 0).any()):
        raise UserError(f"{FIELD} names no token id (every cell is -1)")
    return PromptTargets(torch.from_numpy(np.ascontiguousarray(ids)), crow, col)


def check_alt_tokens_k(k: int, prompt_len: int) -> int:
    if k < 0:
        raise UserError(f"prompt_alt_tokens_k must be 0 or greater, got {k}")
    if max(prompt_len - 1, 0) * k > MAX_PROMPT_SCORES:
        raise UserError(
            f"prompt_alt_tokens_k={k} with a {prompt_len}-token prompt asks for "
            f"{(prompt_len - 1) * k} draws, more than this server's limit of {MAX_PROMPT_SCORES} "
            "((len(prompt) - 1) * k)"
        )
    return k
