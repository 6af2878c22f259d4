"""AdamW over a bank of LoRA adapters that share one flat parameter tensor.

Every adapter of a bank set lives in one row of ``params: [S, P]`` (slot 0 is the
reserved "no adapter" row) and its gradients in the matching row of ``grads``.
Tenants pick their own hyper-parameters and step at their own pace, so the
optimizer state is per slot (moments per row, a step count per slot) and one call
steps any subset of slots with per-slot hyper-parameters in a single vectorised pass
instead of one ``torch.optim.AdamW`` per adapter with ~100 small tensors each.

The arithmetic deliberately mirrors ``torch.optim.AdamW`` (single-tensor path) and
``torch.nn.utils.clip_grad_norm_`` operation for operation, so a slot's trajectory
matches what a user would get training that adapter alone with stock PyTorch.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

__all__ = ["AdamHParams", "BankAdamW"]

# torch.nn.utils.clip_grad_norm_ adds this to the total norm before dividing.
_CLIP_EPS = 1e-6


@dataclass(frozen=True)
class AdamHParams:
    """Per-slot AdamW hyper-parameters, as a tenant sends them with each optim step.

    Not validated on construction so that a bad request can be built, reported and
    rejected at the optimizer boundary (``BankAdamW.step`` validates before touching
    any state); ``from_dict`` validates because it reads untrusted checkpoint data.
    """

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 = no clipping

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field, so API errors are actionable."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"AdamHParams.{f.name} must be a real number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"AdamHParams.{f.name} must be finite, got {value!r}")
        if self.learning_rate < 0:
            raise ValueError(f"AdamHParams.learning_rate must be >= 0, got {self.learning_rate!r}")
        for name in ("beta1", "beta2"):
            beta = getattr(self, name)
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"AdamHParams.{name} must be in [0, 1), got {beta!r}")
        if self.eps <= 0:
            raise ValueError(f"AdamHParams.eps must be > 0, got {self.eps!r}")
        if self.weight_decay < 0:
            raise ValueError(f"AdamHParams.weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.grad_clip_norm < 0:
            raise ValueError(
                f"AdamHParams.grad_clip_norm must be >= 0 (0 disables clipping), "
                f"got {self.grad_clip_norm!r}"
            )

    def to_dict(self) -> dict[str, float]:
        """Plain JSON-able data, so checkpoints do not depend on pickling this class."""
        return {k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AdamHParams:
        """Inverse of ``to_dict``; rejects unknown keys so typos are not silently ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"AdamHParams: unknown field(s) {unknown}")
        if "learning_rate" not in d:
            raise ValueError("AdamHParams: missing required field 'learning_rate'")
        hp = cls(**dict(d))
        hp.validate()
        return hp


class BankAdamW:
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
        self._scratch: torch.Tensor | None = None

    # -- slot bookkeeping -------------------------------------------------------------

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
        with the same float operations in the same order, gathered as ``[k, P]`` with
        per-slot hyper-parameters broadcast as ``[k, 1]``.
        """
        requested: list[tuple[int, AdamHParams]] = []
        for slot, hp in hparams.items():
            s = self._check_slot(slot)
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

        grad_norm, update_norm, param_norm, clip_coef = stats.tolist()
        for i, (s, hp) in enumerate(active):
            metrics[s] = {
                "skipped": 0.0,
                "step": float(new_steps[i]),
                "learning_rate": float(hp.learning_rate),
                "grad_norm": grad_norm[i],
                "grad_clip_coef": clip_coef[i],
                "update_norm": update_norm[i],
                "param_norm": param_norm[i],
            }
        return metrics

    def _workspace(self, count: int, k: int) -> list[torch.Tensor]:
        """``count`` scratch ``[k, P]`` tensors.

        On CPU they are carved from one buffer kept across steps: there is no caching
        allocator there, and faulting in fresh pages for every multi-MB temporary costs
        more than the arithmetic itself. On accelerators the caching allocator already
        recycles blocks, so nothing is pinned between steps.
        """
        n = k * self.row_size
        if self.params.device.type != "cpu":
            return [self.params.new_empty(k, self.row_size) for _ in range(count)]
        if self._scratch is None or self._scratch.numel() < count * n:
            self._scratch = None  # drop the old one before allocating the larger one
            self._scratch = self.params.new_empty(count * n)
        return [self._scratch[i * n : (i + 1) * n].view(k, self.row_size) for i in range(count)]

    def _update(self, slots: list[int], hps: list[AdamHParams], steps: list[int]) -> torch.Tensor:
        """The vectorised math; returns ``[4, k]`` (grad, update, param norms, clip coef).

        ``slots`` must be ascending. A contiguous run of slots (the common case when the
        engine packs adapters) is updated in place through views; otherwise the rows are
        gathered with ``index_select`` and written back with ``index_copy_``.

        Host-side scalars are computed in Python floats (float64) with torch's exact
        expressions and only then rounded to float32, because that is what torch does
        when it passes them to its kernels as Python scalars. Per-slot factors become
        ``[k, 1]`` tensors fed to kernels whose own scalar is 1, which rounds the same
        way: ``p.addcdiv_(m, d, value=-lr_t)`` evaluates ``p + ((-lr_t * m) / d)``, so
        it equals ``p.add_((m * -lr_t) / d)`` bit for bit.
        """
        device = self.params.device
        k = len(slots)

        clip, decay, w1, b2, c2, bc2_sqrt, eps, neg_step, neg_wd = ([] for _ in range(9))
        for hp, step in zip(hps, steps, strict=True):
            clip.append(hp.grad_clip_norm)
            decay.append(1 - hp.learning_rate * hp.weight_decay)
            neg_wd.append(-(hp.learning_rate * hp.weight_decay))
            w1.append(1 - hp.beta1)
            b2.append(hp.beta2)
            c2.append(1 - hp.beta2)
            bc2_sqrt.append((1 - hp.beta2**step) ** 0.5)
            eps.append(hp.eps)
            neg_step.append(-(hp.learning_rate / (1 - hp.beta1**step)))
        table = torch.tensor(
            [decay, neg_wd, w1, b2, c2, bc2_sqrt, eps, neg_step, clip], dtype=torch.float32
        ).to(device, non_blocking=True)
        decay_t, neg_wd_t, w1_t, b2_t, c2_t, bc2_sqrt_t, eps_t, neg_step_t, clip_t = (
            table.unsqueeze(-1).unbind(0)
        )

        contiguous = slots[-1] - slots[0] == k - 1
        if contiguous:
            lo = slots[0]
            g, p, m, v = (t.narrow(0, lo, k) for t in self._banks())
            tmp, upd = self._workspace(2, k)
        else:
            idx = torch.tensor(slots, dtype=torch.long, device=device)
            g, p, m, v, tmp, upd = self._workspace(6, k)
            for src, dst in zip(self._banks(), (g, p, m, v), strict=True):
                torch.index_select(src, 0, idx, out=dst)

        grad_norm = torch.linalg.vector_norm(g, dim=1)
        clip_coef = torch.ones_like(grad_norm)
        if any(c > 0 for c in clip):
            # clip_grad_norm_: torch evaluates max_norm / (total + 1e-6) as
            # reciprocal(total + 1e-6) * max_norm (Tensor.__rtruediv__), then clamps to 1.
            max_norm = clip_t.squeeze(1)
            coef = ((grad_norm + _CLIP_EPS).reciprocal() * max_norm).clamp_(max=1.0)
            clip_coef = torch.where(max_norm > 0, coef, clip_coef)
            g.mul_(clip_coef.unsqueeze(1))

        m.lerp_(g, w1_t)
        torch.mul(g, c2_t, out=tmp)
        v.mul_(b2_t).addcmul_(tmp, g)
        denom = torch.sqrt(v, out=tmp).div_(bc2_sqrt_t).add_(eps_t)
        step_ = torch.mul(m, neg_step_t, out=upd).div_(denom)
        if any(d != 1.0 for d in decay):
            # The full parameter change, p_new - p_old, for the metric.
            update_norm = torch.linalg.vector_norm(
                torch.mul(p, neg_wd_t, out=tmp).add_(step_), dim=1
            )
            p.mul_(decay_t)
        else:
            update_norm = torch.linalg.vector_norm(step_, dim=1)
        p.add_(step_)
        param_norm = torch.linalg.vector_norm(p, dim=1)

        if contiguous:
            g.zero_()
        else:
            self.params.index_copy_(0, idx, p)
            self.exp_avg.index_copy_(0, idx, m)
            self.exp_avg_sq.index_copy_(0, idx, v)
            self.grads.index_fill_(0, idx, 0.0)
        return torch.stack([grad_norm, update_norm, param_norm, clip_coef])

    def _banks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.grads, self.params, self.exp_avg, self.exp_avg_sq
