"""The `stability_records` table: what a sample taken with `record_stability_info=true` leaves
for the `stable_reinforce` loss, one row per sample request.

A row holds the request's prompt and, for each of its sequences, the sampled token ids and the
sampler's log-prob of each under the exact version that sampled them (`version`, the sampler's
version key). A sequence's id is `<request_id>:<index>` (ids.sample_sequence_ids), so one row
answers for all of a request's sequences and the prompt is stored once, not once per sample.

Rows belong to the tenant and the session that sampled them. `last_used` starts at the sample
and moves forward each time a training request names one of the row's sequences; a row unused
for the server's record TTL (a day) is expired. `size_bytes` is what the row costs against the
tenant's record quota (server/ops/stability.py; the table's statements are in
database.py's schema); insertion checks that quota in the same transaction, so
concurrent samples cannot together pass it.
"""

from __future__ import annotations

import itertools
import sqlite3
from dataclasses import dataclass

import numpy as np

from lorafleet.server.state.store.database import Database


@dataclass(frozen=True)
class RecordedSequence:
    tokens: np.ndarray  # int32, the sampled token ids
    logprobs: np.ndarray  # float32, the sampler's log-prob of each


@dataclass(frozen=True)
class StabilityRecord:
    request_id: str
    tenant: str
    session_id: str
    version: str  # the sampler's version key that sampled every sequence ("base" for the base)
    prompt: np.ndarray  # int32
    sequences: tuple[RecordedSequence, ...]
    created_at: float
    last_used: float

    @property
    def size_bytes(self) -> int:
        """What the row costs against the tenant's quota: its arrays and a fixed overhead."""
        return record_bytes(len(self.prompt), [len(s.tokens) for s in self.sequences])


ROW_OVERHEAD_BYTES = 256  # ids, version, times, index entries


def record_bytes(prompt_len: int, sequence_lengths: list[int]) -> int:
    """Bytes of a record: 4 per prompt token, 8 per sampled token (id + log-prob), 4 per
    sequence offset, plus the row's overhead."""
    return (
        ROW_OVERHEAD_BYTES
        + 4 * prompt_len
        + 8 * sum(sequence_lengths)
        + 4 * (len(sequence_lengths) + 1)
    )


def _decode(row: sqlite3.Row) -> StabilityRecord:
    tokens = np.frombuffer(row["tokens"], dtype="<i4")
    logprobs = np.frombuffer(row["logprobs"], dtype="<f4")
    offsets = np.frombuffer(row["offsets"], dtype="<i4")
    sequences = tuple(
        RecordedSequence(tokens[a:b].astype(np.int32), logprobs[a:b].astype(np.float32))
        for a, b in itertools.pairwise(offsets.tolist())
    )
    return StabilityRecord(
        request_id=row["request_id"],
        tenant=row["tenant"],
        session_id=row["session_id"],
        version=row["version"],
        prompt=np.frombuffer(row["prompt"], dtype="<i4").astype(np.int32),
        sequences=sequences,
        created_at=row["created_at"],
        last_used=row["last_used"],
    )


class QuotaFull(Exception):
    """The record would take the tenant past its quota; nothing was written."""

    def __init__(self, used: int, needed: int, quota: int):
        super().__init__(f"{used} + {needed} > {quota}")
        self.used, self.needed, self.quota = used, needed, quota


class StabilityRecordsTable:
    def __init__(self, db: Database):
        self._db = db

    def add(self, record: StabilityRecord, quota_bytes: int) -> None:
        """Inserts the record if the tenant's records stay within `quota_bytes` with it; else
        QuotaFull. A request id already recorded (a retried sample) is left as it was."""
        lengths = np.array([0, *[len(s.tokens) for s in record.sequences]], dtype=np.int64)
        offsets = np.cumsum(lengths).astype("<i4")
        tokens = np.concatenate([s.tokens for s in record.sequences] or [np.zeros(0)])
        logprobs = np.concatenate([s.logprobs for s in record.sequences] or [np.zeros(0)])
        size = record.size_bytes

        def insert(db: sqlite3.Connection) -> None:
            db.execute("BEGIN IMMEDIATE")
            try:
                exists = db.execute(
                    "SELECT 1 FROM stability_records WHERE request_id=?", (record.request_id,)
                ).fetchone()
                if exists is None:
                    used = int(
                        db.execute(
                            "SELECT COALESCE(SUM(size_bytes), 0) FROM stability_records "
                            "WHERE tenant=?",
                            (record.tenant,),
                        ).fetchone()[0]
                    )
                    if used + size > quota_bytes:
                        raise QuotaFull(used, size, quota_bytes)
                    db.execute(
                        "INSERT INTO stability_records VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (
                            record.request_id,
                            record.tenant,
                            record.session_id,
                            record.version,
                            record.prompt.astype("<i4").tobytes(),
                            tokens.astype("<i4").tobytes(),
                            logprobs.astype("<f4").tobytes(),
                            offsets.tobytes(),
                            size,
                            record.created_at,
                            record.last_used,
                        ),
                    )
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

        self._db.write(insert)

    def get(self, request_id: str) -> StabilityRecord | None:
        row = self._db.one("SELECT * FROM stability_records WHERE request_id=?", (request_id,))
        return None if row is None else _decode(row)

    def touch(self, request_ids: list[str], now: float) -> None:
        """Marks the records used at `now` (a training request named their sequences)."""
        if not request_ids:
            return

        def update(db: sqlite3.Connection) -> None:
            db.executemany(
                "UPDATE stability_records SET last_used=MAX(last_used, ?) WHERE request_id=?",
                [(now, rid) for rid in request_ids],
            )

        self._db.write(update)

    def bytes_of_tenant(self, tenant: str) -> int:
        row = self._db.one(
            "SELECT COALESCE(SUM(size_bytes), 0) AS n FROM stability_records WHERE tenant=?",
            (tenant,),
        )
        return int(row["n"]) if row is not None else 0

    def count_of_tenant(self, tenant: str) -> int:
        row = self._db.one("SELECT COUNT(*) AS n FROM stability_records WHERE tenant=?", (tenant,))
        return int(row["n"]) if row is not None else 0

    def delete_unused_since(self, before: float) -> int:
        """Deletes the records last used before `before` (expired); how many."""
        return self._db.run("DELETE FROM stability_records WHERE last_used < ?", (before,))

    def delete_of_session(self, session_id: str) -> int:
        """Deletes a finished session's records (nothing can train on them any more)."""
        return self._db.run("DELETE FROM stability_records WHERE session_id=?", (session_id,))
