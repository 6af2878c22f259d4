"""Two tenants with different ranks train at the same time: their forward/backward work and
their optimizer steps share engine batches, and each gets exactly what it gets alone."""

from __future__ import annotations

import httpx
import numpy as np
from tinker import types

from tests.server.conftest import KEY_A, sl_datum, wait_pending

DATA_A = [sl_datum([5, 9, 14, 20, 27, 35, 44, 54, 65]), sl_datum([100, 101, 102, 103, 104])]
DATA_B = [sl_datum([300, 200, 100, 50, 25, 12, 6, 3])]
STEPS = 3


def _logprobs(result: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in result.loss_fn_outputs]


def _step(tc, data, lr):
    return tc.forward_backward(data, "cross_entropy"), tc.optim_step(
        types.AdamParams(learning_rate=lr)
    )


def test_two_tenants_share_batches_and_match_solo_runs(server, client_a, client_b, base_model):
    stats = server.service.scheduler.stats
    # Alone: one tenant at a time, every call awaited before the other tenant's.
    solo_a = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=11).result()
    solo_b = client_b.create_lora_training_client(base_model=base_model, rank=16, seed=12).result()
    alone: dict[str, list] = {"a": [], "b": []}
    for _ in range(STEPS):
        for name, tc, data, lr in (("a", solo_a, DATA_A, 1e-2), ("b", solo_b, DATA_B, 3e-3)):
            fwd, opt = _step(tc, data, lr)
            alone[name].append((_logprobs(fwd.result()), opt.result().metrics))

    # Together: both tenants' requests are queued before the scheduler runs a round.
    mixed_before = stats.mixed_batches["forward_backward"]
    cross_before = stats.cross_tenant_batches["optim_step"]
    tc_a = client_a.create_lora_training_client(base_model=base_model, rank=4, seed=11).result()
    tc_b = client_b.create_lora_training_client(base_model=base_model, rank=16, seed=12).result()
    together: dict[str, list] = {"a": [], "b": []}
    for _ in range(STEPS):
        server.service.scheduler.pause()
        try:
            fa, oa = _step(tc_a, DATA_A, 1e-2)
            fb, ob = _step(tc_b, DATA_B, 3e-3)
            wait_pending(server, 4)
        finally:
            server.service.scheduler.resume()
        together["a"].append((_logprobs(fa.result()), oa.result().metrics))
        together["b"].append((_logprobs(fb.result()), ob.result().metrics))

    assert stats.mixed_batches["forward_backward"] - mixed_before >= STEPS
    assert stats.cross_tenant_batches["optim_step"] - cross_before >= STEPS
    for name in ("a", "b"):
        for (lp_alone, m_alone), (lp_mixed, m_mixed) in zip(
            alone[name], together[name], strict=True
        ):
            for x, y in zip(lp_alone, lp_mixed, strict=True):
                np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
            assert np.isclose(m_alone["grad_norm:mean"], m_mixed["grad_norm:mean"], rtol=1e-5)
    # and the weights after training agree too
    for solo, mixed, data in ((solo_a, tc_a, DATA_A), (solo_b, tc_b, DATA_B)):
        for x, y in zip(
            _logprobs(solo.forward(data, "cross_entropy").result()),
            _logprobs(mixed.forward(data, "cross_entropy").result()),
            strict=True,
        ):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)

    # the counters are exposed over HTTP
    body = httpx.get(
        f"{server.base_url}/api/v1/lorafleet/stats", headers={"X-API-Key": KEY_A}
    ).json()
    assert body["mixed_batches"]["forward_backward"] >= STEPS
