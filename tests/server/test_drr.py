"""Fair share, deterministic: the deficit round-robin's picks (fair_share.py) and the scheduler
running a call in chunks over rounds with a fake executor (no model, no HTTP)."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from lorafleet.server.ops.fair_share import DeficitRoundRobin, Work
from lorafleet.server.ops.futures import Result
from lorafleet.server.ops.scheduler import Partial, Scheduler, TrainChunk
from lorafleet.server.ops.types import Job
from tests.server.jobs import job, train_op


def _rounds(drr, work: dict[str, list[Work]], budget: int, rounds: int, max_models=None):
    """Runs `rounds` plans over backlogged `work`, advancing each op past what was taken; returns
    the takes of every round."""
    history = []
    for _ in range(rounds):
        ready = {t: ws for t, ws in work.items() if ws}
        takes = drr.plan(ready, budget, max_models)
        history.append(takes)
        by_key = {take.key: take for take in takes}
        for tenant, works in work.items():
            kept = []
            for w in works:
                take = by_key.get(w.key)
                start = w.start if take is None else take.stop
                if start < len(w.sizes):
                    kept.append(Work(w.key, w.model, start, w.sizes))
            work[tenant] = kept
    return history


def _served(history, owner: dict[str, str]) -> Counter[str]:
    served: Counter[str] = Counter()
    for takes in history:
        for take in takes:
            served[owner[take.key]] += take.tokens
    return served


def test_backlogged_tenants_are_served_by_weight():
    weights = {"a": 1.0, "b": 2.0, "c": 4.0}
    drr = DeficitRoundRobin(quantum=40, weight_of=weights.__getitem__)
    work = {t: [Work(f"{t}-op", f"{t}-model", 0, (10,) * 10_000)] for t in weights}
    owner = {f"{t}-op": t for t in weights}
    history = _rounds(drr, work, budget=70, rounds=200)
    served = _served(history, owner)
    assert all(sum(t.tokens for t in takes) <= 70 for takes in history)
    total = sum(served.values())
    assert total == 200 * 70  # every round full: 7 datums of 10
    for tenant, weight in weights.items():
        # within one quantum plus one datum of the weighted share
        assert abs(served[tenant] - total * weight / 7) <= 40 + 10


def test_equal_weights_with_sizes_1_to_32x_get_equal_tokens():
    sizes = {"t1": 4, "t2": 16, "t3": 64, "t4": 128}
    drr = DeficitRoundRobin(quantum=128, weight_of=lambda t: 1.0)
    work = {t: [Work(f"{t}-op", t, 0, (n,) * 5_000)] for t, n in sizes.items()}
    history = _rounds(drr, work, budget=512, rounds=100)
    served = _served(history, {f"{t}-op": t for t in sizes})
    mean = sum(served.values()) / len(served)
    assert all(abs(v - mean) <= 128 + 128 for v in served.values()), served


def test_a_datum_bigger_than_the_credit_waits_for_its_deficit_and_others_go_first():
    drr = DeficitRoundRobin(quantum=100, weight_of=lambda t: 1.0)
    work = {"big": [Work("B", "mb", 0, (250,))], "small": [Work("S", "ms", 0, (30,) * 100)]}
    history = _rounds(drr, work, budget=430, rounds=1)
    # big's turn: credit 100 < 250, so it passes; small runs 3 datums (90 of its 100); then big
    # (200), small again (3 more, 20 left), and big takes its 250 at its third turn: 430 in all.
    assert [(t.key, t.start, t.stop) for t in history[0]] == [("S", 0, 6), ("B", 0, 1)]
    assert "big" not in drr.deficits  # its work ran out: no credit kept
    assert drr.deficits["small"] == 20 and drr.order() == ["small"]


def test_a_tenant_whose_work_runs_out_keeps_no_credit_and_rejoins_at_the_back():
    drr = DeficitRoundRobin(quantum=100, weight_of=lambda t: 1.0)
    b1 = Work("b1", "mb", 0, (500,))
    takes = drr.plan({"a": [Work("a1", "ma", 0, (10,))], "b": [b1]}, 200)
    # a's work ran out after 10 tokens; b's 500 needs five turns' credit and then does not fit
    # beside a's 10: the round ends with b's turn open, b keeping its credit
    assert [t.key for t in takes] == ["a1"]
    assert "a" not in drr.deficits and drr.order() == ["b"] and drr.deficits["b"] == 500
    takes = drr.plan({"a": [Work("a2", "ma", 0, (10,))], "b": [b1]}, 200)
    assert [t.key for t in takes] == ["b1"]  # b's turn first, alone (bigger than the budget)
    assert drr.order() == ["a"] and drr.deficits["a"] == 0.0  # a rejoined behind b, no credit


def test_an_oversize_datum_runs_alone_as_the_first_work_of_a_round():
    drr = DeficitRoundRobin(quantum=64, weight_of=lambda t: 1.0)
    work = {"huge": [Work("H", "mh", 0, (300,))], "tiny": [Work("T", "mt", 0, (8,) * 50)]}
    history = _rounds(drr, work, budget=128, rounds=12)
    rounds_with_h = [i for i, takes in enumerate(history) if any(t.key == "H" for t in takes)]
    assert len(rounds_with_h) == 1
    assert [t.key for t in history[rounds_with_h[0]]] == ["H"]  # alone
    assert all(
        sum(t.tokens for t in takes) <= 128
        for i, takes in enumerate(history)
        if i not in rounds_with_h
    )


def test_a_round_touches_at_most_max_models():
    drr = DeficitRoundRobin(quantum=50, weight_of=lambda t: 1.0)
    ready = {t: [Work(f"{t}-op", f"{t}-model", 0, (10,) * 3)] for t in ("a", "b", "c")}
    takes = drr.plan(ready, 1000, max_models=2)
    assert {t.key for t in takes} == {"a-op", "b-op"}
    assert drr.deficits.get("c", 0.0) == 50.0  # passed over, but blocked (not idle): credited
    takes = drr.plan({"c": ready["c"]}, 1000, max_models=2)
    assert [t.key for t in takes] == ["c-op"]


def test_a_bad_weight_is_refused_naming_the_tenant():
    drr = DeficitRoundRobin(quantum=10, weight_of=lambda t: 0.0)
    with pytest.raises(ValueError, match="tenant 'x'.*got 0.0"):
        drr.plan({"x": [Work("k", "m", 0, (1,))]}, 10)
    with pytest.raises(ValueError, match="round token budget"):
        DeficitRoundRobin(quantum=10, weight_of=lambda t: 1.0).plan({}, 0)


# ---------------------------------------------------------------------- the scheduler, chunked


class _ChunkExecutor:
    """Records each round's batch as (model, start, stop); non-last chunks hand back their
    range, and the last chunk's result lists every chunk's range in order."""

    def __init__(self, fail: set[tuple[str, int]] | None = None):
        self.calls: list[tuple[str, list[tuple[str | None, int, int]]]] = []
        self.fail = fail or set()
        self.on_train: list = []  # callables run at the start of each train batch

    def run_control(self, op):
        return Result.json({"ok": True})

    def run_train(self, chunks: list[TrainChunk]):
        if self.on_train:
            self.on_train.pop(0)()
        self.calls.append(("train", [(c.job.model_id, c.start, c.stop) for c in chunks]))
        out: list[Result | Partial] = []
        for c in chunks:
            if (c.job.request_id, c.start) in self.fail:
                out.append(Result.error(ValueError("bad chunk")))  # type: ignore[arg-type]
            elif c.last:
                out.append(Result.json({"ranges": [*c.earlier, [c.start, c.stop]]}))
            else:
                out.append(Partial([c.start, c.stop]))
        return out

    def run_optim(self, ops):
        self.calls.append(("optim", [(op.model_id, 0, 0) for op in ops]))
        return [Result.json({"ok": True}) for _ in ops]

    def start_sample(self, ops):
        return [Result.json({}) for _ in ops]

    def step_sampler(self):
        return False


class _Futures:
    def __init__(self):
        self.done: dict[str, Result] = {}
        self.cond = threading.Condition()

    def complete(self, request_id, result):
        with self.cond:
            self.done[request_id] = result
            self.cond.notify_all()

    def wait(self, *ids: str, timeout: float = 10.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: all(i in self.done for i in ids), timeout), (
                f"not done: {[i for i in ids if i not in self.done]}"
            )


def _scheduler(futures, **kw) -> Scheduler:
    return Scheduler(futures, **kw)  # type: ignore[arg-type]


def _fb(rid: str, tenant: str, model: str, seq: int, sizes: list[int]) -> Job:
    return job(rid, train_op(sizes), tenant, model_id=model, seq_id=seq)


def test_a_big_call_runs_in_chunks_and_its_optim_step_waits_for_the_last():
    executor, futures = _ChunkExecutor(), _Futures()
    scheduler = _scheduler(futures, round_token_budget=100)  # quantum 25
    for model in ("big", "small"):
        scheduler.register_model(model)
    scheduler.pause()
    scheduler.start(lambda: executor)
    try:
        scheduler.submit(_fb("B1", "flooder", "big", 1, [10] * 40))
        scheduler.submit(job("B2", "optim_step", "flooder", model_id="big", seq_id=2))
        scheduler.submit(_fb("S1", "small", "small", 1, [10]))
        scheduler.submit(job("S2", "optim_step", "small", model_id="small", seq_id=2))
        scheduler.resume()
        futures.wait("B1", "B2", "S1", "S2")
    finally:
        scheduler.stop()
    ranges = json.loads(futures.done["B1"].body)["ranges"]
    assert ranges[0][0] == 0 and ranges[-1][1] == 40 and len(ranges) > 1
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # in order, whole
    train_rounds = [batch for kind, batch in executor.calls if kind == "train"]
    assert all(
        sum((stop - start) * 10 for _, start, stop in batch) <= 100 for batch in train_rounds
    )
    # the small tenant's step ran in the first round, beside the flooder's first chunk
    assert ("small", 0, 1) in train_rounds[0]
    # big's optim_step ran only after the round that ran its last chunk
    last_chunk = max(
        i
        for i, (kind, batch) in enumerate(executor.calls)
        if kind == "train" and ("big", ranges[-1][0], 40) in batch
    )
    big_optim = next(
        i
        for i, (kind, batch) in enumerate(executor.calls)
        if kind == "optim" and ("big", 0, 0) in batch
    )
    assert big_optim > last_chunk
    assert scheduler.stats.split_ops == 1 and scheduler.stats.chunks == len(ranges)


def test_a_small_step_arriving_mid_split_runs_within_two_rounds():
    executor, futures = _ChunkExecutor(), _Futures()
    scheduler = _scheduler(futures, round_token_budget=100)
    for model in ("big", "small"):
        scheduler.register_model(model)
    rounds_before: list[int] = []

    def arrive() -> None:  # submitted while the flooder's second chunk runs
        rounds_before.append(len(executor.calls))
        scheduler.submit(_fb("S1", "small", "small", 1, [10]))

    executor.on_train = [lambda: None, arrive]
    scheduler.pause()
    scheduler.start(lambda: executor)
    try:
        scheduler.submit(_fb("B1", "flooder", "big", 1, [10] * 100))
        scheduler.resume()
        futures.wait("S1", "B1")
    finally:
        scheduler.stop()
    ran_in = next(i for i, (_, batch) in enumerate(executor.calls) if ("small", 0, 1) in batch)
    assert ran_in - rounds_before[0] <= 2  # the round it arrived in, then at most the next
    assert not futures.done["B1"].failed


def test_a_failed_chunk_fails_the_whole_call_and_the_model_goes_on():
    executor, futures = _ChunkExecutor(fail={("B1", 20)}), _Futures()
    scheduler = _scheduler(futures, round_token_budget=100, quantum=100)
    scheduler.register_model("big")
    scheduler.pause()
    scheduler.start(lambda: executor)
    try:
        scheduler.submit(_fb("B1", "t", "big", 1, [10] * 40))
        scheduler.submit(_fb("B2", "t", "big", 2, [10] * 2))
        scheduler.resume()
        futures.wait("B1", "B2")
    finally:
        scheduler.stop()
    assert futures.done["B1"].failed and not futures.done["B2"].failed
    ran = [r for kind, batch in executor.calls if kind == "train" for r in batch]
    assert ("big", 30, 40) not in ran and ("big", 0, 2) in ran  # B1's rest never ran
    assert scheduler.pending() == 0 and not scheduler._train


def test_state_reports_queues_deficits_and_rounds():
    executor, futures = _ChunkExecutor(), _Futures()
    scheduler = _scheduler(futures, round_token_budget=100, weight_of={"a": 2.0, "b": 1.0}.get)
    scheduler.register_model("ma")
    scheduler.register_model("mb")
    scheduler.pause()
    scheduler.start(lambda: executor)
    try:
        scheduler.submit(_fb("A1", "a", "ma", 1, [10] * 30))
        scheduler.submit(_fb("B1", "b", "mb", 1, [10] * 3))
        state = scheduler.state()
        assert state["tenants"]["a"] == {
            "queued_ops": 1,
            "queued_train_tokens": 300,
            "weight": 2.0,
            "deficit": 0.0,
        }
        assert state["round_token_budget"] == 100 and state["quantum"] == 25
        scheduler.resume()
        futures.wait("A1", "B1")
        state = scheduler.state()
        assert state["rounds_per_s"] > 0 and 0 < state["train_tokens_per_round"]["max"] <= 100
    finally:
        scheduler.stop()


def test_the_cli_default_budget_is_the_schedulers():
    from lorafleet.cli import build_parser
    from lorafleet.server.config import ServerConfig
    from lorafleet.server.ops.scheduler import DEFAULT_ROUND_TOKENS

    args = ["serve", "--base-model", "tiny-qwen3", "--data-dir", "unused"]
    assert build_parser().parse_args(args).round_token_budget == DEFAULT_ROUND_TOKENS
    assert ServerConfig("tiny-qwen3", Path("unused"), []).round_token_budget == DEFAULT_ROUND_TOKENS
    with pytest.raises(SystemExit):
        build_parser().parse_args([*args, "--round-token-budget", "0"])


def test_datum_costs_count_only_what_earlier_datums_do_not_share():
    import torch

    from lorafleet.server.ops.fair_share import datum_costs

    history = list(range(100, 500))
    turns = [history[: 40 + 30 * k] for k in range(10)]  # turn k+1 extends turn k
    other = [7, *history[1:50]]  # differs at its first token: shares nothing
    tokens = [torch.tensor(t, dtype=torch.int64) for t in [*turns, other]]
    assert datum_costs(tokens) == [40, *[30] * 9, 50]


def test_a_multi_turn_call_runs_in_one_round_when_counted_after_sharing():
    """Ten turns of 400-670 tokens (each the last plus 30): counted raw, a 512-token budget cut
    them into ten rounds and no turn shared its history; counted after sharing (`datum_costs`) they
    run in one round, and the metered tokens are still every token."""
    executor, futures = _ChunkExecutor(), _Futures()
    sizes = [400 + 30 * k for k in range(10)]
    costs = [400, *[30] * 9]
    worked: list[int] = []
    scheduler = Scheduler(
        futures,  # type: ignore[arg-type]
        round_token_budget=1024,
        on_work=lambda kind, work, seconds, done: worked.extend(n for _, n in work),
    )
    scheduler.register_model("m")
    scheduler.start(lambda: executor)
    try:
        scheduler.submit(job("E", train_op(sizes, costs), "t", model_id="m", seq_id=1))
        futures.wait("E")
    finally:
        scheduler.stop()
    train_rounds = [batch for kind, batch in executor.calls if kind == "train"]
    assert train_rounds == [[("m", 0, 10)]]
    assert worked == [sum(sizes)]


# ---------------------------------------------------------------------- a tenant alone


def _train_rounds(executor: _ChunkExecutor) -> list[list[tuple[str | None, int, int]]]:
    return [batch for kind, batch in executor.calls if kind == "train"]


def test_a_lone_tenants_big_call_runs_in_one_solo_round():
    """Alone, a call far over the round budget runs whole (its turns keep sharing their
    history); the round budget bounds only other tenants' wait."""
    executor, futures = _ChunkExecutor(), _Futures()
    scheduler = _scheduler(
        futures, round_token_budget=100, solo_round_token_budget=1000, solo_after_s=0.0
    )
    scheduler.register_model("big")
    scheduler.pause()
    scheduler.start(lambda: executor)
    try:
        scheduler.submit(_fb("B1", "lone", "big", 1, [10] * 40))
        scheduler.submit(job("B2", "optim_step", "lone", model_id="big", seq_id=2))
        scheduler.resume()
        futures.wait("B1", "B2")
    finally:
        scheduler.stop()
    assert _train_rounds(executor) == [[("big", 0, 40)]]
    assert scheduler.stats.solo_rounds == 1 and scheduler.stats.split_ops == 0
    assert scheduler.state()["solo_round_token_budget"] == 1000


def test_a_solo_round_still_ends_at_its_own_budget():
    executor, futures = _ChunkExecutor(), _Futures()
    scheduler = _scheduler(
        futures, round_token_budget=100, solo_round_token_budget=250, solo_after_s=0.0
    )
    scheduler.register_model("big")
    scheduler.pause()
    scheduler.start(lambda: executor)
    try:
        scheduler.submit(_fb("B1", "lone", "big", 1, [10] * 60))
        scheduler.resume()
        futures.wait("B1")
    finally:
        scheduler.stop()
    rounds = _train_rounds(executor)
    assert [sum(stop - start for _, start, stop in batch) for batch in rounds] == [25, 25, 10]
    assert json.loads(futures.done["B1"].body)["ranges"] == [[0, 25], [25, 50], [50, 60]]


def test_another_tenants_queued_work_keeps_the_round_budget():
    executor, futures = _ChunkExecutor(), _Futures()
    scheduler = _scheduler(
        futures, round_token_budget=100, solo_round_token_budget=1000, solo_after_s=0.0
    )
    for model in ("big", "small"):
        scheduler.register_model(model)
    scheduler.pause()
    scheduler.start(lambda: executor)
    try:
        scheduler.submit(_fb("B1", "flooder", "big", 1, [10] * 40))
        scheduler.submit(_fb("S1", "small", "small", 1, [10]))
        scheduler.resume()
        futures.wait("B1", "S1")
    finally:
        scheduler.stop()
    rounds = _train_rounds(executor)
    # while the small tenant waited, rounds kept to 100 tokens; once it was served (and
    # solo_after_s is 0) the flooder, alone, ran the rest of its call in one round
    assert ("small", 0, 1) in rounds[0]
    assert sum((stop - start) * 10 for _, start, stop in rounds[0]) <= 100
    assert rounds[1] == [("big", rounds[0][0][2], 40)]


def test_a_tenant_seen_recently_keeps_the_round_budget():
    """A neighbour stepping in a loop has nothing queued between two steps: having been seen
    within solo_after_s keeps the rounds small, so a lone round never lands between its steps."""
    executor, futures = _ChunkExecutor(), _Futures()
    scheduler = _scheduler(
        futures,
        round_token_budget=100,
        solo_round_token_budget=1000,
        solo_after_s=3600.0,
        stepping_s=0.0,
    )
    for model in ("big", "small"):
        scheduler.register_model(model)
    scheduler.start(lambda: executor)
    try:
        scheduler.submit(_fb("S1", "small", "small", 1, [10]))
        futures.wait("S1")  # the neighbour's step is done: nothing of it is queued
        solo = scheduler.stats.solo_rounds  # its own round was a lone one
        scheduler.submit(_fb("B1", "flooder", "big", 1, [10] * 40))
        futures.wait("B1")
    finally:
        scheduler.stop()
    big_rounds = [b for b in _train_rounds(executor) if b and b[0][0] == "big"]
    assert len(big_rounds) == 4 and scheduler.stats.solo_rounds == solo


def test_while_a_neighbour_steps_a_lone_call_runs_a_quantum_a_round():
    """A neighbour stepping in a loop sends its next call as its last result arrives: a round
    that fills the budget from one tenant's backlog meanwhile is what its next call waits
    behind, so such rounds run one quantum (25 tokens here) until the neighbour stops."""
    executor, futures = _ChunkExecutor(), _Futures()
    scheduler = _scheduler(
        futures,
        round_token_budget=100,
        solo_round_token_budget=1000,
        solo_after_s=3600.0,
        stepping_s=3600.0,
    )
    for model in ("big", "small"):
        scheduler.register_model(model)
    scheduler.start(lambda: executor)
    try:
        scheduler.submit(_fb("B0", "flooder", "big", 1, [10] * 10))
        futures.wait("B0")  # nobody else has stepped yet (a solo round, here)
        scheduler.submit(_fb("S1", "small", "small", 1, [10]))
        futures.wait("S1")
        scheduler.submit(_fb("B1", "flooder", "big", 2, [10] * 40))
        futures.wait("B1")
    finally:
        scheduler.stop()
    big_rounds = [b for b in _train_rounds(executor) if b and b[0][0] == "big"]
    sizes = [sum(stop - start for _, start, stop in batch) for batch in big_rounds]
    assert sizes == [10] + [2] * 20  # 10 datums of 10 tokens, then 2 a round (25 tokens)
    # the flooder's rounds that left work behind (19: its last two datums fitted in a quantum);
    # the small tenant's own lone round (the flooder had just stepped) held nothing back either
    assert scheduler.stats.short_rounds == 19


def test_a_neighbour_gone_on_to_sampling_stops_counting_as_stepping():
    """An RL loop's optim_step is followed by a save and a sample, not by a training call: once
    it submits them, the other tenant's rounds are full again (the window is long here)."""
    executor, futures = _ChunkExecutor(), _Futures()
    scheduler = _scheduler(
        futures,
        round_token_budget=100,
        solo_round_token_budget=1000,
        solo_after_s=3600.0,
        stepping_s=3600.0,
    )
    for model in ("big", "rl"):
        scheduler.register_model(model)
    scheduler.start(lambda: executor)
    try:
        scheduler.submit(_fb("R1", "rl", "rl", 1, [10]))
        futures.wait("R1")
        scheduler.submit(job("R2", "save_sampler", "rl", model_id="rl", seq_id=2))
        futures.wait("R2")
        scheduler.submit(_fb("B1", "trainer", "big", 1, [10] * 40))
        futures.wait("B1")
    finally:
        scheduler.stop()
    big_rounds = [b for b in _train_rounds(executor) if b and b[0][0] == "big"]
    assert [sum(stop - start for _, start, stop in b) for b in big_rounds] == [10] * 4
    assert scheduler.stats.short_rounds == 0


def test_the_cli_default_stepping_window_is_the_configs():
    from lorafleet.cli import build_parser
    from lorafleet.server.config import ServerConfig
    from lorafleet.server.ops.scheduler import STEPPING_S

    args = ["serve", "--base-model", "tiny-qwen3", "--data-dir", "unused"]
    parser = build_parser()
    assert parser.parse_args(args).stepping_s == STEPPING_S
    assert ServerConfig("tiny-qwen3", Path("unused"), []).stepping_s == STEPPING_S
    assert parser.parse_args([*args, "--stepping-s", "0"]).stepping_s == 0.0


def test_a_bad_stepping_window_is_refused():
    with pytest.raises(ValueError, match="stepping_s"):
        _scheduler(_Futures(), round_token_budget=100, stepping_s=-1.0)


def test_a_bad_solo_budget_is_refused_and_zero_turns_it_off():
    with pytest.raises(ValueError, match="solo_round_token_budget"):
        _scheduler(_Futures(), round_token_budget=100, solo_round_token_budget=-1)
    with pytest.raises(ValueError, match="solo_after_s"):
        _scheduler(_Futures(), round_token_budget=100, solo_after_s=float("nan"))
    off = _scheduler(_Futures(), round_token_budget=100, solo_round_token_budget=0)
    assert off.solo_round_token_budget == 100  # never below the round budget


def test_the_cli_default_solo_budget_is_the_configs():
    from lorafleet.cli import build_parser
    from lorafleet.server.config import ServerConfig
    from lorafleet.server.ops.scheduler import DEFAULT_SOLO_ROUND_TOKENS

    args = ["serve", "--base-model", "tiny-qwen3", "--data-dir", "unused"]
    parser = build_parser()
    assert parser.parse_args(args).solo_round_token_budget == DEFAULT_SOLO_ROUND_TOKENS
    assert (
        ServerConfig("tiny-qwen3", Path("unused"), []).solo_round_token_budget
        == DEFAULT_SOLO_ROUND_TOKENS
    )
    assert parser.parse_args([*args, "--solo-round-token-budget", "0"]).solo_round_token_budget == 0
    with pytest.raises(SystemExit):
        parser.parse_args([*args, "--solo-round-token-budget", "-5"])


class _SamplingExecutor(_ChunkExecutor):
    """A sample that stays in the sampler's batch until the first training batch has run."""

    def __init__(self):
        super().__init__()
        from concurrent.futures import Future

        self.sample: Future = Future()

    def start_sample(self, ops):
        from lorafleet.server.ops.scheduler import PendingSample

        return [PendingSample(self.sample, lambda result: Result.json({})) for _ in ops]

    def run_train(self, chunks):
        out = super().run_train(chunks)
        if not self.sample.done():
            self.sample.set_result(None)
        return out

    def step_sampler(self):
        return True


def test_a_neighbour_sampling_keeps_the_round_budget():
    executor, futures = _SamplingExecutor(), _Futures()
    scheduler = _scheduler(
        futures, round_token_budget=100, solo_round_token_budget=1000, solo_after_s=0.0
    )
    scheduler.register_model("big")
    scheduler.start(lambda: executor)
    try:
        scheduler.submit(job("S", "sample", "sampler"))
        deadline = time.monotonic() + 10
        while not scheduler._sampling:  # until the sample is in the sampler's batch
            assert time.monotonic() < deadline, "the sample never reached the sampler"
            time.sleep(0.01)
        scheduler.submit(_fb("B1", "lone", "big", 1, [10] * 40))
        futures.wait("B1", "S")
    finally:
        scheduler.stop()
    rounds = _train_rounds(executor)
    assert rounds[0] == [("big", 0, 10)]  # the sampling neighbour was present: 100 tokens
    assert rounds[1] == [("big", 10, 40)]  # its sample done (solo_after_s 0): one lone round


def test_datum_costs_match_a_pairwise_comparison_of_every_window():
    """The fast path (numpy, only datums that start alike compared) counts what comparing
    each datum with each of its window's datums token by token counts."""
    import random

    import torch

    from lorafleet.server.ops.fair_share import SHARING_WINDOW, datum_costs

    def reference(rows: list[list[int]]) -> list[int]:
        out = []
        for i, row in enumerate(rows):
            shared = 0
            for other in rows[max(0, i - SHARING_WINDOW) : i]:
                n = 0
                while n < min(len(row), len(other)) and row[n] == other[n]:
                    n += 1
                shared = max(shared, n)
            out.append(max(1, len(row) - shared))
        return out

    rng = random.Random(0)
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(0, 6))] for _ in range(4)]
    rows = [
        rng.choice(prompts) + [rng.randrange(3) for _ in range(rng.randrange(0, 8))]
        for _ in range(200)
    ]
    tokens = [torch.tensor(r, dtype=torch.int64) for r in rows]
    assert datum_costs(tokens) == reference(rows)


def test_a_round_ends_with_the_cycle_in_which_a_stepping_tenant_got_all_its_work_in():
    """A flooder's backlog beside two tenants stepping one small call at a time: the round
    ends after one turn each (the flooder's quantum and their calls), not once the flooder's
    tokens fill the budget, so their results come back after a short round. Backlogged
    tenants alone still fill rounds, and the flooder's share over rounds is unchanged."""
    drr = DeficitRoundRobin(quantum=128, weight_of=lambda t: 1.0)
    flood = Work("F", "mf", 0, (16,) * 1000)
    ready = {
        "flood": [flood],
        "s1": [Work("s1-op", "m1", 0, (16,))],
        "s2": [Work("s2-op", "m2", 0, (16,))],
    }
    takes = drr.plan(ready, 512)
    assert {t.key: t.tokens for t in takes} == {"F": 128, "s1-op": 16, "s2-op": 16}
    # the stepping tenants wait on their results: the flooder alone fills the next round
    alone = drr.plan({"flood": [Work("F", "mf", 8, flood.sizes)]}, 512)
    assert [(t.key, t.tokens) for t in alone] == [("F", 512)]
    # backlogged tenants only: nobody's work runs out, rounds fill as before
    both = {t: [Work(f"{t}-op", f"{t}-m", 0, (16,) * 1000)] for t in ("a", "b")}
    assert sum(t.tokens for t in drr.plan(both, 512)) == 512
