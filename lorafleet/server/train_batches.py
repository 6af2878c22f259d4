"""Training ops as engine batches: every ready forward(_backward) request in one mixed batch
(forward-only and forward_backward apart), every ready optimizer step in one call.

Each request is checked on its own first (`Trainer.prepare`), so a bad one fails alone; a batch
that still fails is re-run request by request to find the culprit rather than failing its
neighbours."""

from __future__ import annotations

from lorafleet.adapters.hparams import DimuonHParams, OptimHParams
from lorafleet.interfaces import Trainer
from lorafleet.server import faults, proto
from lorafleet.server.errors import UserError
from lorafleet.server.futures import Result
from lorafleet.server.live_models import LiveModels
from lorafleet.server.redact import exception_text
from lorafleet.server.scheduler import Op
from lorafleet.train.engine import PreparedItem, TrainItem
from lorafleet.train.losses import merge_metrics

Group = list[tuple[int, list[PreparedItem]]]
"""(index of the op, its prepared items), for the ops of one engine call."""


def _user(exc: Exception, prefix: str = "") -> Result:
    return Result.error(UserError(f"{prefix}{exception_text(exc)}"))


def _every_result(results: list[Result | None]) -> list[Result]:
    return [r if r is not None else Result.error(UserError("request was not run")) for r in results]


class TrainBatches:
    def __init__(self, trainer: Trainer, live: LiveModels):
        self.trainer = trainer
        self.live = live

    def forward_backward(self, ops: list[Op]) -> list[Result]:
        results: list[Result | None] = [None] * len(ops)
        groups: dict[bool, Group] = {False: [], True: []}
        for i, op in enumerate(ops):
            call: proto.ForwardBackwardCall = op.payload
            try:
                live = self.live.get(op.model_id)
                items = [
                    TrainItem(live.slot, d.tokens, call.loss_fn, d.loss_inputs, call.loss_config)
                    for d in call.data
                ]
                groups[not call.forward_only].append((i, self.trainer.prepare(items)))
            except UserError as exc:
                results[i] = Result.error(exc)
            except ValueError as exc:
                results[i] = _user(
                    exc, f"{'forward' if call.forward_only else 'forward_backward'}: "
                )
        for backward in (False, True):
            if groups[backward]:
                self._run_items(groups[backward], backward, results)
        return _every_result(results)

    def _run_items(self, group: Group, backward: bool, results: list[Result | None]) -> None:
        flat = [item for _, items in group for item in items]
        faults.point("forward_backward.begin")
        try:
            out = self.trainer.forward_backward(flat) if backward else self.trainer.forward(flat)
        except ValueError as exc:
            if len(group) == 1:
                results[group[0][0]] = _user(exc, "forward_backward: " if backward else "forward: ")
                return
            for single in group:  # find the request that fails; the others still run
                self._run_items([single], backward, results)
            return
        faults.point("forward_backward.end")
        start = 0
        for index, items in group:
            mine = out.items[start : start + len(items)]
            start += len(items)
            metrics = merge_metrics(o.metrics for o in mine)
            results[index] = Result.proto(
                proto.forward_backward_output([o.logprobs for o in mine], metrics)
            )

    def optim_step(self, ops: list[Op]) -> list[Result]:
        results: list[Result | None] = [None] * len(ops)
        by_slot: dict[int, tuple[int, OptimHParams]] = {}
        for i, op in enumerate(ops):
            try:
                live = self.live.get(op.model_id)
            except UserError as exc:
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
