"""The CUDA-graph bucket planner on the CPU: buckets, padding, eager fallbacks, the static
routing tables, and rows joining and leaving between steps. (Replay itself: tests/test_cuda.py;
the fused kernel reading a refilled static routing: tests/model/test_triton_lora.py.)"""

from __future__ import annotations

import pytest
import torch

from lorafleet.engines import colocate
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.kernels import triton_available
from lorafleet.model.routing import BASE_SLOT
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample import SampleRequest, SamplingParams, cuda_graphs
from lorafleet.sample.cuda_graphs import (
    EAGER_ADDITIVE_MASK,
    EAGER_KERNEL,
    EAGER_PREFILL,
    EAGER_TOO_MANY_ROWS,
    BucketPlanner,
    DecodeGraphs,
    StaticStep,
    bucket_sizes,
    pad_step,
)
from tests._models import tiny_qwen3
from tests.model.test_triton_lora import fused  # noqa: F401 - the interpreter fixture


def test_bucket_sizes():
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(6) == (1, 2, 4, 6)
    assert bucket_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert bucket_sizes(34) == (1, 2, 4, 8, 16, 24, 32, 34)
    assert bucket_sizes(40, step=16) == (1, 2, 4, 16, 32, 40)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_rows must be a positive integer"):
            bucket_sizes(bad)  # type: ignore[arg-type]


def test_each_row_count_maps_to_the_smallest_bucket_that_holds_it():
    planner = BucketPlanner(34)
    expected = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 17: 24, 25: 32, 33: 34, 34: 34}
    assert {rows: planner.bucket_for(rows) for rows in expected} == expected
    assert planner.bucket_for(35) is None
    for rows in range(1, 35):
        plan = planner.plan(rows, 1)
        assert plan.bucket is not None and plan.reason is None
        assert plan.bucket >= rows and plan.padding == plan.bucket - rows
        # No smaller bucket would do.
        assert all(b < rows for b in planner.buckets if b < plan.bucket)
    with pytest.raises(ValueError, match="rows must be >= 1"):
        planner.bucket_for(0)


def test_eager_fallbacks_say_why():
    planner = BucketPlanner(16)
    assert planner.plan(4, 7) == planner.plan(4, 7)
    assert planner.plan(4, 7).reason == EAGER_PREFILL
    assert planner.plan(17, 1).reason == EAGER_TOO_MANY_ROWS
    assert planner.plan(4, 1, fused=False).reason == EAGER_KERNEL
    assert planner.plan(4, 1, additive_mask=True).reason == EAGER_ADDITIVE_MASK
    for reason in (planner.plan(4, 7), planner.plan(17, 1), planner.plan(3, 1, fused=False)):
        assert reason.bucket is None and reason.padding == 0


def test_custom_buckets_are_checked_against_the_pool():
    assert BucketPlanner(16, [8, 1, 16, 8]).buckets == (1, 8, 16)
    with pytest.raises(ValueError, match="larger than the row pool"):
        BucketPlanner(16, [1, 32])
    with pytest.raises(ValueError, match="positive integers"):
        BucketPlanner(16, [0, 4])
    with pytest.raises(ValueError, match="positive integers"):
        BucketPlanner(16, [])


def test_pad_step_pads_with_base_rows_and_builds_fixed_size_routing_tables():
    scales = [0.0, 0.5, 2.0, 1.0, 4.0]  # 5 slots: the table always has 4 rows
    step = pad_step([11, 12, 13, 14, 15], [7, 3, 9, 1, 4], [3, 0, 1, 3, 1], scales, bucket=8)
    assert step.tokens == [11, 12, 13, 14, 15, 0, 0, 0]
    assert step.starts == [7, 3, 9, 1, 4, 0, 0, 0]
    # Routed rows sorted by slot (row order kept within a slot); base row 1 and padding absent.
    assert step.order[:4] == [2, 4, 0, 3]
    assert step.segments == [(1, 0, 2), (2, 2, 2), (3, 2, 4), (4, 4, 4)]
    assert step.scales == [0.5, 0.5, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert len(step.order) == len(step.scales) == 8

    everyone_base = pad_step([1, 2], [0, 5], [BASE_SLOT, BASE_SLOT], scales, bucket=2)
    assert all(start == end for _, start, end in everyone_base.segments)
    assert len(everyone_base.segments) == 4

    with pytest.raises(ValueError, match="do not fit bucket"):
        pad_step([1, 2, 3], [0, 0, 0], [1, 1, 1], scales, bucket=2)
    with pytest.raises(ValueError, match="slot 5 is outside"):
        pad_step([1], [0], [5], scales, bucket=1)
    with pytest.raises(ValueError, match="one entry per row"):
        pad_step([1, 2], [0], [1, 1], scales, bucket=2)


def test_rows_joining_and_leaving_between_steps_move_between_buckets():
    """A continuous batch over 12 steps: the running rows (compacted to 0..n-1) change every
    step; each step's plan holds exactly its rows, the tables always have the same shapes
    (what lets one capture per bucket serve every step), and only the bucket changes."""
    planner = BucketPlanner(24)
    scales = [0.0, 1.0, 0.5, 2.0]
    running: list[int] = []  # slot per running row
    gen = torch.Generator().manual_seed(0)
    seen_buckets = set()
    shapes = set()
    for step in range(12):
        joins = int(torch.randint(0, 6, (1,), generator=gen))
        leaves = min(len(running), int(torch.randint(0, 4, (1,), generator=gen)))
        for _ in range(leaves):  # a finished row takes the last row's place (engine._retire)
            row = int(torch.randint(0, len(running), (1,), generator=gen))
            running[row] = running[-1]
            running.pop()
        running.extend(int(s) for s in torch.randint(0, 4, (joins,), generator=gen))
        if not running:
            continue
        plan = planner.plan(len(running), 1)
        assert plan.bucket is not None
        seen_buckets.add(plan.bucket)
        inputs = pad_step(
            list(range(len(running))), [step] * len(running), running, scales, plan.bucket
        )
        routed = [row for row, slot in enumerate(running) if slot != BASE_SLOT]
        assert sorted(inputs.order[: len(routed)]) == routed
        for slot, start, end in inputs.segments:
            assert [running[r] for r in inputs.order[start:end]] == [slot] * (end - start)
        shapes.add((len(inputs.segments), len(inputs.order) - plan.bucket))
    assert shapes == {(3, 0)}
    assert len(seen_buckets) >= 3


def test_static_step_buffers_take_a_new_routing_in_place():
    step = StaticStep(4, num_slots=3, bank="sample", device=torch.device("cpu"))
    pointers = [t.data_ptr() for t in (step.order, step.segments, step.scales, step.tokens)]
    for slots in ([1, 2, 0, 1], [2, 2, 2, 2], [0, 0, 0, 0]):
        step.fill(pad_step([5, 6, 7, 8], [1, 2, 3, 4], slots, [0.0, 0.5, 3.0], 4))
        assert [t.data_ptr() for t in (step.order, step.segments, step.scales, step.tokens)] == (
            pointers
        )
    assert step.routing.order is step.order and step.routing.segments is step.segments
    assert step.routing.device_segments is step.segments
    assert step.routing.num_tokens == 4 and step.routing.num_active == 4
    assert max(step.routing.counts) == 4


def test_graphs_refuse_a_cpu_sampler():
    class CpuEngine:
        device = torch.device("cpu")

    with pytest.raises(ValueError, match="need a CUDA sampler"):
        DecodeGraphs(CpuEngine())  # type: ignore[arg-type]


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.usefixtures("fused")
def test_the_static_decode_step_equals_the_eager_one_on_the_cpu():
    """Everything a captured step does but the capture, on the CPU (the fused kernel through
    Triton's interpreter): padded buckets, the static routing, attention over the whole cache
    capacity. Rows join and leave (3 rows for 5 requests of different lengths, mixed adapters
    and the base, greedy and seeded): tokens equal the eager engine's, log-probs to fp32
    rounding."""
    model = tiny_qwen3(seed=0, layers=1)  # one layer: the interpreter runs every program
    stack = colocate(
        model,
        resolve_tinker_targets(model),
        base_model_id="tiny",
        r_max=8,
        sample_slots=3,
        max_rows=3,
        kernel="triton",
    )
    keys = []
    for i in range(2):
        slot = stack.trainer.create_adapter(AdapterSpec(rank=4 + 4 * i, alpha=8.0, seed=i))
        gen = torch.Generator().manual_seed(50 + i)
        weights = {
            path: (A, 0.3 * torch.randn(B.shape, generator=gen))
            for path, (A, B) in stack.trainer.bank.slot_weights(slot).items()
        }
        stack.trainer.bank.load_slot_weights(slot, weights)
        keys.append(stack.versions.publish(f"a{i}", stack.trainer.bank, slot))
    adapters = [keys[0], keys[1], None]
    requests = [
        SampleRequest(
            torch.randint(0, 96, (2 + i,), generator=torch.Generator().manual_seed(i)).tolist(),
            SamplingParams(
                max_tokens=2 + (3 * i) % 4, temperature=0.0 if i % 2 else 0.8, seed=i, stop=[]
            ),
            adapter=adapters[i % 3],
        )
        for i in range(5)
    ]
    sampler = stack.sampler
    eager = sampler.generate(requests)
    graphs = cuda_graphs.enable(sampler, capture=False)
    try:
        static = sampler.generate(requests)
    finally:
        sampler.decode_graphs = None
    assert graphs.fused and graphs.replays > 0 and not graphs.eager_steps
    assert len(graphs.static) >= 2  # rows left and joined: more than one bucket ran
    for a, b in zip(eager, static, strict=True):
        assert a.ok and b.ok, (a.error, b.error)
        assert [s.tokens for s in b.sequences] == [s.tokens for s in a.sequences]
        torch.testing.assert_close(
            torch.tensor(b.sequences[0].logprobs),
            torch.tensor(a.sequences[0].logprobs),
            atol=1e-4,
            rtol=0,
        )


# ----------------------------------------------------------------- start-up check, fallback


class EagerRunner(DecodeGraphs):
    """A graph runner that replays nothing: it computes each step eagerly (what a correct
    replay gives), then `tamper`s with the logits, or raises on call `fail_at`, as a broken
    capture or replay would."""

    def __init__(self, engine, *, tamper=None, fail_at=None):
        super().__init__(engine, capture=False)
        self.fused = True  # (the seam: whatever the layers run)
        self.tamper, self.fail_at, self.calls = tamper, fail_at, 0

    def decode(self, tokens, starts, slots):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        n, device = len(starts), self.engine.device
        logits = self.engine._forward(
            slice(0, n),
            torch.tensor(tokens, device=device).view(n, 1),
            torch.tensor(starts, device=device),
            torch.tensor(slots, device=device),
            torch.arange(n, device=device),
            torch.zeros(n, dtype=torch.int64, device=device),
        )
        self.replays += 1
        return logits if self.tamper is None else self.tamper(logits)


def _graph_stack(kernel: str = "auto"):
    model = tiny_qwen3(seed=0, layers=1)
    return colocate(
        model,
        resolve_tinker_targets(model),
        base_model_id="tiny",
        r_max=8,
        sample_slots=3,
        max_rows=3,
        kernel=kernel,  # type: ignore[arg-type]
        decode_graphs=False,
    )


def _requests(stack, count: int = 5):
    slot = stack.trainer.create_adapter(AdapterSpec(rank=4, alpha=8.0, seed=1))
    gen = torch.Generator().manual_seed(9)
    stack.trainer.bank.load_slot_weights(
        slot,
        {
            path: (A, 0.3 * torch.randn(B.shape, generator=gen))
            for path, (A, B) in stack.trainer.bank.slot_weights(slot).items()
        },
    )
    key = stack.versions.publish("a", stack.trainer.bank, slot)
    return [
        SampleRequest(
            torch.randint(0, 96, (3 + i,), generator=torch.Generator().manual_seed(i)).tolist(),
            SamplingParams(
                max_tokens=3 + i % 3, temperature=0.0 if i % 2 else 0.9, seed=i, stop=[]
            ),
            adapter=key if i % 2 else None,
        )
        for i in range(count)
    ]


def test_on_the_cpu_graphs_stay_off_saying_why():
    stack = _graph_stack()
    state = cuda_graphs.prove_decode_graphs(stack.sampler)
    assert not state.enabled and "CUDA graphs need CUDA" in state.reason
    assert stack.sampler.decode_graphs is None
    unfused = cuda_graphs.prove_decode_graphs(
        stack.sampler, graphs_factory=lambda e: DecodeGraphs(e, capture=False)
    )
    assert not unfused.enabled and EAGER_KERNEL in unfused.reason
    assert stack.sampler.decode_graph_stats()["reason"] == unfused.reason


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.usefixtures("fused")
def test_the_start_up_check_turns_the_static_step_on_when_it_equals_eager():
    """The real static step (the fused kernel through the interpreter), checked as at start-up
    on CUDA; decode then replays it, and generation equals the eager engine's."""
    stack = _graph_stack("triton")
    sampler = stack.sampler
    free = sampler.bank.free_slots()
    requests = _requests(stack)
    eager = sampler.generate(requests)
    state = cuda_graphs.prove_decode_graphs(
        sampler, graphs_factory=lambda e: DecodeGraphs(e, capture=False)
    )
    assert state.enabled and state.checked and state.max_logprob_diff is not None
    assert state.max_logprob_diff <= 1e-4
    assert sampler.bank.free_slots() == free[1:]  # (only the published version holds a slot)
    replayed = sampler.generate(requests)
    stats = sampler.decode_graph_stats()
    assert stats["enabled"] and stats["counters"]["replays"] > 0
    for a, b in zip(eager, replayed, strict=True):
        assert a.ok and b.ok and [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]


def _shifted(logits: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    out[:, 0] += 0.5
    return out


@pytest.mark.parametrize(
    "runner,why",
    [
        (lambda e: EagerRunner(e, tamper=_shifted), "replayed log-probs differ from eager"),
        (lambda e: EagerRunner(e, fail_at=1), "operation not permitted when stream is capturing"),
        (lambda e: EagerRunner(e, tamper=lambda x: x * float("nan")), "differ from eager by nan"),
    ],
    ids=["differs", "capture-raises", "nan"],
)
def test_a_failed_start_up_check_keeps_decode_eager_and_says_why(runner, why, caplog):
    stack = _graph_stack()
    sampler = stack.sampler
    free = sampler.bank.free_slots()
    with caplog.at_level("WARNING", logger="lorafleet.sample.cuda_graphs"):
        state = cuda_graphs.prove_decode_graphs(sampler, graphs_factory=runner)
    assert not state.enabled and state.checked and why in state.reason, state.reason
    assert sampler.decode_graphs is None
    assert sampler.bank.free_slots() == free  # the check's adapter is gone again
    assert len([r for r in caplog.records if "decode runs eagerly" in r.getMessage()]) == 1
    assert all(r.ok for r in sampler.generate(_requests(stack)))


def test_a_replay_that_fails_while_serving_falls_back_to_eager_without_failing_requests(caplog):
    stack = _graph_stack()
    sampler = stack.sampler
    requests = _requests(stack)
    eager = sampler.generate(requests)
    state = cuda_graphs.prove_decode_graphs(
        sampler,
        graphs_factory=lambda e: EagerRunner(e, fail_at=4),  # 2 in the check, then 2 steps
    )
    assert state.enabled
    with caplog.at_level("WARNING", logger="lorafleet.sample.cuda_graphs"):
        served = sampler.generate(requests)
    for a, b in zip(eager, served, strict=True):
        assert b.ok and [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    stats = sampler.decode_graph_stats()
    assert not stats["enabled"] and stats["fallbacks"] == 1
    assert (
        "failed while serving" in stats["reason"] and "stream is capturing" in stats["last_error"]
    )
    assert sampler.decode_graphs is None
    assert len([r for r in caplog.records if "turned off" in r.getMessage()]) == 1
