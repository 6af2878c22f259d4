"""Tinker loss functions against plain-Python references, plus input validation.

Each reference loops over tokens with ``math`` and returns the loss and its
analytic gradient with respect to the target log-probs, so a sign error, a
missing stop-gradient or a wrong clipping branch shows up in either value or
gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from lorafleet.train.loss_inputs import (
    LOSS_CONFIG_DEFAULTS,
    LOSS_INPUT_KEYS,
    LOSS_NAMES,
    LossInputError,
    LossSpec,
    loss_targets,
    validate_loss,
)
from lorafleet.train.losses import compute_loss, gradient_mask, merge_metrics

VOCAB = 50


# --------------------------------------------------------------------------- helpers


def _clip(r: float, lo: float, hi: float) -> float:
    return min(max(r, lo), hi)


def ref_cross_entropy(logp: Sequence[float], w: Sequence[float]) -> tuple[float, list[float]]:
    loss = -sum(wi * li for wi, li in zip(w, logp, strict=True))
    return loss, [-wi for wi in w]


def ref_importance_sampling(logp, logq, adv) -> tuple[float, list[float]]:
    loss, grad = 0.0, []
    for lp, lq, a in zip(logp, logq, adv, strict=True):
        r = math.exp(lp - lq)
        loss -= r * a
        grad.append(-r * a)  # d(r)/d(logp) = r
    return loss, grad


def ref_ppo(logp, logq, adv, lo, hi) -> tuple[float, list[float]]:
    n = len(logp)
    los = lo if isinstance(lo, list) else [lo] * n
    his = hi if isinstance(hi, list) else [hi] * n
    loss, grad = 0.0, []
    for lp, lq, a, l_, h_ in zip(logp, logq, adv, los, his, strict=True):
        r = math.exp(lp - lq)
        unclipped, clipped = r * a, _clip(r, l_, h_) * a
        if unclipped <= clipped:
            loss -= unclipped
            grad.append(-r * a)
        else:  # clipped term is a constant in logp
            loss -= clipped
            grad.append(0.0)
    return loss, grad


def ref_cispo(logp, logq, adv, lo, hi) -> tuple[float, list[float]]:
    n = len(logp)
    los = lo if isinstance(lo, list) else [lo] * n
    his = hi if isinstance(hi, list) else [hi] * n
    loss, grad = 0.0, []
    for lp, lq, a, l_, h_ in zip(logp, logq, adv, los, his, strict=True):
        c = _clip(math.exp(lp - lq), l_, h_)
        loss -= c * lp * a
        grad.append(-c * a)  # stop-gradient: c is a constant
    return loss, grad


def ref_dro(logp, logq, adv, beta) -> tuple[float, list[float]]:
    loss, grad = 0.0, []
    for lp, lq, a in zip(logp, logq, adv, strict=True):
        loss -= lp * a - 0.5 * beta * (lp - lq) ** 2
        grad.append(-(a - beta * (lp - lq)))
    return loss, grad


def run(
    name: str,
    inputs: dict[str, object],
    logp: Sequence,
    config: dict[str, float] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, list, dict[str, float], LossSpec]:
    tensors = {
        k: torch.tensor(v, dtype=torch.int64 if k == "target_tokens" else torch.float32)
        for k, v in inputs.items()
    }
    num_tokens = len(inputs["target_tokens"])
    spec = validate_loss(name, tensors, config or {}, num_tokens, VOCAB)
    lp = torch.tensor(logp, dtype=dtype, requires_grad=True)
    loss, metrics = compute_loss(spec, lp)
    loss.backward()
    assert lp.grad is not None
    return loss, lp.grad.float().tolist(), metrics, spec


def assert_close(actual: float | list, expected: float | list, tol: float = 1e-5) -> None:
    if isinstance(expected, list):
        assert isinstance(actual, list)
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_close(a, e, tol)
        return
    assert math.isclose(actual, expected, rel_tol=tol, abs_tol=tol), (actual, expected)


def rl_inputs(logq: list[float], adv: list[float], **extra: list[float]) -> dict[str, object]:
    return {"target_tokens": [3] * len(logq), "logprobs": logq, "advantages": adv, **extra}


# --------------------------------------------------------------------------- values and gradients


def test_loss_names() -> None:
    assert LOSS_NAMES == (
        "cross_entropy",
        "importance_sampling",
        "ppo",
        "cispo",
        "dro",
        "gspo",
        "stable_reinforce",
    )
    assert set(LOSS_INPUT_KEYS) == set(LOSS_NAMES) == set(LOSS_CONFIG_DEFAULTS)


def test_cross_entropy_with_negative_weights() -> None:
    logp = [-0.5, -2.0, -0.1, -3.0]
    w = [1.0, 0.0, -0.75, 2.5]  # forward_backward_custom sends w = -grad
    loss, grad, metrics, _ = run(
        "cross_entropy", {"target_tokens": [1, 2, 3, 4], "weights": w}, logp
    )
    ref_loss, ref_grad = ref_cross_entropy(logp, w)
    assert_close(loss.item(), ref_loss)
    assert_close(grad, ref_grad)
    assert metrics == {"loss:sum": pytest.approx(ref_loss)}
    assert loss.dim() == 0 and loss.dtype == torch.float32


def test_cross_entropy_top_k_targets() -> None:
    targets = [[1, 2, 3], [4, 5, 6]]
    w = [[0.5, 0.3, 0.2], [0.9, -0.1, 0.0]]
    logp = [[-0.2, -1.5, -3.0], [-0.05, -4.0, -6.0]]
    tensors = {"target_tokens": torch.tensor(targets), "weights": torch.tensor(w)}
    spec = validate_loss("cross_entropy", tensors, {}, 2, VOCAB)
    assert loss_targets(spec).shape == (2, 3)
    assert loss_targets(spec).dtype == torch.int64
    lp = torch.tensor(logp, requires_grad=True)
    loss, _ = compute_loss(spec, lp)
    loss.backward()
    flat_lp = [x for row in logp for x in row]
    flat_w = [x for row in w for x in row]
    ref_loss, ref_grad = ref_cross_entropy(flat_lp, flat_w)
    assert_close(loss.item(), ref_loss)
    assert_close(lp.grad.flatten().tolist(), ref_grad)


def test_importance_sampling() -> None:
    logq = [-1.0, -0.3, -2.0, -0.7]
    logp = [-0.8, -0.9, -1.0, -0.7]
    adv = [1.5, -0.5, 0.0, 2.0]
    loss, grad, metrics, _ = run("importance_sampling", rl_inputs(logq, adv), logp)
    ref_loss, ref_grad = ref_importance_sampling(logp, logq, adv)
    assert_close(loss.item(), ref_loss)
    assert_close(grad, ref_grad)
    assert_close(metrics["loss:sum"], ref_loss)
    active = [lp - lq for lp, lq, a in zip(logp, logq, adv, strict=True) if a != 0]
    assert metrics["active_tokens:sum"] == 3
    assert_close(metrics["log_ratio:sum"], sum(active))
    assert_close(metrics["log_ratio:min"], min(active))
    assert_close(metrics["log_ratio:max"], max(active))


def test_ppo_clipping_on_both_sides() -> None:
    # ratio:   e^0.5 (>1.2)  e^0.5 (>1.2)  e^-0.5 (<0.8)  e^-0.5 (<0.8)  e^0.1 (inside)
    # adv:       +             -              +               -             +
    # branch:  clipped      unclipped      unclipped        clipped      unclipped
    logq = [-1.0, -1.0, -1.0, -1.0, -1.0, -1.0]
    logp = [-0.5, -0.5, -1.5, -1.5, -0.9, -0.9]
    adv = [2.0, -2.0, 1.0, -1.0, 0.7, -0.3]
    loss, grad, metrics, _ = run("ppo", rl_inputs(logq, adv), logp)
    ref_loss, ref_grad = ref_ppo(logp, logq, adv, 0.8, 1.2)
    assert_close(loss.item(), ref_loss)
    assert_close(grad, ref_grad)
    assert grad[0] == 0.0 and grad[3] == 0.0  # clipped branch: no gradient
    assert grad[1] != 0.0 and grad[2] != 0.0  # pessimistic unclipped branch keeps it
    assert metrics["clipped_tokens:sum"] == 2
    assert metrics["active_tokens:sum"] == 6


def test_ppo_config_thresholds() -> None:
    logq = [-1.0, -1.0, -1.0]
    logp = [-0.5, -1.5, -0.9]
    adv = [1.0, -1.0, 1.0]
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}
    loss, grad, metrics, spec = run("ppo", rl_inputs(logq, adv), logp, config)
    ref_loss, ref_grad = ref_ppo(logp, logq, adv, 0.9, 1.05)
    assert_close(loss.item(), ref_loss)
    assert_close(grad, ref_grad)
    assert metrics["clipped_tokens:sum"] == 3  # e^0.1 = 1.105 > 1.05 as well
    assert spec.config == config


def test_ppo_per_token_clip_tensors_override_config() -> None:
    logq = [-1.0, -1.0, -1.0, -1.0]
    logp = [-0.5, -0.5, -1.5, -0.9]
    adv = [1.0, 1.0, -1.0, 1.0]
    lo = [0.8, 0.5, 0.7, 0.0]
    hi = [1.2, 2.0, 1.5, 0.0]  # lo == hi == 0 masks the last token entirely
    config = {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01}  # overridden
    loss, grad, _, _ = run(
        "ppo",
        rl_inputs(logq, adv, clip_low_threshold=lo, clip_high_threshold=hi),
        logp,
        config,
    )
    ref_loss, ref_grad = ref_ppo(logp, logq, adv, lo, hi)
    assert_close(loss.item(), ref_loss)
    assert_close(grad, ref_grad)
    assert grad[0] == 0.0 and grad[1] != 0.0 and grad[3] == 0.0


def test_ppo_one_clip_tensor_with_config_scalar() -> None:
    logq = [-1.0, -1.0, -1.0]
    logp = [-0.5, -1.5, -1.5]
    adv = [1.0, -1.0, -1.0]
    lo = [0.5, 0.9, 0.1]
    loss, grad, _, _ = run(
        "ppo",
        rl_inputs(logq, adv, clip_low_threshold=lo),
        logp,
        {"clip_high_threshold": 1.3},
    )
    ref_loss, ref_grad = ref_ppo(logp, logq, adv, lo, 1.3)
    assert_close(loss.item(), ref_loss)
    assert_close(grad, ref_grad)


def test_cispo_stop_gradient() -> None:
    logq = [-1.0, -1.0, -1.0, -1.0, -2.0]
    logp = [-0.5, -0.5, -1.5, -0.95, -2.0]
    adv = [1.0, -2.0, 0.5, 3.0, 0.0]
    loss, grad, metrics, _ = run("cispo", rl_inputs(logq, adv), logp)
    ref_loss, ref_grad = ref_cispo(logp, logq, adv, 0.8, 1.2)
    assert_close(loss.item(), ref_loss)
    assert_close(grad, ref_grad)
    # The gradient is exactly -clip(r) * A: no d(clip(r))/d(logp) term.
    for g, lp, lq, a in zip(grad, logp, logq, adv, strict=True):
        assert_close(g, -_clip(math.exp(lp - lq), 0.8, 1.2) * a)
    assert metrics["clipped_tokens:sum"] == 3
    assert metrics["active_tokens:sum"] == 4


def test_cispo_per_token_clip_tensors() -> None:
    logq = [-1.0, -1.0, -1.0]
    logp = [-0.5, -1.5, -0.9]
    adv = [1.0, -1.0, 2.0]
    lo, hi = [0.9, 0.3, 1.0], [1.1, 0.4, 1.0]
    loss, grad, _, _ = run(
        "cispo", rl_inputs(logq, adv, clip_low_threshold=lo, clip_high_threshold=hi), logp
    )
    ref_loss, ref_grad = ref_cispo(logp, logq, adv, lo, hi)
    assert_close(loss.item(), ref_loss)
    assert_close(grad, ref_grad)


@pytest.mark.parametrize("beta", [0.0, 0.05, 0.7])
def test_dro(beta: float) -> None:
    logq = [-1.0, -0.2, -3.0, -0.5]
    logp = [-0.6, -0.9, -2.0, -0.5]
    adv = [0.8, -1.2, 0.0, 0.3]
    loss, grad, _, spec = run("dro", rl_inputs(logq, adv), logp, {"beta": beta})
    ref_loss, ref_grad = ref_dro(logp, logq, adv, beta)
    assert_close(loss.item(), ref_loss)
    assert_close(grad, ref_grad)
    assert spec.config == {"beta": beta}


def test_dro_default_beta() -> None:
    logq, logp, adv = [-1.0, -0.2], [-0.6, -0.9], [0.8, -1.2]
    loss, grad, _, spec = run("dro", rl_inputs(logq, adv), logp)
    assert spec.config == {"beta": 0.05}
    ref_loss, ref_grad = ref_dro(logp, logq, adv, 0.05)
    assert_close(loss.item(), ref_loss)
    assert_close(grad, ref_grad)


def test_ppo_and_cispo_defaults() -> None:
    for name in ("ppo", "cispo"):
        spec = validate_loss(
            name,
            {
                "target_tokens": torch.tensor([1]),
                "logprobs": torch.zeros(1),
                "advantages": torch.ones(1),
            },
            {},
            1,
            VOCAB,
        )
        assert spec.config == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "dro"])
def test_bf16_logprobs_are_upcast(name: str) -> None:
    logq = [-1.0, -0.5, -2.0]
    logp = [-0.75, -1.25, -1.5]  # exactly representable in bf16
    adv = [1.0, -0.5, 2.0]
    loss32, grad32, _, _ = run(name, rl_inputs(logq, adv), logp)
    loss16, grad16, _, _ = run(name, rl_inputs(logq, adv), logp, dtype=torch.bfloat16)
    assert loss16.dtype == torch.float32
    assert loss16.item() == loss32.item()  # the math itself ran in float32
    assert_close(grad16, grad32, tol=1e-2)  # only the stored gradient is bf16


def test_importance_sampling_huge_ratio_is_not_clamped() -> None:
    # exp(100) overflows float32: Tinker's importance sampling is unclipped, so
    # the loss is -inf rather than silently clamped ...
    loss, _, metrics, _ = run("importance_sampling", rl_inputs([-101.0], [1.0]), [-1.0])
    assert loss.item() == -math.inf
    assert metrics["log_ratio:max"] == pytest.approx(100.0)
    # ... but a token with zero advantage still contributes exactly nothing.
    loss, grad, _, _ = run(
        "importance_sampling", rl_inputs([-101.0, -1.0], [0.0, 1.0]), [-1.0, -1.0]
    )
    assert loss.item() == -1.0
    assert grad == [0.0, -1.0]


def test_ppo_huge_ratio_on_clipped_branch_has_finite_zero_gradient() -> None:
    loss, grad, _, _ = run("ppo", rl_inputs([-101.0, -1.0], [2.0, 0.0]), [-1.0, -1.0])
    assert loss.item() == pytest.approx(-1.2 * 2.0)
    assert grad == [0.0, 0.0]


def test_cispo_huge_ratio_is_clipped_weight() -> None:
    loss, grad, _, _ = run("cispo", rl_inputs([-101.0], [2.0]), [-1.0])
    assert_close(loss.item(), -(1.2 * -1.0 * 2.0))
    assert_close(grad, [-1.2 * 2.0])


def test_no_active_tokens_omits_ratio_extremes() -> None:
    _, _, metrics, _ = run("ppo", rl_inputs([0.0, 0.0], [0.0, 0.0]), [-1.0, -2.0])
    assert metrics == {
        "loss:sum": 0.0,
        "active_tokens:sum": 0.0,
        "log_ratio:sum": 0.0,
        "clipped_tokens:sum": 0.0,
    }


def test_compute_loss_rejects_wrong_logprob_shape() -> None:
    spec = validate_loss(
        "cross_entropy",
        {"target_tokens": torch.tensor([1, 2]), "weights": torch.ones(2)},
        {},
        2,
        VOCAB,
    )
    with pytest.raises(ValueError, match=r"shape \[3\]"):
        compute_loss(spec, torch.zeros(3))


def test_validate_moves_to_device_and_converts_dtypes() -> None:
    spec = validate_loss(
        "importance_sampling",
        {
            "target_tokens": torch.tensor([1, 2], dtype=torch.int32),
            "logprobs": torch.tensor([-1.0, -2.0], dtype=torch.float64),
            "advantages": [1, 0],  # ints from a JSON client
        },
        None,
        2,
        VOCAB,
        device="cpu",
    )
    assert spec.inputs["target_tokens"].dtype == torch.int64
    assert spec.inputs["logprobs"].dtype == torch.float32
    assert spec.inputs["advantages"].dtype == torch.float32
    assert spec.config == {}


# --------------------------------------------------------------------------- validation


def good_inputs(name: str, n: int = 4) -> dict[str, torch.Tensor]:
    targets = torch.arange(n) % VOCAB
    if name == "cross_entropy":
        return {"target_tokens": targets, "weights": torch.ones(n)}
    rl = {"target_tokens": targets, "logprobs": -torch.ones(n), "advantages": torch.ones(n)}
    if name == "gspo":
        rl["sequence_ratio_mask"] = torch.ones(n)
    if name == "stable_reinforce":
        rl["sampled_sequence"] = torch.ones(n)
    return rl


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_good_inputs_validate(name: str) -> None:
    spec = validate_loss(name, good_inputs(name), {}, 4, VOCAB, where="datum 0")
    assert spec.name == name


def with_(inputs: dict[str, torch.Tensor], **changes: object) -> dict[str, object]:
    out: dict[str, object] = dict(inputs)
    out.update(changes)
    return out


def nan_at(n: int, i: int, value: float = math.nan) -> torch.Tensor:
    t = torch.ones(n)
    t[i] = value
    return t


BAD_CASES = [
    # (id, name, inputs, config, num_tokens, fragments the message must contain)
    ("unknown loss", "sft", good_inputs("cross_entropy"), {}, 4, ["'sft'", "cross_entropy", "dro"]),
    (
        "missing key",
        "ppo",
        {"target_tokens": torch.arange(4), "logprobs": torch.zeros(4)},
        {},
        4,
        ["'advantages'", "missing", "'ppo'"],
    ),
    (
        "extra key (cookbook mask)",
        "ppo",
        with_(good_inputs("ppo"), mask=torch.ones(4)),
        {},
        4,
        ["loss_fn_inputs['mask']", "'ppo'"],
    ),
    (
        "clip tensor on a loss without clipping",
        "importance_sampling",
        with_(good_inputs("ppo"), clip_low_threshold=torch.ones(4)),
        {},
        4,
        ["loss_fn_inputs['clip_low_threshold']", "'importance_sampling'"],
    ),
    (
        "targets too short",
        "cross_entropy",
        with_(good_inputs("cross_entropy"), target_tokens=torch.arange(3)),
        {},
        4,
        ["loss_fn_inputs['target_tokens']", "[3]", "[4]"],
    ),
    (
        "advantages wrong length",
        "cispo",
        with_(good_inputs("cispo"), advantages=torch.ones(5)),
        {},
        4,
        ["loss_fn_inputs['advantages']", "[5]", "[4]"],
    ),
    (
        "2-D targets on an RL loss",
        "ppo",
        with_(good_inputs("ppo"), target_tokens=torch.zeros(4, 2, dtype=torch.int64)),
        {},
        4,
        ["loss_fn_inputs['target_tokens']", "[4, 2]", "'ppo'"],
    ),
    (
        "2-D weights do not match 2-D targets",
        "cross_entropy",
        {"target_tokens": torch.zeros(4, 2, dtype=torch.int64), "weights": torch.ones(4)},
        {},
        4,
        ["loss_fn_inputs['weights']", "[4]", "[4, 2]"],
    ),
    (
        "float target ids",
        "cross_entropy",
        with_(good_inputs("cross_entropy"), target_tokens=torch.zeros(4)),
        {},
        4,
        ["loss_fn_inputs['target_tokens']", "torch.float32"],
    ),
    (
        "bool weights",
        "cross_entropy",
        with_(good_inputs("cross_entropy"), weights=torch.ones(4, dtype=torch.bool)),
        {},
        4,
        ["loss_fn_inputs['weights']", "torch.bool"],
    ),
    (
        "target id too large",
        "cross_entropy",
        with_(good_inputs("cross_entropy"), target_tokens=torch.tensor([1, 2, VOCAB, 3])),
        {},
        4,
        ["loss_fn_inputs['target_tokens']", str(VOCAB), "position 2", f"[0, {VOCAB})"],
    ),
    (
        "negative target id",
        "dro",
        with_(good_inputs("dro"), target_tokens=torch.tensor([1, -1, 2, 3])),
        {},
        4,
        ["loss_fn_inputs['target_tokens']", "-1", "position 1"],
    ),
    (
        "NaN advantage",
        "ppo",
        with_(good_inputs("ppo", 8), advantages=nan_at(8, 7)),
        {},
        8,
        ["loss_fn_inputs['advantages'] has NaN at position 7"],
    ),
    (
        "inf sampler logprob",
        "importance_sampling",
        with_(good_inputs("ppo"), logprobs=nan_at(4, 2, -math.inf)),
        {},
        4,
        ["loss_fn_inputs['logprobs'] has -inf at position 2"],
    ),
    (
        "inf weight in top-k",
        "cross_entropy",
        {
            "target_tokens": torch.zeros(2, 3, dtype=torch.int64),
            "weights": torch.tensor([[1.0, 0.0, 0.0], [0.0, math.inf, 0.0]]),
        },
        {},
        2,
        ["loss_fn_inputs['weights'] has inf at position (1, 1)"],
    ),
    (
        "float64 value overflowing float32",
        "cross_entropy",
        with_(
            good_inputs("cross_entropy"),
            weights=torch.tensor([1.0, 1e300, 1.0, 1.0], dtype=torch.float64),
        ),
        {},
        4,
        ["loss_fn_inputs['weights']", "1e+300", "position 1", "float32"],
    ),
    (
        "NaN clip tensor",
        "ppo",
        with_(good_inputs("ppo"), clip_high_threshold=nan_at(4, 3)),
        {},
        4,
        ["loss_fn_inputs['clip_high_threshold'] has NaN at position 3"],
    ),
    (
        "unknown config key",
        "ppo",
        good_inputs("ppo"),
        {"clip_ratio": 0.2},
        4,
        ["loss_fn_config['clip_ratio']", "'ppo'", "clip_low_threshold"],
    ),
    (
        "config on cross_entropy",
        "cross_entropy",
        good_inputs("cross_entropy"),
        {"beta": 0.1},
        4,
        ["loss_fn_config['beta']", "'cross_entropy'"],
    ),
    (
        "non-numeric config",
        "dro",
        good_inputs("dro"),
        {"beta": "0.1"},
        4,
        ["loss_fn_config['beta']", "'0.1'"],
    ),
    (
        "NaN config",
        "dro",
        good_inputs("dro"),
        {"beta": math.nan},
        4,
        ["loss_fn_config['beta']", "NaN"],
    ),
    (
        "negative beta",
        "dro",
        good_inputs("dro"),
        {"beta": -0.5},
        4,
        ["loss_fn_config['beta']", "-0.5"],
    ),
    (
        "clip low above high in config",
        "cispo",
        good_inputs("cispo"),
        {"clip_low_threshold": 1.5},
        4,
        ["clip_low_threshold", "1.5", "clip_high_threshold", "1.2"],
    ),
    (
        "clip low tensor above config high",
        "ppo",
        with_(good_inputs("ppo"), clip_low_threshold=torch.tensor([0.8, 0.8, 1.4, 0.8])),
        {},
        4,
        [
            "loss_fn_inputs['clip_low_threshold'] = 1.4",
            "loss_fn_config['clip_high_threshold'] = 1.2",
            "position 2",
        ],
    ),
    (
        "clip tensors crossed",
        "ppo",
        with_(
            good_inputs("ppo"),
            clip_low_threshold=torch.tensor([0.8, 0.9, 0.8, 0.8]),
            clip_high_threshold=torch.tensor([1.2, 0.5, 1.2, 1.2]),
        ),
        {},
        4,
        [
            "loss_fn_inputs['clip_low_threshold'] = 0.9",
            "loss_fn_inputs['clip_high_threshold'] = 0.5",
            "position 1",
        ],
    ),
    (
        "unreadable input",
        "cross_entropy",
        with_(good_inputs("cross_entropy"), weights=object()),
        {},
        4,
        ["loss_fn_inputs['weights']", "object"],
    ),
    (
        "empty datum",
        "cross_entropy",
        good_inputs("cross_entropy", 0),
        {},
        0,
        ["model_input", "0 tokens"],
    ),
]


@pytest.mark.parametrize(
    ("name", "inputs", "config", "num_tokens", "fragments"),
    [case[1:] for case in BAD_CASES],
    ids=[case[0] for case in BAD_CASES],
)
def test_bad_input_raises(
    name: str,
    inputs: dict[str, object],
    config: dict[str, object],
    num_tokens: int,
    fragments: list[str],
) -> None:
    with pytest.raises(LossInputError) as info:
        validate_loss(name, inputs, config, num_tokens, VOCAB, where="datum 3")  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith("datum 3: "), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_loss_input_error_is_value_error_and_where_is_optional() -> None:
    with pytest.raises(ValueError, match=r"^unknown loss_fn 'nope'"):
        validate_loss("nope", {}, {}, 1, VOCAB)


def test_validation_does_not_modify_inputs() -> None:
    inputs = good_inputs("ppo")
    inputs["advantages"] = nan_at(4, 1)
    before = {k: v.clone() for k, v in inputs.items()}
    with pytest.raises(LossInputError):
        validate_loss("ppo", inputs, {}, 4, VOCAB)
    for key, value in before.items():
        assert torch.allclose(inputs[key], value, equal_nan=True)


# --------------------------------------------------------------------------- merge_metrics


def test_merge_metrics_by_reduction() -> None:
    merged = merge_metrics(
        [
            {"loss:sum": 1.5, "log_ratio:min": -0.2, "log_ratio:max": 0.1, "x:mean": 1.0},
            {"loss:sum": -0.5, "log_ratio:min": -0.4, "log_ratio:max": 0.05, "x:mean": 3.0},
            {"loss:sum": 2.0},  # a datum without active tokens has no min/max
        ]
    )
    assert merged == {
        "loss:sum": 3.0,
        "log_ratio:min": -0.4,
        "log_ratio:max": 0.1,
        "x:mean": 2.0,
    }


def test_merge_metrics_empty_and_nan() -> None:
    assert merge_metrics([]) == {}
    merged = merge_metrics(
        [{"a:max": math.nan}, {"a:max": 1.0}, {"b:min": 1.0}, {"b:min": math.nan}]
    )
    assert math.isnan(merged["a:max"]) and math.isnan(merged["b:min"])


@pytest.mark.parametrize("key", ["loss", "loss:avg", ":sum", "loss:"])
def test_merge_metrics_rejects_unknown_reduction(key: str) -> None:
    with pytest.raises(ValueError, match="name:reduction"):
        merge_metrics([{key: 1.0}])


def test_merge_metrics_of_computed_losses_matches_whole_batch() -> None:
    """Summing per-datum loss:sum equals the loss of all tokens at once."""
    logq = [-1.0, -0.4, -2.0, -0.7, -1.1]
    logp = [-0.6, -0.9, -1.0, -0.7, -1.3]
    adv = [1.0, -0.5, 2.0, 0.0, 0.4]
    _, _, whole, _ = run("ppo", rl_inputs(logq, adv), logp)
    parts = [
        run("ppo", rl_inputs(logq[:2], adv[:2]), logp[:2])[2],
        run("ppo", rl_inputs(logq[2:], adv[2:]), logp[2:])[2],
    ]
    merged = merge_metrics(parts)
    assert merged.keys() == whole.keys()
    for key in whole:
        assert_close(merged[key], whole[key])


# --------------------------------------------------------------------------- SDK 0.38 additions


def ref_gspo(logp, logq, adv, mask, lo, hi) -> tuple[float, list[float]]:
    """GSPO-token as Tinker documents it: one sequence ratio s = exp(mean log-ratio over the
    masked tokens); each token carries s's value with d s_t / d logp_t = s (its own gradient)."""
    marked = [lp - lq for lp, lq, m in zip(logp, logq, mask, strict=True) if m != 0]
    s = math.exp(sum(marked) / len(marked))
    loss, grad = 0.0, []
    for a in adv:
        unclipped, clipped = s * a, _clip(s, lo, hi) * a
        if unclipped <= clipped:
            loss -= unclipped
            grad.append(-s * a)
        else:
            loss -= clipped
            grad.append(0.0)
    return loss, grad


@pytest.mark.parametrize("targets_2d", [False, True])
def test_cross_entropy_weights_default_to_ones(targets_2d: bool) -> None:
    """The SDK's docstring example sends target_tokens only."""
    targets = [[1, 2], [3, 4], [5, 6]] if targets_2d else [1, 2, 3]
    logp = [[-0.5, -1.5], [-2.0, -0.1], [-0.3, -0.7]] if targets_2d else [-0.5, -2.0, -0.3]
    loss, grad, _, spec = run("cross_entropy", {"target_tokens": targets}, logp)
    flat = [x for row in logp for x in row] if targets_2d else logp
    assert_close(loss.item(), -sum(flat))
    assert spec.inputs["weights"].shape == spec.inputs["target_tokens"].shape
    assert bool((spec.inputs["weights"] == 1).all())
    ones = [[1.0, 1.0]] * 3 if targets_2d else [1.0] * 3
    explicit, explicit_grad, _, _ = run(
        "cross_entropy", {"target_tokens": targets, "weights": ones}, logp
    )
    assert loss.item() == explicit.item() and grad == explicit_grad


GSPO_CASES = [
    # (id, logp, logq, adv, mask, config): prompt tokens carry A = 0, logq = 0 and mask 0
    (
        "ratio inside the range",
        [-9.0, -1.0, -0.5, -2.0],
        [0.0, -1.1, -0.4, -2.05],
        [0.0, 1.0, 1.0, 1.0],
        [0.0, 1.0, 1.0, 1.0],
        {},
    ),
    (
        "ratio above high: positive advantages clipped, negative live",
        [-1.0, -0.2, -0.3, -0.1],
        [-1.0, -1.2, -1.3, -1.1],
        [0.0, 2.0, -1.0, 0.5],
        [0.0, 1.0, 1.0, 1.0],
        {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    ),
    (
        "ratio below low: negative advantages clipped",
        [-3.0, -2.0, -2.5],
        [-1.0, -1.0, -1.0],
        [-1.0, 1.0, -0.5],
        [1.0, 1.0, 0.0],
        {},
    ),
]


@pytest.mark.parametrize(
    ("logp", "logq", "adv", "mask", "config"),
    [case[1:] for case in GSPO_CASES],
    ids=[case[0] for case in GSPO_CASES],
)
def test_gspo_matches_reference(logp, logq, adv, mask, config) -> None:
    lo = config.get("clip_low_threshold", 0.8)
    hi = config.get("clip_high_threshold", 1.2)
    inputs = rl_inputs(logq, adv, sequence_ratio_mask=mask)
    loss, grad, metrics, _ = run("gspo", inputs, logp, config)
    ref_loss, ref_grad = ref_gspo(logp, logq, adv, mask, lo, hi)
    assert_close(loss.item(), ref_loss)
    assert_close(grad, ref_grad)
    assert metrics["active_tokens:sum"] == sum(a != 0 for a in adv)


def test_gspo_sequence_ratio_ignores_unmasked_tokens() -> None:
    """A huge log-ratio outside the mask neither moves the ratio nor overflows."""
    adv = [0.0, 1.0, 1.0]
    base = run(
        "gspo", rl_inputs([0.0, -1.0, -1.0], adv, sequence_ratio_mask=[0, 1, 1]), [-1, -1, -1]
    )
    wild = run(
        "gspo", rl_inputs([-500.0, -1.0, -1.0], adv, sequence_ratio_mask=[0, 1, 1]), [-1, -1, -1]
    )
    assert base[0].item() == wild[0].item() and base[1] == wild[1]
    assert math.isfinite(wild[0].item())


@pytest.mark.parametrize(
    ("inputs", "fragments"),
    [
        (rl_inputs([-1.0] * 3, [1.0] * 3), ["'sequence_ratio_mask'", "missing", "'gspo'"]),
        (
            rl_inputs([-1.0] * 3, [1.0] * 3, sequence_ratio_mask=[0.0] * 3),
            ["loss_fn_inputs['sequence_ratio_mask']", "marks no token"],
        ),
    ],
    ids=["missing mask", "empty mask"],
)
def test_gspo_bad_mask_raises(inputs, fragments) -> None:
    with pytest.raises(LossInputError) as info:
        validate_loss("gspo", inputs, {}, 3, VOCAB, where="datum 1")  # type: ignore[arg-type]
    for fragment in ["datum 1: ", *fragments]:
        assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("name", "reason"),
    [("custom", "forward_backward_custom")],
)
def test_refused_losses_say_why_and_what_is_supported(name: str, reason: str) -> None:
    with pytest.raises(LossInputError) as info:
        validate_loss(name, rl_inputs([-1.0], [1.0]), {}, 1, VOCAB)
    message = str(info.value)
    assert f"loss_fn {name!r} is not supported" in message
    assert reason in message and "gspo" in message and "cross_entropy" in message


# --------------------------------------------------------------------------- stable_reinforce


def ref_stable_reinforce(
    logp: list[float],
    logq: list[float],
    adv: list[float],
    seg: list[int],
    clip: float = 2.0,
    tok: tuple[float, float] = (0.2, 5.0),  # the bands the formula test sets
    seq: tuple[float, float] = (0.5, 2.0),
    kl: float = 0.0,
) -> tuple[float, list[float]]:
    """docs/losses.md's formula, token by token in plain Python: loss and d loss / d logp."""
    runs: dict[int, list[float]] = {}
    for lp, lq, s in zip(logp, logq, seg, strict=True):
        if s > 0 and tok[0] <= math.exp(lp - lq) <= tok[1]:  # over the token mask's survivors
            runs.setdefault(s, []).append(lp - lq)
    seq_ok = {s: seq[0] <= math.exp(sum(v) / len(v)) <= seq[1] for s, v in runs.items()}
    loss, grad = 0.0, []
    for lp, lq, a, s in zip(logp, logq, adv, seg, strict=True):
        r = math.exp(lp - lq)
        keep = s > 0 and tok[0] <= r <= tok[1] and seq_ok[s]
        if not keep:
            grad.append(0.0)
            continue
        w = min(r, clip)
        loss -= w * a * lp - 0.5 * kl * (lp - lq) ** 2
        grad.append(-(w * a) + kl * (lp - lq))
    return loss, grad


@pytest.mark.parametrize("kl", [0.0, 0.3])
def test_stable_reinforce_matches_the_documented_formula(kl: float) -> None:
    logq = [0.0, -1.0, -1.0, -2.0, -0.5, -0.7, -1.0]
    logp = [-3.0, -0.2, -1.1, -2.5, -1.2, -1.4, -1.0]  # token 1: r=2.2 (truncated)
    adv = [0.0, 1.0, 1.0, 1.0, -1.0, -1.0, 0.5]
    seg = [0, 1, 1, 1, 2, 2, 3]  # run 2's mean log-ratio is -0.7: the sequence guard drops it
    inputs = rl_inputs(logq, adv, sampled_sequence=[float(s) for s in seg])
    guards = {"token_mask_low": 0.2, "token_mask_high": 5.0, "seq_mask_low": 0.5}
    config = {"kl_coeff": kl, **guards, "seq_mask_high": 2.0}
    loss, grad, metrics, spec = run("stable_reinforce", inputs, logp, config)
    ref_loss, ref_grad = ref_stable_reinforce(logp, logq, adv, seg, kl=kl)
    assert_close(loss.item(), ref_loss)
    assert_close(grad, ref_grad)
    assert metrics["sequences:sum"] == 3 and metrics["masked_sequences:sum"] == 1
    assert metrics["clipped_tokens:sum"] == 1 and metrics["masked_tokens:sum"] == 2
    assert metrics["active_tokens:sum"] == 6
    mask = gradient_mask(spec).tolist()
    assert mask == ([False, True, True, True, True, True, True] if kl else [False] + [True] * 6)


def test_stable_reinforce_sequence_guard_ignores_a_masked_outlier() -> None:
    """One token far off (masked by the token mask) does not drop the rest of its sequence."""
    logq = [-1.0, -1.0, -1.0]
    logp = [-1.0, -1.1, -9.0]  # token 2: ratio e^-8 < token_mask_low (1e-3), masked
    inputs = rl_inputs(logq, [1.0] * 3, sampled_sequence=[1.0] * 3)
    _, grad, metrics, _ = run("stable_reinforce", inputs, logp)
    assert metrics["masked_sequences:sum"] == 0 and metrics["masked_tokens:sum"] == 1
    assert grad[2] == 0.0 and grad[0] != 0.0 and grad[1] != 0.0


def test_stable_reinforce_weights_stay_bounded_far_off_policy() -> None:
    """Where importance_sampling's weight explodes (a stale sampler), each stable_reinforce
    token's gradient is at most token_clip * |A|, and tokens past the mask get none."""
    logq = [-20.0, -1.0, -1.0, -1.0]
    logp = [-0.1, -1.0, -0.9, -1.1]  # token 0: ratio e^19.9
    adv = [1.0, 1.0, 1.0, 1.0]
    _, is_grad, _, _ = run("importance_sampling", rl_inputs(logq, adv), logp)
    assert abs(is_grad[0]) > 1e8
    config = {"token_mask_high": 100.0, "seq_mask_high": 1e9}  # token 0 alone past a guard
    inputs = rl_inputs(logq, adv, sampled_sequence=[1.0] * 4)
    _, grad, metrics, _ = run("stable_reinforce", inputs, logp, config)
    assert grad[0] == 0.0 and metrics["masked_tokens:sum"] == 1
    assert all(abs(g) <= 2.0 + 1e-6 for g in grad)


@pytest.mark.parametrize(
    ("inputs", "config", "fragment"),
    [
        ({"sampled_sequence": [0.0, 0.0]}, {}, "marks no sampled token"),
        ({"sampled_sequence": [1.5, 1.0]}, {}, "holds 0 (not a sampled token)"),
        ({"sampled_sequence": [-1.0, 1.0]}, {}, "holds 0 (not a sampled token)"),
        ({"sampled_sequence": [1.0, 1.0]}, {"token_clip": 0.0}, "'token_clip'] must be > 0"),
        ({"sampled_sequence": [1.0, 1.0]}, {"kl_coeff": -1.0}, "'kl_coeff'] must be >= 0"),
        ({"sampled_sequence": [1.0, 1.0]}, {"seq_mask_low": 1.5}, "0 <= seq_mask_low <= 1"),
        ({"sampled_sequence": [1.0, 1.0]}, {"token_mask_high": 0.9}, "token_mask_high"),
        ({"sampled_sequence": [1.0, 1.0]}, {"beta": 0.1}, "'beta'] is not accepted"),
        ({}, {}, "'sampled_sequence', which is missing"),
    ],
)
def test_stable_reinforce_bad_inputs(inputs, config, fragment) -> None:
    with pytest.raises(LossInputError, match="datum 2") as info:
        validate_loss(
            "stable_reinforce",
            rl_inputs([-1.0, -1.0], [1.0, 1.0], **inputs),
            config,
            2,
            VOCAB,
            where="datum 2",
        )
    assert fragment in str(info.value), str(info.value)
