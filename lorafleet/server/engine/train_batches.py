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
from lorafleet.server.ops.scheduler import Partial, TrainChunk
from lorafleet.server.ops.types import ForwardBackward, Job, optim_op
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


def _user(exc: Exception, prefix: str = "", suffix: str = "") -> Result:
    return Result.error(UserError(f"{prefix}{exception_text(exc)}{suffix}"))


def _every_result(results: Sequence[Result | None]) -> list[Result]:
    return [r if r is not None else Result.error(UserError("request was not run")) for r in results]


def _already_ran(chunk: TrainChunk) -> str:
    """Said of a failed chunk whose call's earlier chunks already accumulated gradient."""
    if chunk.start == 0 or not isinstance(chunk.call, ForwardBackward):
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
            call = chunk.call
            backward = isinstance(call, ForwardBackward)
            try:
                live = self.live.get(chunk.job.model_id)
                data = call.data if chunk.start == 0 else call.data[chunk.start : chunk.stop]
                items = [
                    TrainItem(live.slot, d.tokens, call.loss_fn, d.loss_inputs, call.loss_config)
                    for d in data
                ]
                prepared = self.trainer.prepare(items)  # a first chunk checks the whole call
                groups[backward].append((i, prepared[: chunk.stop - chunk.start]))
            except (UserError, ServerFault) as exc:  # ServerFault: its state could not be paged in
                results[i] = Result.error(exc)
            except ValueError as exc:
                results[i] = _user(exc, f"{call.kind}: ")
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
                chunk.job.request_id,
                len(logprobs),
                chunk.total,
                [type(e).__name__ for e in chunk.earlier],
            )
            return Result.error(ServerFault("internal error while combining the call's chunks"))
        merged = merge_metrics(metrics)
        return Result.proto(responses.forward_backward_output(logprobs, merged), metrics=merged)

    def optim_step(self, jobs: list[Job]) -> list[Result]:
        results: list[Result | None] = [None] * len(jobs)
        by_slot: dict[int, tuple[int, OptimHParams]] = {}
        for i, job in enumerate(jobs):
            hparams = optim_op(job).hparams
            try:
                live = self.live.get(job.model_id)  # paged in first, if it was paged out
            except (UserError, ServerFault) as exc:
                results[i] = Result.error(exc)
                continue
            sent = "dimuon" if isinstance(hparams, DimuonHParams) else "adamw"
            if sent != live.optimizer:
                # Tinker fixes a model's optimizer at creation; a step of the other family is
                # refused alone, before the batch, so that its neighbours still step.
                results[i] = Result.error(
                    UserError(
                        f"optim_step: model {job.model_id!r} was created with the {live.optimizer} "
                        f"optimizer; send {'DimuonParams' if live.optimizer == 'dimuon' else 'AdamParams'}"
                        f" (got {'DimuonParams' if sent == 'dimuon' else 'AdamParams'})"
                    )
                )
                continue
            by_slot[live.slot] = (i, hparams)
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
