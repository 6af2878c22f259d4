"""Training ops as engine batches: the round's forward(_backward) chunks in one mixed batch
(forward-only and forward_backward apart), every ready optimizer step in one call.

Each request is checked on its own first (`Trainer.prepare`), so a bad one fails alone; a batch
that still fails is re-run request by request to find the culprit rather than failing its
neighbours.

A call fair share splits (scheduler.TrainChunk) is checked whole before its first chunk runs,
so a bad datum anywhere fails it before any gradient accumulates. Each chunk's gradient
accumulates in the slot as a separate call's would (losses are sums), and the last chunk's
result puts every datum's log-probs in order and merges the per-datum metrics exactly as the
unsplit call does."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lorafleet.adapters.hparams import DimuonHParams, OptimHParams
from lorafleet.interfaces import Trainer
from lorafleet.server.engine import faults, responses
from lorafleet.server.engine.live_models import LiveModels
from lorafleet.server.errors import ServerFault, UserError, exception_text
from lorafleet.server.ops.futures import Result
from lorafleet.server.ops.payloads import ForwardBackwardCall
from lorafleet.server.ops.scheduler import Op, Partial, TrainChunk
from lorafleet.train.engine import ItemOutput, PreparedItem, TrainItem
from lorafleet.train.losses import merge_metrics

log = logging.getLogger(__name__)

Group = list[tuple[int, list[PreparedItem]]]
"""(index of the chunk, its prepared items), for the chunks of one engine call."""


@dataclass(frozen=True)
class ChunkOutput:
    """What a chunk that is not its call's last hands back: per datum, log-probs and metrics."""

    logprobs: list[torch.Tensor]
    metrics: list[dict[str, float]]


def datum_tokens(op: Op) -> list[int]:
    """The tokens of each datum of a forward(_backward) op: what fair share counts."""
    call: ForwardBackwardCall = op.payload
    return [int(d.tokens.numel()) for d in call.data]


SHARING_WINDOW = 16
"""How many earlier datums of a call `datum_costs` compares each datum with: the turns of an
episode and the samples of a group come next to each other in the cookbook's and our RL job's
batches, and a bound keeps measuring a call linear in its tokens."""


def datum_costs(op: Op) -> list[int]:
    """What fair share counts for each datum of a forward(_backward) op: its tokens past the
    longest prefix it shares with one of the call's previous `SHARING_WINDOW` datums (at least
    one). The trainer runs a shared prefix once (train/prefix_trie.py), but only among datums of
    one round: counting raw tokens cut a multi-turn call into rounds of one or two turns each,
    and each turn recomputed the whole history. Metering still counts every token."""
    call: ForwardBackwardCall = op.payload
    costs: list[int] = []
    previous: list[torch.Tensor] = []
    for datum in call.data:
        tokens = datum.tokens.reshape(-1)
        shared = max((_common_prefix(tokens, other) for other in previous), default=0)
        costs.append(max(1, int(tokens.numel()) - shared))
        previous = [*previous[-(SHARING_WINDOW - 1) :], tokens]
    return costs


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(int(a.numel()), int(b.numel()))
    if n == 0:
        return 0
    differ = torch.nonzero(a[:n] != b[:n])
    return int(differ[0, 0]) if differ.numel() else n


def _user(exc: Exception, prefix: str = "", suffix: str = "") -> Result:
    return Result.error(UserError(f"{prefix}{exception_text(exc)}{suffix}"))


def _every_result(results: Sequence[Result | None]) -> list[Result]:
    return [r if r is not None else Result.error(UserError("request was not run")) for r in results]


def _already_ran(chunk: TrainChunk) -> str:
    """Said of a failed chunk whose call's earlier chunks already accumulated gradient."""
    if chunk.start == 0 or chunk.op.kind != "forward_backward":
        return ""
    return (
        f" (this call ran in chunks over several rounds; the gradient of its datums 0-{chunk.start - 1} "
        "was already accumulated)"
    )


class TrainBatches:
    def __init__(self, trainer: Trainer, live: LiveModels):
        self.trainer = trainer
        self.live = live

    def forward_backward(self, chunks: list[TrainChunk]) -> list[Result | Partial]:
        results: list[Result | None] = [None] * len(chunks)
        outputs: list[list[ItemOutput] | None] = [None] * len(chunks)
        groups: dict[bool, Group] = {False: [], True: []}
        for i, chunk in enumerate(chunks):
            op = chunk.op
            call: ForwardBackwardCall = op.payload
            try:
                live = self.live.get(op.model_id)
                data = call.data if chunk.start == 0 else call.data[chunk.start : chunk.stop]
                items = [
                    TrainItem(live.slot, d.tokens, call.loss_fn, d.loss_inputs, call.loss_config)
                    for d in data
                ]
                prepared = self.trainer.prepare(items)  # a first chunk checks the whole call
                groups[not call.forward_only].append((i, prepared[: chunk.stop - chunk.start]))
            except (UserError, ServerFault) as exc:  # ServerFault: its state could not be paged in
                results[i] = Result.error(exc)
            except ValueError as exc:
                results[i] = _user(
                    exc, f"{'forward' if call.forward_only else 'forward_backward'}: "
                )
        for backward in (False, True):
            if groups[backward]:
                self._run_items(chunks, groups[backward], backward, results, outputs)
        return [
            self._chunk_result(chunk, mine) if mine is not None else _every_result([result])[0]
            for chunk, mine, result in zip(chunks, outputs, results, strict=True)
        ]

    def _run_items(
        self,
        chunks: list[TrainChunk],
        group: Group,
        backward: bool,
        results: list[Result | None],
        outputs: list[list[ItemOutput] | None],
    ) -> None:
        flat = [item for _, items in group for item in items]
        faults.point("forward_backward.begin")
        try:
            out = self.trainer.forward_backward(flat) if backward else self.trainer.forward(flat)
        except ValueError as exc:
            if len(group) == 1:
                index = group[0][0]
                results[index] = _user(
                    exc,
                    "forward_backward: " if backward else "forward: ",
                    _already_ran(chunks[index]),
                )
                return
            for single in group:  # find the request that fails; the others still run
                self._run_items(chunks, [single], backward, results, outputs)
            return
        faults.point("forward_backward.end")
        start = 0
        for index, items in group:
            outputs[index] = out.items[start : start + len(items)]
            start += len(items)

    @staticmethod
    def _chunk_result(chunk: TrainChunk, mine: list[ItemOutput]) -> Result | Partial:
        """A chunk's own output, or for a call's last chunk the call's result: every datum's
        log-probs in order and the per-datum metrics merged as the unsplit call merges them."""
        own = ChunkOutput([o.logprobs for o in mine], [o.metrics for o in mine])
        if not chunk.last:
            return Partial(own)
        logprobs: list[torch.Tensor] = []
        metrics: list[dict[str, float]] = []
        for earlier in [*chunk.earlier, own]:
            if not isinstance(earlier, ChunkOutput):
                break
            logprobs += earlier.logprobs
            metrics += earlier.metrics
        if len(logprobs) != chunk.total:  # a bug: this call alone fails, its neighbours do not
            log.error(
                "%s: outputs of %d datums for a call of %d (its chunks' outputs: %s)",
                chunk.op.request_id,
                len(logprobs),
                chunk.total,
                [type(e).__name__ for e in chunk.earlier],
            )
            return Result.error(ServerFault("internal error while combining the call's chunks"))
        merged = merge_metrics(metrics)
        return Result.proto(responses.forward_backward_output(logprobs, merged), metrics=merged)

    def optim_step(self, ops: list[Op]) -> list[Result]:
        results: list[Result | None] = [None] * len(ops)
        by_slot: dict[int, tuple[int, OptimHParams]] = {}
        for i, op in enumerate(ops):
            try:
                live = self.live.get(op.model_id)  # paged in first, if it was paged out
            except (UserError, ServerFault) as exc:
                results[i] = Result.error(exc)
                continue
            sent = "dimuon" if isinstance(op.payload, DimuonHParams) else "adamw"
            if sent != live.optimizer:
                # Tinker fixes a model's optimizer at creation; a step of the other family is
                # refused alone, before the batch, so that its neighbours still step.
                results[i] = Result.error(
                    UserError(
                        f"optim_step: model {op.model_id!r} was created with the {live.optimizer} "
                        f"optimizer; send {'DimuonParams' if live.optimizer == 'dimuon' else 'AdamParams'}"
                        f" (got {'DimuonParams' if sent == 'dimuon' else 'AdamParams'})"
                    )
                )
                continue
            by_slot[live.slot] = (i, op.payload)
        if by_slot:
            faults.point("optim_step.begin")
            metrics = self.trainer.optim_step({slot: hp for slot, (_, hp) in by_slot.items()})
            faults.point("optim_step.end")
            for slot, (i, _) in by_slot.items():
                m = metrics[slot]
                results[i] = Result.json(
                    {
                        "metrics": {
                            f"{key}:{'max' if key in ('step', 'skipped') else 'mean'}": float(value)
                            for key, value in m.items()
                        },
                        "type": "optim_step",
                    }
                )
        return _every_result(results)
