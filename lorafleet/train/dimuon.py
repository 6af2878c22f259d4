"""Dimuon (Tinker's second optimizer family) over a bank of LoRA adapters, all slots at once.

Tinker publishes Dimuon's hyper-parameters, not its algorithm: SDK 0.38 sends
``{type: "dimuon", learning_rate, grad_clip_norm, beta1}`` and documents the learning rate as
"applied to a direction with Frobenius norm sqrt(rank)" and a "matrix-sign iteration" with
internal constants. Later docs add a row/column preconditioner ``damping`` and a rank
correction exponent that 0.38 cannot send and whose defaults are not published, so this
module implements the documented Muon update per LoRA factor, with nothing else:

1. clip the slot's whole gradient row to ``grad_clip_norm`` (when > 0), exactly as AdamW here
   (``torch.nn.utils.clip_grad_norm_`` over all of the adapter's tensors);
2. momentum as an EMA: ``m = beta1 * m + (1 - beta1) * g``;
3. for every LoRA matrix of the adapter (``A [rank, in]`` and ``B [out, rank]`` of each adapted
   layer; an MoE layer's expert-stacked factor counts as one matrix), the matrix sign of its
   momentum by 5 quintic Newton-Schulz steps (Keller Jordan's Muon coefficients, input scaled
   by its Frobenius norm), rescaled to Frobenius norm ``sqrt(rank)`` — the adapter's rank, so a
   full-rank sign already has that norm and a rank-deficient one is scaled up to it; a zero
   momentum (``A`` before ``B`` has left zero) gives a zero direction;
4. ``W -= learning_rate * direction``. No weight decay (``DimuonParams`` has none).

Like ``BankAdamW``, state is per slot (a momentum row and a step count), one call steps any
subset of slots with per-slot hyper-parameters, and the matrix-sign iterations of every
stepped matrix of one shape run as one batched matmul chain over slots and layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from lorafleet.adapters.hparams import DimuonHParams
from lorafleet.train.optim import SlotBookkeeping

__all__ = ["NS_COEFFICIENTS", "NS_STEPS", "BankDimuon", "SlotMatrices", "matrix_sign"]

NS_STEPS = 5
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_NS_EPS = 1e-7  # added to the Frobenius norm that scales the Newton-Schulz input
_CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_

SlotMatrices = Callable[[int, torch.Tensor], tuple[int, list[torch.Tensor]]]
"""``(slot, row) -> (rank, views)``: the adapter's rank and its LoRA matrices as views of a flat
``[P]`` row of the bank's layout (params, grads or momentum alike)."""


def matrix_sign(m: torch.Tensor) -> torch.Tensor:
    """Approximate ``U V^T`` of ``m = U S V^T`` for a batch ``[..., rows, cols]``.

    The quintic Newton-Schulz iteration of Muon: it pushes every singular value of the
    norm-scaled input towards 1 (into roughly [0.7, 1.2], which Muon found good enough) with
    matmuls only, so it batches over slots and layers. It works on the wide orientation, where
    ``X X^T`` is the small ``[min, min]`` Gram matrix.
    """
    a, b, c = NS_COEFFICIENTS
    x = m / (torch.linalg.matrix_norm(m, keepdim=True) + _NS_EPS)
    tall = m.shape[-2] > m.shape[-1]
    if tall:
        x = x.mT
    for _ in range(NS_STEPS):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if tall else x


class BankDimuon(SlotBookkeeping):
    """Dimuon for the adapter slots of one bank set; ``params``/``grads`` updated in place.

    ``matrices`` maps a slot and a flat row to the adapter's LoRA matrices (views), which is
    all this optimizer knows of the bank's layout. A slot's views are taken once and kept until
    ``reset_slot``, which the trainer calls whenever a slot is (re)allocated, freed or loaded.
    Bookkeeping (steps, pending flags) lives on the CPU as in ``BankAdamW``.
    """

    def __init__(self, params: torch.Tensor, grads: torch.Tensor, matrices: SlotMatrices) -> None:
        if params.dim() != 2 or params.dtype != torch.float32:
            raise ValueError(
                f"params must be 2-D float32 [slots, P], got {tuple(params.shape)} {params.dtype}"
            )
        if grads.shape != params.shape or grads.dtype != params.dtype:
            raise ValueError(
                f"grads must match params ({tuple(params.shape)}, {params.dtype}), "
                f"got {tuple(grads.shape)}, {grads.dtype}"
            )
        self.params = params
        self.grads = grads
        self.matrices = matrices
        self.num_slots, self.row_size = params.shape
        self.momentum = torch.zeros_like(params, memory_format=torch.contiguous_format)
        self.step_count = torch.zeros(self.num_slots, dtype=torch.int64)
        self.pending = torch.zeros(self.num_slots, dtype=torch.bool)
        # slot -> (rank, momentum views, param views)
        self._views: dict[int, tuple[int, list[torch.Tensor], list[torch.Tensor]]] = {}

    def _slot_views(self, slot: int) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
        views = self._views.get(slot)
        if views is None:
            rank, moments = self.matrices(slot, self.momentum[slot])
            _, weights = self.matrices(slot, self.params[slot])
            views = self._views[slot] = (rank, moments, weights)
        return views

    def reset_slot(self, slot: int) -> None:
        s = self._check_slot(slot)
        with torch.no_grad():
            self.momentum[s].zero_()
            self.grads[s].zero_()
        self.step_count[s] = 0
        self.pending[s] = False
        self._views.pop(s, None)

    def slot_state(self, slot: int) -> dict[str, torch.Tensor]:
        """Copies, so a checkpoint is unaffected by later steps."""
        s = self._check_slot(slot)
        return {"momentum": self.momentum[s].clone(), "step": self.step_count[s].clone()}

    def load_slot_state(self, slot: int, state: Mapping[str, torch.Tensor]) -> None:
        """Installs a ``slot_state``; everything is checked before anything is written."""
        s = self._check_slot(slot)
        if set(state) != {"momentum", "step"}:
            raise ValueError(f"slot state must have keys ['momentum', 'step'], got {sorted(state)}")
        momentum, step = state["momentum"], state["step"]
        if not isinstance(momentum, torch.Tensor) or momentum.dtype != torch.float32:
            raise ValueError("slot state 'momentum' must be a float32 tensor")
        if tuple(momentum.shape) != (self.row_size,):
            raise ValueError(
                f"slot state 'momentum' must have shape ({self.row_size},), "
                f"got {tuple(momentum.shape)}"
            )
        if not bool(torch.isfinite(momentum).all()):
            raise ValueError("slot state 'momentum' contains non-finite values")
        if not isinstance(step, torch.Tensor) or step.dtype != torch.int64 or step.dim() != 0:
            raise ValueError("slot state 'step' must be a 0-d int64 tensor")
        if int(step) < 0:
            raise ValueError(f"slot state 'step' must be >= 0, got {int(step)}")
        with torch.no_grad():
            self.momentum[s].copy_(momentum)
        self.step_count[s] = int(step)

    # -- the update -------------------------------------------------------------------

    def step(self, hparams: Mapping[int, DimuonHParams]) -> dict[int, dict[str, float]]:
        """Steps exactly the slots in ``hparams``; all-or-nothing validation first. Slots with
        no gradient since their last step are reported as skipped, not moved."""
        requested: list[tuple[int, DimuonHParams]] = []
        for slot, hp in hparams.items():
            s = self._check_slot(slot)
            if any(s == r for r, _ in requested):
                raise ValueError(f"adapter slot {s} requested more than once")
            if not isinstance(hp, DimuonHParams):
                raise ValueError(
                    f"hyper-parameters for slot {s} must be DimuonHParams, got {type(hp).__name__}"
                )
            try:
                hp.validate()
            except ValueError as e:
                raise ValueError(f"slot {s}: {e}") from None
            requested.append((s, hp))

        pending, step_count = self.pending.tolist(), self.step_count.tolist()
        metrics: dict[int, dict[str, float]] = {}
        active = []
        for s, hp in requested:
            if pending[s]:
                active.append((s, hp))
            else:
                metrics[s] = {
                    "skipped": 1.0,
                    "step": float(step_count[s]),
                    "learning_rate": float(hp.learning_rate),
                }
        if not active:
            return metrics
        active.sort(key=lambda item: item[0])
        slots = [s for s, _ in active]
        with torch.no_grad():
            stats = self._update(slots, [hp for _, hp in active]).tolist()
        self.step_count[slots] += 1
        self.pending[slots] = False
        for i, (s, hp) in enumerate(active):
            metrics[s] = {
                "skipped": 0.0,
                "step": float(step_count[s] + 1),
                "learning_rate": float(hp.learning_rate),
                "grad_norm": stats[0][i],
                "grad_clip_coef": stats[2][i],
                "param_norm": stats[1][i],
            }
        return metrics

    def _update(self, slots: list[int], hps: list[DimuonHParams]) -> torch.Tensor:
        """Returns ``[3, k]``: grad norm before clipping, param norm after, clip coefficient."""
        device = self.params.device
        grad_rows = [self.grads[s] for s in slots]
        grad_norm = torch.stack([torch.linalg.vector_norm(g) for g in grad_rows])
        clip = torch.tensor([hp.grad_clip_norm for hp in hps], dtype=torch.float32, device=device)
        coef = ((grad_norm + _CLIP_EPS).reciprocal() * clip).clamp(max=1.0)
        clip_coef = torch.where(clip > 0, coef, torch.ones_like(coef))
        # One matrix list per stepped slot; each entry pairs the momentum and param views.
        by_shape: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor, float]]] = {}
        for i, (s, hp) in enumerate(zip(slots, hps, strict=True)):
            if hp.grad_clip_norm > 0:
                grad_rows[i].mul_(clip_coef[i])
            self.momentum[s].mul_(hp.beta1).add_(grad_rows[i], alpha=1.0 - hp.beta1)
            rank, moments, weights = self._slot_views(s)
            scale = hp.learning_rate * math.sqrt(rank)
            for m, w in zip(moments, weights, strict=True):
                by_shape.setdefault((m.shape[0], m.shape[1]), []).append((m, w, scale))
        for entries in by_shape.values():
            signs = matrix_sign(torch.stack([m for m, _, _ in entries]))
            norms = torch.linalg.matrix_norm(signs, keepdim=True)
            scales = torch.tensor([sc for _, _, sc in entries], device=device).view(-1, 1, 1)
            # A zero momentum has a zero sign; dividing it by its (zero) norm would give NaN.
            steps = torch.where(norms > 0, signs * (scales / norms.clamp_min(1e-30)), 0.0)
            torch._foreach_sub_([w for _, w, _ in entries], list(steps.unbind()))
        param_norm = torch.stack([torch.linalg.vector_norm(self.params[s]) for s in slots])
        for g in grad_rows:
            g.zero_()
        return torch.stack([grad_norm, param_norm, clip_coef])
