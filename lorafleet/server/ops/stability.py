"""Stability records (what a `record_stability_info=true` sample leaves behind) and the
provenance spans that name them in training requests.

Why: `stable_reinforce` (train/losses.py) weighs each sampled token by its current log-prob
against the log-prob the sampler had when it drew it. Taking that number from the client
would let any bug or shortcut on the client (a re-tokenised prompt, log-probs from another
version, a sample from somewhere else) silently bias training; so the server keeps its own
record of every such sample and a training datum says, span by span, which recorded tokens it
reproduces. The server checks every claim and trains on its own numbers only.

Lifecycle (docs/tinker_api.md, "Stability records"): a record belongs to the tenant and the
session that sampled it; it lasts `ttl_s` (a day) after its last use, each training request
that names one of its sequences renewing it; a finished session's records are deleted; a
tenant's records take at most `quota_bytes` (a sample that could pass it is refused with 403
before it runs, and one that would pass it when its record is written fails); records are in
SQLite, so they outlive a restart together with their session.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from lorafleet.sample.types import SampleResult
from lorafleet.server.errors import UserError
from lorafleet.server.ops.quotas import QuotaExceeded
from lorafleet.server.ops.types import Recording, WireDatum
from lorafleet.server.state.store import Store
from lorafleet.server.state.store.stability_records import (
    QuotaFull,
    RecordedSequence,
    StabilityRecord,
    record_bytes,
)
from lorafleet.train.loss_inputs import SAMPLED_SEQUENCE, STABLE_REINFORCE, TARGETS

DAY_S = 24 * 3600.0


@dataclass(frozen=True)
class StabilityPolicy:
    ttl_s: float = DAY_S  # a record unused this long is expired
    quota_bytes: int = 256 << 20  # per tenant, every record of every session


@dataclass(frozen=True)
class Span:
    """One provenance claim: datum positions that reproduce `[offset, offset + length)` of a
    recorded sequence's prompt (`kind` "prompt") or of its sampled tokens ("sampled")."""

    kind: str  # "prompt" | "sampled"
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class DatumSpans:
    model_input: list[Span] | None
    loss_fn_inputs: list[Span] | None


# --------------------------------------------------------------------------- sampling side


def _version_text(key: tuple[str, int] | None) -> str:
    return "base" if key is None else f"{key[0]}#{key[1]}"


def check_room(store: Store, tenant: str, policy: StabilityPolicy, bound: int) -> None:
    """Refuses (403) a recording sample whose record could take the tenant past its quota;
    `bound` is the most bytes its record can take (`record_bound`)."""
    used = store.stability_records.bytes_of_tenant(tenant)
    if used + bound > policy.quota_bytes:
        raise QuotaExceeded(
            f"stability records: this sample could record up to {bound} bytes, and this tenant's "
            f"records already take {used} of its quota of {policy.quota_bytes} bytes; records "
            f"expire {policy.ttl_s:.0f} s after their last use and a session's records go when "
            "it ends (close finished ServiceClients), or sample fewer or shorter sequences"
        )


def record_bound(prompt_len: int, num_samples: int, max_tokens: int) -> int:
    return record_bytes(prompt_len, [max_tokens] * num_samples)


def write_record(
    store: Store,
    request_id: str,
    tenant: str,
    recording: Recording,
    prompt: list[int],
    output: SampleResult,
    now: float | None = None,
) -> None:
    """Stores what a finished recording sample produced; UserError (403) when it would take
    the tenant past its quota (nothing is written, and the sample fails: its sequences could
    not be trained with stable_reinforce)."""
    now = time.time() if now is None else now
    record = StabilityRecord(
        request_id=request_id,
        tenant=tenant,
        session_id=recording.session_id,
        version=_version_text(output.adapter),
        prompt=np.asarray(prompt, dtype=np.int32),
        sequences=tuple(
            RecordedSequence(
                np.asarray(seq.tokens, dtype=np.int32),
                np.asarray(seq.logprobs, dtype=np.float32),
            )
            for seq in output.sequences
        ),
        created_at=now,
        last_used=now,
    )
    try:
        store.stability_records.add(record, recording.quota_bytes)
    except QuotaFull as full:
        raise QuotaExceeded(
            f"stability records: this sample's record takes {full.needed} bytes, and this "
            f"tenant's records already take {full.used} of its quota of {full.quota} bytes; "
            "its sequences were not recorded (sample again once records expire or sessions end)"
        ) from None


# --------------------------------------------------------------------------- training side


def _split_id(sequence_id: str) -> tuple[str, int] | None:
    request_id, sep, index = sequence_id.rpartition(":")
    if not sep or not request_id or not index.isdigit():
        return None
    return request_id, int(index)


class _Records:
    """The records one training request names, read once each, checked for the caller."""

    def __init__(
        self, store: Store, tenant: str, session_id: str, policy: StabilityPolicy, now: float
    ):
        self.store, self.tenant, self.session_id = store, tenant, session_id
        self.policy, self.now = policy, now
        self.read: dict[str, StabilityRecord | None] = {}

    def sequence(self, sequence_id: str, where: str) -> tuple[StabilityRecord, int]:
        parts = _split_id(sequence_id)
        record = None
        if parts is not None:
            if parts[0] not in self.read:
                self.read[parts[0]] = self.store.stability_records.get(parts[0])
            record = self.read[parts[0]]
        # Another tenant's record answers as an unknown one: its existence is not disclosed.
        if record is None or record.tenant != self.tenant or parts is None:
            raise UserError(
                f"{where}: sequence_id {sequence_id!r} has no stability record for this tenant "
                "(sample with record_stability_info=true; records end with their session and "
                f"{self.policy.ttl_s:.0f} s after their last use)"
            )
        if record.session_id != self.session_id:
            raise UserError(
                f"{where}: sequence_id {sequence_id!r} was sampled in session "
                f"{record.session_id}, not in this model's session {self.session_id}; records "
                "belong to the session that sampled them"
            )
        unused = self.now - record.last_used
        if unused > self.policy.ttl_s:
            raise UserError(
                f"{where}: sequence_id {sequence_id!r} has expired: its record was last used "
                f"{unused:.0f} s ago, longer than the {self.policy.ttl_s:.0f} s records last"
            )
        if parts[1] >= len(record.sequences):
            raise UserError(
                f"{where}: sequence_id {sequence_id!r} names sample {parts[1]} of a request that "
                f"drew {len(record.sequences)}"
            )
        return record, parts[1]


def _check_tiling(spans: list[Span], length: int, where: str, field: str) -> None:
    if len(spans) > length + 1:
        # Each span costs a record lookup: a field of n positions needs at most n runs (the
        # SDK never sends empty ones), so more is refused before any is looked up.
        raise UserError(
            f"{where}.{field} has {len(spans)} spans for {length} positions; at most "
            f"{length + 1} are accepted"
        )
    for j, span in enumerate(spans):
        if span.length < 0 or span.offset < 0:
            raise UserError(
                f"{where}.{field}[{j}] has offset {span.offset} and length {span.length}; both "
                "must be >= 0"
            )
    total = sum(span.length for span in spans)
    if total != length:
        raise UserError(
            f"{where}.{field} cover {total} positions but the field has {length}; the spans "
            "must tile it exactly (Datum.with_provenance)"
        )


def _check_tokens(
    records: _Records,
    spans: list[Span],
    given: np.ndarray,
    where: str,
    field: str,
    what: str,
    *,
    prompt_tokens: bool = True,
) -> list[tuple[int, int, StabilityRecord, int, int]]:
    """Checks every span's tokens against its record; the spans' placements
    `(datum start, length, record, sample index, offset)`. `prompt_tokens=False` checks prompt
    spans for existence and range only: targets under a prompt span carry no stable_reinforce
    loss (they are not sampled tokens), and clients pad them (the cookbook's rl_loop sends 0)."""
    placed = []
    position = 0
    for j, span in enumerate(spans):
        label = f"{where}.{field}[{j}]"
        record, index = records.sequence(span.sequence_id, label)
        if span.kind == "prompt":
            source, named = record.prompt, "prompt"
        else:
            source, named = record.sequences[index].tokens, "sampled tokens"
        end = span.offset + span.length
        if end > len(source):
            raise UserError(
                f"{label}: positions [{span.offset}, {end}) of sequence {span.sequence_id!r}'s "
                f"{named} do not exist (it has {len(source)})"
            )
        got = given[position : position + span.length]
        want = source[span.offset : end]
        checked = prompt_tokens or span.kind != "prompt"
        bad = np.flatnonzero(got != want) if checked else np.zeros(0, dtype=np.int64)
        if bad.size:
            k = int(bad[0])
            raise UserError(
                f"{where}: {what} position {position + k} is token {int(got[k])}, but "
                f"{field}[{j}] says it is position {span.offset + k} of sequence "
                f"{span.sequence_id!r}'s {named}, which is token {int(want[k])} (expected "
                f"{int(want[k])}, given {int(got[k])})"
            )
        placed.append((position, span.length, record, index, span.offset))
        position += span.length
    return placed


def attach(
    store: Store,
    policy: StabilityPolicy,
    tenant: str,
    session_id: str,
    loss_fn: str,
    data: list[WireDatum],
    spans: list[DatumSpans],
    now: float | None = None,
) -> list[WireDatum]:
    """Checks every datum's spans and returns the data to train: for `stable_reinforce`, each
    datum's `logprobs` replaced by the recorded sampler log-probs and `sampled_sequence` set
    (1, 2, ... for the recorded sampled tokens of the datum's 1st, 2nd, ... span of sampled
    tokens, 0 elsewhere); other losses train on the data as sent, their spans only checked to
    tile (the cookbook attaches spans to every datum, recorded or not). Renews the records it
    used. UserError naming the datum, position, expected and given token on any mismatch;
    then nothing is renewed and nothing trains."""
    now = time.time() if now is None else now
    stable = loss_fn == STABLE_REINFORCE
    records = _Records(store, tenant, session_id, policy, now)
    out: list[WireDatum] = []
    for i, (datum, datum_spans) in enumerate(zip(data, spans, strict=True)):
        where = f"data[{i}]"
        if SAMPLED_SEQUENCE in datum.loss_inputs:
            raise UserError(
                f"{where}.loss_fn_inputs[{SAMPLED_SEQUENCE!r}] is set by this server from the "
                "provenance spans; do not send it"
            )
        model_spans, loss_spans = datum_spans.model_input, datum_spans.loss_fn_inputs
        if (model_spans is None) != (loss_spans is None):
            raise UserError(
                f"{where} has {'model_input_spans' if loss_spans is None else 'loss_fn_input_spans'}"
                " without the other; provenance comes as a pair (Datum.with_provenance)"
            )
        if model_spans is None or loss_spans is None:
            if stable:
                raise UserError(
                    f"{where} has no provenance spans; loss_fn 'stable_reinforce' trains only on "
                    "sequences the server recorded, named by Datum.with_provenance (sample with "
                    "record_stability_info=true)"
                )
            out.append(datum)
            continue
        targets = datum.loss_inputs.get(TARGETS)
        tokens = datum.tokens.numpy()
        _check_tiling(model_spans, len(tokens), where, "model_input_spans")
        if not stable:
            # as the SDK's with_provenance: loss spans tile 1-D targets ([T, K] ones are not tiled)
            if targets is not None and targets.dim() == 1:
                _check_tiling(loss_spans, int(targets.numel()), where, "loss_fn_input_spans")
            out.append(datum)
            continue
        if targets is None or targets.dim() != 1:
            raise UserError(
                f"{where}: stable_reinforce needs a 1-D loss_fn_inputs[{TARGETS!r}] for the "
                "loss_fn_input_spans to tile"
            )
        _check_tiling(loss_spans, int(targets.numel()), where, "loss_fn_input_spans")
        _check_tokens(records, model_spans, tokens, where, "model_input_spans", "model_input")
        placed = _check_tokens(
            records,
            loss_spans,
            targets.numpy(),
            where,
            "loss_fn_input_spans",
            "target_tokens",
            prompt_tokens=False,
        )
        logprobs = torch.zeros(targets.shape, dtype=torch.float32)
        segment = torch.zeros(targets.shape, dtype=torch.float32)
        sampled_runs = 0
        for (start, length, record, index, offset), span in zip(placed, loss_spans, strict=True):
            if span.kind != "sampled" or length == 0:
                continue
            sampled_runs += 1
            recorded = record.sequences[index].logprobs[offset : offset + length]
            logprobs[start : start + length] = torch.from_numpy(recorded.copy())
            segment[start : start + length] = float(sampled_runs)
        if sampled_runs == 0:
            raise UserError(
                f"{where}: none of its loss_fn_input_spans is a sampled span, so no target is a "
                "recorded sampled token and stable_reinforce has nothing to train"
            )
        if not bool(torch.isfinite(logprobs).all()):
            raise UserError(f"{where}: a recorded sampler log-prob is not finite")
        inputs = dict(datum.loss_inputs)
        inputs["logprobs"] = logprobs
        inputs[SAMPLED_SEQUENCE] = segment
        out.append(WireDatum(tokens=datum.tokens, loss_inputs=inputs))
    store.stability_records.touch(sorted(r for r in records.read if records.read[r]), now)
    return out


def spans_from_proto(datum: object) -> DatumSpans:
    """A protobuf Datum's `model_input_spans` / `loss_fn_input_spans` (None when absent)."""

    def convert(items: object) -> list[Span] | None:
        spans = []
        for item in items:  # type: ignore[attr-defined]
            which = item.WhichOneof("span")
            if which not in ("prompt_tokens", "sampled_tokens"):
                raise UserError(
                    f"a provenance span has no prompt_tokens or sampled_tokens ({which})"
                )
            arm = getattr(item, which)
            spans.append(
                Span(
                    "prompt" if which == "prompt_tokens" else "sampled",
                    arm.sequence_id,
                    int(arm.offset),
                    int(arm.length),
                )
            )
        return spans or None

    return DatumSpans(
        convert(datum.model_input_spans),  # type: ignore[attr-defined]
        convert(datum.loss_fn_input_spans),  # type: ignore[attr-defined]
    )
