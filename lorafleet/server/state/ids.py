"""The ids this server issues, in one place, because clients and the store both depend on their
shape: the SDK derives a model id from the session and its `model_seq_id`, and a sampling
session id from its `sampling_session_seq_id`, so a retried create lands on the same id.
(`tinker://` checkpoint paths and their directories are in paths.py.)"""

from __future__ import annotations

import uuid


def new_session_id() -> str:
    return str(uuid.uuid4())


def new_request_id() -> str:
    return str(uuid.uuid4())


def model_id(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def sampling_session_id(session_id: str, sampling_session_seq_id: int) -> str:
    return f"{session_id}:sample:{sampling_session_seq_id}"


def sample_sequence_ids(request_id: str, num_samples: int) -> list[str]:
    return [f"{request_id}:{i}" for i in range(num_samples)]
