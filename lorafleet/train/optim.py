"""AdamW over a bank of LoRA adapters that share one flat parameter tensor.

Every adapter of a bank set lives in one row of ``params: [S, P]`` (slot 0 is the
reserved "no adapter" row) and its gradients in the matching row of ``grads``.
Tenants pick their own hyper-parameters and step at their own pace, so the
optimizer state is per slot (moments per row, a step count per slot) and one call
steps any subset of slots with per-slot hyper-parameters. Because each adapter is one
contiguous row, the update is torch's fused AdamW kernel over whole rows (one memory
pass per adapter) instead of one ``torch.optim.AdamW`` per adapter with ~100 small
tensors each.

The result equals ``torch.optim.AdamW(fused=True)`` after
``torch.nn.utils.clip_grad_norm_`` bit for bit, so a slot's trajectory matches what a
user would get training that adapter alone with stock PyTorch.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from lorafleet.adapters.hparams import AdamHParams

__all__ = ["AdamHParams", "BankAdamW"]

# torch.nn.utils.clip_grad_norm_ adds this to the total norm before dividing.
_CLIP_EPS = 1e-6


class SlotBookkeeping:
    """What every bank optimizer keeps per slot on the CPU: the step count and whether a
    gradient waits to be applied; slot 0 is the shared "no adapter" row and has no state."""

    num_slots: int
    step_count: torch.Tensor  # int64 [slots]
    pending: torch.Tensor  # bool [slots]

    def _check_slot(self, slot: Any) -> int:
        """Normalise a slot index; slot 0 is the shared "no adapter" row and has no state."""
        if isinstance(slot, bool):
            raise ValueError(f"invalid adapter slot {slot!r}")
        try:
            s = operator.index(slot)
        except TypeError:
            raise ValueError(f"invalid adapter slot {slot!r}: not an integer") from None
        if not 1 <= s < self.num_slots:
            raise ValueError(
                f"invalid adapter slot {s}: must be in [1, {self.num_slots - 1}] "
                f"(slot 0 is reserved)"
            )
        return s

    def note_gradient(self, slots: Iterable[int]) -> None:
        """Mark slots as having a gradient to apply.

        Explicit rather than inferred from ``grads != 0``: a backward that produced an
        all-zero gradient still counts (torch AdamW would decay weights and moments).
        """
        checked = [self._check_slot(s) for s in slots]
        if checked:
            self.pending[checked] = True

    def has_pending_gradient(self, slot: int) -> bool:
        return bool(self.pending[self._check_slot(slot)])

    def slot_step(self, slot: int) -> int:
        return int(self.step_count[self._check_slot(slot)])


class BankAdamW(SlotBookkeeping):
    """AdamW for every adapter slot of one bank set, stepped slot-subset at a time.

    ``params`` and ``grads`` are updated in place (the per-layer parameters and their
    ``.grad`` are views into them, so they must never be replaced). Moments live on the
    parameters' device; step counts and pending flags are tiny bookkeeping kept on the
    CPU so that per-slot bias corrections can be computed in float64 on the host exactly
    as torch does, without a device sync.
    """

    def __init__(self, params: torch.Tensor, grads: torch.Tensor) -> None:
        if params.dim() != 2:
            raise ValueError(f"params must be 2-D [slots, P], got shape {tuple(params.shape)}")
        if params.dtype != torch.float32:
            raise ValueError(f"params must be float32, got {params.dtype}")
        if grads.shape != params.shape or grads.dtype != params.dtype:
            raise ValueError(
                f"grads must match params ({tuple(params.shape)}, {params.dtype}), "
                f"got {tuple(grads.shape)}, {grads.dtype}"
            )
        if grads.device != params.device:
            raise ValueError(f"grads on {grads.device} but params on {params.device}")
        self.params = params
        self.grads = grads
        self.num_slots, self.row_size = params.shape
        self.exp_avg = torch.zeros_like(params, memory_format=torch.contiguous_format)
        self.exp_avg_sq = torch.zeros_like(params, memory_format=torch.contiguous_format)
        self.step_count = torch.zeros(self.num_slots, dtype=torch.int64)
        self.pending = torch.zeros(self.num_slots, dtype=torch.bool)

    def reset_slot(self, slot: int) -> None:
        """Forget a slot's optimizer history so a re-used slot starts like a fresh AdamW."""
        s = self._check_slot(slot)
        with torch.no_grad():
            self.exp_avg[s].zero_()
            self.exp_avg_sq[s].zero_()
            self.grads[s].zero_()
        self.step_count[s] = 0
        self.pending[s] = False

    def slot_state(self, slot: int) -> dict[str, torch.Tensor]:
        """Copies (not views) so a checkpoint is unaffected by later steps."""
        s = self._check_slot(slot)
        return {
            "exp_avg": self.exp_avg[s].clone(),
            "exp_avg_sq": self.exp_avg_sq[s].clone(),
            "step": self.step_count[s].clone(),
        }

    def load_slot_state(self, slot: int, state: Mapping[str, torch.Tensor]) -> None:
        """Install a state from ``slot_state`` (possibly of another slot or process).

        Everything is checked before anything is written so a bad checkpoint cannot
        leave the slot half-loaded. Gradients and the pending flag are untouched:
        they belong to the current backward, not to the saved history.
        """
        s = self._check_slot(slot)
        expected = {"exp_avg", "exp_avg_sq", "step"}
        if set(state) != expected:
            raise ValueError(f"slot state must have keys {sorted(expected)}, got {sorted(state)}")
        moments = {}
        for name in ("exp_avg", "exp_avg_sq"):
            t = state[name]
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"slot state {name!r} must be a tensor, got {type(t).__name__}")
            if t.dtype != torch.float32:
                raise ValueError(f"slot state {name!r} must be float32, got {t.dtype}")
            if tuple(t.shape) != (self.row_size,):
                raise ValueError(
                    f"slot state {name!r} must have shape ({self.row_size},), got {tuple(t.shape)}"
                )
            moments[name] = t
        if not bool(torch.isfinite(moments["exp_avg"]).all()):
            raise ValueError("slot state 'exp_avg' contains non-finite values")
        # A negative or NaN second moment would turn into NaN parameters on the next step.
        if not bool((moments["exp_avg_sq"] >= 0).all()) or not bool(
            torch.isfinite(moments["exp_avg_sq"]).all()
        ):
            raise ValueError("slot state 'exp_avg_sq' must be finite and >= 0")
        step = state["step"]
        if not isinstance(step, torch.Tensor):
            raise ValueError(f"slot state 'step' must be a tensor, got {type(step).__name__}")
        if step.dtype != torch.int64 or step.dim() != 0:
            raise ValueError(
                f"slot state 'step' must be a 0-d int64 tensor, got {step.dtype} "
                f"with shape {tuple(step.shape)}"
            )
        step_value = int(step)
        if step_value < 0:
            raise ValueError(f"slot state 'step' must be >= 0, got {step_value}")
        with torch.no_grad():
            self.exp_avg[s].copy_(moments["exp_avg"])
            self.exp_avg_sq[s].copy_(moments["exp_avg_sq"])
        self.step_count[s] = step_value

    # -- the update -------------------------------------------------------------------

    def step(self, hparams: Mapping[int, AdamHParams]) -> dict[int, dict[str, float]]:
        """Step exactly the slots in ``hparams``, each with its own hyper-parameters.

        All-or-nothing validation first, because a rejected request from one tenant
        must not half-apply. Requested slots with no gradient since their last step
        are reported as skipped instead of being moved: repeating an optim step
        without a new backward must not decay weights twice.

        For the stepped slots this performs, per slot and over the whole row (= all of
        that adapter's tensors), ``clip_grad_norm_`` followed by torch AdamW's update,
        with the same float operations in the same order, on all stepped rows at once
        as ``[k, P]`` with per-slot hyper-parameters broadcast as ``[k, 1]``. Metrics
        cost one host sync (the ``[4, k]`` norms), not one per slot.
        """
        requested: list[tuple[int, AdamHParams]] = []
        for slot, hp in hparams.items():
            s = self._check_slot(slot)
            if any(s == r for r, _ in requested):
                # Distinct keys (e.g. 1 and torch.tensor(1)) can name the same slot.
                raise ValueError(f"adapter slot {s} requested more than once")
            if not isinstance(hp, AdamHParams):
                raise ValueError(
                    f"hyper-parameters for slot {s} must be AdamHParams, got {type(hp).__name__}"
                )
            try:
                hp.validate()
            except ValueError as e:
                raise ValueError(f"slot {s}: {e}") from None
            requested.append((s, hp))

        pending = self.pending.tolist()
        step_count = self.step_count.tolist()
        metrics: dict[int, dict[str, float]] = {}
        active: list[tuple[int, AdamHParams]] = []
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
        new_steps = [step_count[s] + 1 for s in slots]
        with torch.no_grad():
            stats = self._update(slots, [hp for _, hp in active], new_steps)
        self.step_count[slots] += 1
        self.pending[slots] = False

        grad_norm, param_norm, clip_coef = stats.tolist()
        for i, (s, hp) in enumerate(active):
            metrics[s] = {
                "skipped": 0.0,
                "step": float(new_steps[i]),
                "learning_rate": float(hp.learning_rate),
                "grad_norm": grad_norm[i],
                "grad_clip_coef": clip_coef[i],
                "param_norm": param_norm[i],
            }
        return metrics

    def _update(self, slots: list[int], hps: list[AdamHParams], steps: list[int]) -> torch.Tensor:
        """The update itself; returns ``[3, k]`` (grad norm before clipping, param norm
        after, clip coefficient).

        Each slot's row is contiguous, so torch's fused AdamW kernel (one pass over
        params, grads and moments, versus ~10 passes for the foreach path) updates it
        in place; slots sharing hyper-parameters go through one multi-tensor call.
        The result equals ``torch.optim.AdamW(fused=True)`` bit for bit and the
        default implementation to float32 rounding.
        """
        grad_rows = [self.grads[s] for s in slots]
        grad_norm = torch.stack([torch.linalg.vector_norm(g) for g in grad_rows])
        clip_coef = torch.ones_like(grad_norm)
        clip = torch.tensor(
            [hp.grad_clip_norm for hp in hps], dtype=torch.float32, device=grad_norm.device
        )
        if bool((clip > 0).any()):
            # clip_grad_norm_: torch evaluates max_norm / (total + 1e-6) as
            # reciprocal(total + 1e-6) * max_norm (Tensor.__rtruediv__), then clamps to 1.
            coef = ((grad_norm + _CLIP_EPS).reciprocal() * clip).clamp_(max=1.0)
            clip_coef = torch.where(clip > 0, coef, clip_coef)
            for i, hp in enumerate(hps):
                if hp.grad_clip_norm > 0:
                    grad_rows[i].mul_(clip_coef[i])

        groups: dict[tuple[float, float, float, float, float], list[int]] = {}
        for i, hp in enumerate(hps):
            key = (hp.learning_rate, hp.beta1, hp.beta2, hp.eps, hp.weight_decay)
            groups.setdefault(key, []).append(i)
        for (lr, beta1, beta2, eps, weight_decay), members in groups.items():
            torch._fused_adamw_(
                [self.params[slots[i]] for i in members],
                [grad_rows[i] for i in members],
                [self.exp_avg[slots[i]] for i in members],
                [self.exp_avg_sq[slots[i]] for i in members],
                [],
                [torch.tensor(float(steps[i]), device=self.params.device) for i in members],
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=weight_decay,
                eps=eps,
                amsgrad=False,
                maximize=False,
            )
        param_norm = torch.stack([torch.linalg.vector_norm(self.params[s]) for s in slots])
        for g in grad_rows:
            g.zero_()
        return torch.stack([grad_norm, param_norm, clip_coef])
