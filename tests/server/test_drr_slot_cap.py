"""Weighted shares hold when the trainer slots cap a round's models below the number of
backlogged tenants (3 tenants, weights 1:2:4, `--max-adapters 2`). Before, a tenant passed over
because the round already held `max_models` models lost that turn's credit, and the shares came
out 0.083 / 0.25 / 0.667 instead of 1/7, 2/7, 4/7 (measured through the SDK the same)."""

from __future__ import annotations

from lorafleet.server.ops.fair_share import DeficitRoundRobin, Work
from tests.server.test_drr import _rounds, _served


def test_weights_hold_when_slots_cap_the_models_of_a_round():
    weights = {"a": 1.0, "b": 2.0, "c": 4.0}
    drr = DeficitRoundRobin(quantum=128, weight_of=weights.__getitem__)
    work = {t: [Work(f"{t}-op", f"{t}-model", 0, (64,) * 20_000)] for t in weights}
    history = _rounds(drr, work, budget=512, rounds=700, max_models=2)
    served = _served(history, {f"{t}-op": t for t in weights})
    assert all(len({t.key for t in takes}) <= 2 for takes in history)  # the cap holds
    assert all(sum(t.tokens for t in takes) <= 512 for takes in history)
    total = sum(served.values())
    for tenant, weight in weights.items():
        share = served[tenant] / total
        assert abs(share - weight / 7) <= 0.1 * weight / 7, (tenant, share, dict(served))
    # a blocked tenant banks at most one round's budget of credit
    assert all(d <= 512 for d in drr.deficits.values()), drr.deficits
