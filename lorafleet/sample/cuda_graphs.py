"""Decode steps replayed from CUDA graphs: the bucket planner and the capture/replay runner.

A decode step on a GPU is bound by kernel launches (tens of small kernels per layer for a
batch of a few hundred tokens), so the sampler captures the step once per batch-size bucket
and replays it. What makes that possible with continuous batching and mixed adapters:

- Buckets. A step's n running rows (always rows 0..n-1: the engine compacts its pool) run as
  the smallest bucket >= n (1, 2, 4, then multiples of 8 up to the pool's rows, as vLLM does);
  rows n..bucket-1 are padding: token 0 at position 0, routed to the base slot, their logits
  dropped. Their KV writes land in free rows at column 0, which the next occupant's prefill
  overwrites before its mask ever shows it. Rows joining and leaving between steps only move a
  step to another bucket.
- Routing as a static input. The routing of a step (which slot each row uses) lives in
  per-bucket device buffers that the host refills before each replay: `order` (the routed
  rows, slot-sorted), a segment table with one (slot, start, end) row per sampler slot (an
  absent slot's segment is empty) and each routed row's scale. The fused Triton kernel reads
  its plan from those buffers with a fixed launch grid (triton_lora.py), so a routing change,
  however large, needs no new capture.
- The KV cache. The graph attends over all `capacity` columns of rows 0..bucket-1 with a mask
  computed in the graph from the step's start columns; a row cache that grows (its buffers
  move) drops every graph, which are captured again at the new capacity.

Eager steps: a prefill (many tokens per row), more rows than the largest bucket, a model whose
layers do not all run the fused kernel (MoE experts, kernel `grouped`/`loop`, no triton), or
eager attention with an additive mask. `StepPlan.reason` says which, and the runner counts them.

Proven at start-up, never trusted blind. On CUDA the engines turn replay on
(`prove_decode_graphs`) only after capturing a bucket and checking that replay equals the
eager step: the same log-probs (within the dtype's same-implementation canary tolerance) and
the same greedy tokens, for a mixed batch (a temporary adapter and the base) with a padding
row, and again after the routing changed under the captured graph. A failed capture or check leaves decode eager, with one log
line and the reason in `SampleEngine.graph_state` (the server's stats). Buckets met later are
captured on first use while serving; should one of those captures (or a replay) raise, the
engine runs that step eagerly, turns replay off and records why (`SampleEngine._decode`):
never a failed request. The planner, the check and the fallback run on the CPU through the
static step without capture (`capture=False`, the fused kernel under Triton's interpreter)
and with injected failures (tests/sample/test_cuda_graph_plan.py); the capture itself on a
GPU (tests/test_cuda.py).
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lorafleet.canary import tolerance_for
from lorafleet.model.banks import AdapterSpec, LoRALinear
from lorafleet.model.routing import BASE_SLOT, Routing
from lorafleet.sample.kvcache import ForwardPlan, RowCache

if TYPE_CHECKING:
    from lorafleet.sample.engine import SampleEngine

log = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4)
BUCKET_STEP = 8

EAGER_PREFILL = "prefill"
EAGER_TOO_MANY_ROWS = "more rows than the largest bucket"
EAGER_KERNEL = "a layer does not run the fused Triton kernel"
EAGER_ADDITIVE_MASK = "eager attention (additive mask)"


def bucket_sizes(max_rows: int, *, step: int = BUCKET_STEP) -> tuple[int, ...]:
    """1, 2, 4, then multiples of `step`, and `max_rows` itself, none above `max_rows`."""
    if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1:
        raise ValueError(f"max_rows must be a positive integer, got {max_rows!r}")
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"step must be a positive integer, got {step!r}")
    sizes = {b for b in SMALL_BUCKETS if b <= max_rows}
    sizes.update(range(step, max_rows + 1, step))
    sizes.add(max_rows)
    return tuple(sorted(sizes))


@dataclass(frozen=True)
class StepPlan:
    """How one forward runs: replayed at `bucket` rows, or eager (`bucket` None, `reason`)."""

    rows: int
    bucket: int | None
    reason: str | None = None

    @property
    def padding(self) -> int:
        return 0 if self.bucket is None else self.bucket - self.rows


class BucketPlanner:
    """Which bucket a step runs in, or why it runs eagerly. Pure: no device, no model."""

    def __init__(self, max_rows: int, buckets: Sequence[int] | None = None):
        sizes = bucket_sizes(max_rows) if buckets is None else tuple(sorted(set(buckets)))
        bad = [b for b in sizes if isinstance(b, bool) or not isinstance(b, int) or b < 1]
        if bad or not sizes:
            raise ValueError(f"buckets must be positive integers, got {list(buckets or [])!r}")
        if sizes[-1] > max_rows:
            raise ValueError(
                f"bucket {sizes[-1]} is larger than the row pool ({max_rows} rows): its padding "
                "rows would have no cache row"
            )
        self.max_rows = max_rows
        self.buckets = sizes

    def bucket_for(self, rows: int) -> int | None:
        """The smallest bucket holding `rows` rows; None past the largest."""
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        index = bisect.bisect_left(self.buckets, rows)
        return self.buckets[index] if index < len(self.buckets) else None

    def plan(
        self, rows: int, tokens_per_row: int, *, fused: bool = True, additive_mask: bool = False
    ) -> StepPlan:
        if tokens_per_row != 1:
            return StepPlan(rows, None, EAGER_PREFILL)
        if not fused:
            return StepPlan(rows, None, EAGER_KERNEL)
        if additive_mask:
            return StepPlan(rows, None, EAGER_ADDITIVE_MASK)
        bucket = self.bucket_for(rows)
        if bucket is None:
            return StepPlan(rows, None, EAGER_TOO_MANY_ROWS)
        return StepPlan(rows, bucket)


@dataclass(frozen=True)
class StepInputs:
    """One decode step's host-side inputs, padded to its bucket."""

    tokens: list[int]  # [bucket]
    starts: list[int]  # [bucket], the column each row's token is written at
    order: list[int]  # [bucket], routed rows first (slot-sorted), then 0s (never read)
    segments: list[tuple[int, int, int]]  # [num_slots - 1]: (slot, start, end) per slot 1..
    scales: list[float]  # [bucket], each routed row's scale, then 0s


def pad_step(
    tokens: Sequence[int],
    starts: Sequence[int],
    slots: Sequence[int],
    slot_scales: Sequence[float],
    bucket: int,
) -> StepInputs:
    """The step's rows padded to `bucket` (padding: token 0, column 0, base slot) and its
    routing as the fixed-size tables a captured graph reads."""
    n = len(tokens)
    if not len(starts) == len(slots) == n:
        raise ValueError(
            f"tokens, starts and slots must have one entry per row, got {n}, {len(starts)} "
            f"and {len(slots)}"
        )
    if n > bucket:
        raise ValueError(f"{n} rows do not fit bucket {bucket}")
    num_slots = len(slot_scales)
    bad = [s for s in slots if not 0 <= s < num_slots]
    if bad:
        raise ValueError(f"slot {bad[0]} is outside the bank's slots [0, {num_slots})")
    pad = bucket - n
    routed = sorted((slot, row) for row, slot in enumerate(slots) if slot != BASE_SLOT)
    order = [row for _, row in routed]
    counts = Counter(slot for slot, _ in routed)
    segments = []
    start = 0
    for slot in range(1, num_slots):
        segments.append((slot, start, start + counts[slot]))
        start += counts[slot]
    return StepInputs(
        tokens=list(tokens) + [0] * pad,
        starts=list(starts) + [0] * pad,
        order=order + [0] * (bucket - len(order)),
        segments=segments,
        scales=[float(slot_scales[slot]) for slot, _ in routed] + [0.0] * (bucket - len(order)),
    )


class StaticStep:
    """One bucket's device buffers and the `Routing` that points at them."""

    def __init__(self, bucket: int, num_slots: int, bank: str, device: torch.device):
        self.bucket = bucket
        self.tokens = torch.zeros(bucket, 1, dtype=torch.int64, device=device)
        self.starts = torch.zeros(bucket, dtype=torch.int64, device=device)
        self.order = torch.zeros(bucket, dtype=torch.int64, device=device)
        self.segments = torch.zeros(max(num_slots - 1, 0), 3, dtype=torch.int64, device=device)
        self.scales = torch.zeros(bucket, 1, dtype=torch.float32, device=device)
        # Fields a layer reads as Python values are fixed at capture: every row may be routed
        # (num_active), and no segment is longer than the bucket (counts bounds the launch).
        self.routing = Routing(
            bank=bank,
            num_tokens=bucket,
            num_slots=num_slots,
            order=self.order,
            offsets=torch.zeros(max(num_slots - 1, 0), dtype=torch.int32, device=device),
            counts=(bucket,) + (0,) * max(num_slots - 2, 0),
            token_scale=self.scales,
            num_active=bucket,
            segments=self.segments,
        )
        self.logits: torch.Tensor | None = None

    def fill(self, inputs: StepInputs) -> None:
        """Host values into the buffers (the only per-step work besides the replay)."""
        self.tokens.copy_(torch.tensor(inputs.tokens, dtype=torch.int64).view(-1, 1))
        self.starts.copy_(torch.tensor(inputs.starts, dtype=torch.int64))
        self.order.copy_(torch.tensor(inputs.order, dtype=torch.int64))
        self.segments.copy_(torch.tensor(inputs.segments, dtype=torch.int64).view(-1, 3))
        self.scales.copy_(torch.tensor(inputs.scales, dtype=torch.float32).view(-1, 1))


def fused_everywhere(engine: SampleEngine) -> bool:
    """Whether every adapted layer of the engine runs the fused kernel on its device (only
    then is a captured routing valid for any later step)."""
    from lorafleet.model.kernels import triton_available

    layers = engine.adapted.layers.values()
    kernels = {layer.kernel for layer in layers}
    if not triton_available() or not kernels <= {"auto", "triton"}:
        return False
    if engine.device.type != "cuda":
        # Off CUDA, only an explicit `triton` under Triton's interpreter (the CPU tests).
        from lorafleet.model.triton_lora import can_run_on

        if kernels != {"triton"} or not can_run_on(engine.device):
            return False
    return (
        all(isinstance(layer, LoRALinear) for layer in layers)
        and engine.bank.params.dtype == torch.float32
        and engine.dtype in (torch.float32, torch.bfloat16)
    )


class DecodeGraphs:
    """Captures the engine's decode step per (bucket, cache capacity) and replays it.

    `decode` returns the step's fp32 logits [rows, vocab], or None when the step must run
    eagerly (the engine then runs it as usual); `eager_steps` counts why.

    `capture=False` runs the same static step (padded bucket, static routing, attention over
    the whole capacity) without capturing it: how the CPU tests check everything but the
    capture itself against the eager path."""

    def __init__(
        self, engine: SampleEngine, planner: BucketPlanner | None = None, *, capture: bool = True
    ):
        if capture and engine.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA sampler, this one runs on {engine.device}")
        self.capture = capture
        pool_rows = engine.cache.num_rows
        self.engine = engine
        self.planner = planner or BucketPlanner(pool_rows)
        if self.planner.max_rows > pool_rows:
            raise ValueError(
                f"the planner's buckets go to {self.planner.max_rows} rows, the row cache has "
                f"{pool_rows}"
            )
        self.fused = fused_everywhere(engine)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, StaticStep]] = {}
        self.static: dict[int, StaticStep] = {}  # capture=False: one static step per bucket
        self.captures = 0
        self.replays = 0
        self.eager_steps: Counter[str] = Counter()
        self._capacity = -1
        self._buffers: tuple[int, ...] = ()
        self._pool: Any = None

    def decode(
        self, tokens: Sequence[int], starts: Sequence[int], slots: Sequence[int | None]
    ) -> torch.Tensor | None:
        """One decode step of rows 0..n-1 (one new token each): their last tokens, the
        column each is written at, and their sampler slots (pinned: never None)."""
        engine = self.engine
        n = len(starts)
        pinned = [slot for slot in slots if slot is not None]
        if len(pinned) != len(slots):
            raise ValueError("a running row has no pinned sampler slot")
        plan = self.planner.plan(n, 1, fused=self.fused, additive_mask=engine._additive_mask)
        if plan.bucket is None:
            assert plan.reason is not None
            self.eager_steps[plan.reason] += 1
            return None
        cache = engine.cache
        cache.reserve(max(starts) + 1)
        buffers = _buffers_key(cache)
        if buffers != self._buffers:
            # The KV buffers grew or were released and re-allocated: every graph points at
            # the old ones.
            self.graphs.clear()
            self._buffers = buffers
            self._capacity = cache.capacity
        inputs = pad_step(tokens, starts, pinned, engine.bank.scales.tolist(), plan.bucket)
        if not self.capture:
            step = self.static.get(plan.bucket)
            if step is None:
                step = StaticStep(
                    plan.bucket, engine.bank.num_slots, engine.bank.name, engine.device
                )
                self.static[plan.bucket] = step
            step.fill(inputs)
            self._body(step)
            self.replays += 1
            assert step.logits is not None
            return step.logits[:n].clone()
        key = (plan.bucket, cache.capacity)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(plan.bucket, inputs)
            self.graphs[key] = entry
        else:
            entry[1].fill(inputs)
            entry[0].replay()
            self.replays += 1
        logits = entry[1].logits
        assert logits is not None
        return logits[:n].clone()

    def _capture(self, bucket: int, inputs: StepInputs) -> tuple[torch.cuda.CUDAGraph, StaticStep]:
        """Warm-up on a side stream, then capture. Both run the step for real with this step's
        inputs: the KV they write is what the replay would write, so nothing runs twice."""
        engine = self.engine
        step = StaticStep(bucket, engine.bank.num_slots, engine.bank.name, engine.device)
        step.fill(inputs)
        stream = torch.cuda.Stream(engine.device)
        stream.wait_stream(torch.cuda.current_stream(engine.device))
        with torch.cuda.stream(stream):
            self._body(step)
        torch.cuda.current_stream(engine.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's other threads (HTTP, metering) may touch CUDA meanwhile;
        # "global" would make any such call an error inside this capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._body(step)
        self._pool = graph.pool()
        graph.replay()
        self.captures += 1
        log.info("captured a decode graph for %d rows at capacity %d", bucket, self._capacity)
        return graph, step

    def _body(self, step: StaticStep) -> None:
        engine = self.engine
        cache = engine.cache
        capacity = cache.capacity
        bucket = step.bucket
        columns = torch.arange(capacity, device=engine.device)
        mask = (columns.view(1, capacity) <= step.starts.view(bucket, 1)).view(
            bucket, 1, 1, capacity
        )
        cache.current = ForwardPlan(
            rows=slice(0, bucket),
            starts=step.starts,
            q=1,
            uniform_start=None,
            kv_len=capacity,
            starts_list=[],
        )
        try:
            with engine.adapted.scope.use(step.routing):
                hidden = engine.decoder(
                    input_ids=step.tokens,
                    attention_mask=mask,
                    position_ids=step.starts.view(bucket, 1),
                    cache=cache,
                    use_cache=True,
                ).last_hidden_state
                step.logits = engine.lm_head(hidden[:, 0]).float()
        finally:
            cache.finish()


def _buffers_key(cache: RowCache) -> tuple[int, ...]:
    """Where the cache's KV buffers are now (the capacity and the first layer's addresses)."""
    layer = cache.layers[0] if cache.layers else None
    keys = getattr(layer, "keys", None)
    values = getattr(layer, "values", None)
    if keys is None or values is None:
        return (cache.capacity,)
    return (cache.capacity, keys.data_ptr(), values.data_ptr())


def enable(
    engine: SampleEngine, planner: BucketPlanner | None = None, *, capture: bool = True
) -> DecodeGraphs:
    """Turns graph replay on for the engine's decode steps (CUDA only; see DecodeGraphs for
    `capture=False`)."""
    graphs = DecodeGraphs(engine, planner, capture=capture)
    engine.decode_graphs = graphs
    engine.graph_state = GraphState(enabled=True, reason="on: enabled without a start-up check")
    return graphs


# --------------------------------------------------------------------------- start-up proof


@dataclass
class GraphState:
    """Whether decode steps replay from CUDA graphs, and why (the server's stats)."""

    enabled: bool = False
    reason: str = "off: not enabled"
    checked: bool = False  # the start-up check ran (and passed, when enabled)
    max_logprob_diff: float | None = None  # replay vs eager in the check
    fallbacks: int = 0  # steps that fell back to eager because replay or a capture raised
    last_error: str | None = None
    counters: dict[str, object] = field(default_factory=dict)

    def record(self, graphs: DecodeGraphs | None = None) -> dict[str, object]:
        out = asdict(self)
        if graphs is not None:
            out["counters"] = {
                "captures": graphs.captures,
                "replays": graphs.replays,
                "eager_steps": dict(graphs.eager_steps),
                "graphs": len(graphs.graphs),
            }
        return out


class GraphCheckFailed(RuntimeError):
    """Replay does not reproduce the eager step."""


GraphsFactory = Callable[["SampleEngine"], DecodeGraphs]
"""How `prove_decode_graphs` builds the runner it checks (a seam: tests inject failures)."""

_CHECK_PROMPTS = ((5, 11, 17, 23, 29), (7, 13), (19, 3, 31, 2))
_CHECK_RANK = 4


def prove_decode_graphs(
    engine: SampleEngine, *, graphs_factory: GraphsFactory | None = None
) -> GraphState:
    """Turns graph replay on for `engine` if capture and replay work here and replay equals
    eager (see the module docstring); otherwise leaves decode eager and says why. Needs a
    free sampler slot (for a temporary adapter) and nothing running: call it before serving.
    On a CPU engine it does nothing unless a factory is given (tests: `capture=False`)."""
    if graphs_factory is None:
        if engine.device.type != "cuda":
            return _set_state(
                engine,
                None,
                GraphState(reason=f"off: CUDA graphs need CUDA, not {engine.device.type}"),
            )
        graphs_factory = DecodeGraphs
    try:
        graphs = graphs_factory(engine)
    except (ValueError, RuntimeError) as exc:
        return _off(engine, f"the graph runner could not be built: {exc}")
    if not graphs.fused:
        return _set_state(engine, None, GraphState(reason=f"off: {EAGER_KERNEL}"))
    if engine._additive_mask:
        return _set_state(engine, None, GraphState(reason=f"off: {EAGER_ADDITIVE_MASK}"))
    free = engine.bank.free_slots()
    if not free:
        return _off(engine, "no free sampler slot for the start-up check's adapter")
    slot = engine.bank.allocate(
        AdapterSpec(rank=min(_CHECK_RANK, engine.bank.r_max), alpha=8.0, seed=1), free[0]
    )
    try:
        diff = _check(engine, graphs, slot)
    except Exception as exc:  # noqa: BLE001 - any failure keeps decode eager; the reason is kept
        return _off(engine, f"{type(exc).__name__}: {exc}")
    finally:
        engine.bank.free(slot)
    state = GraphState(
        enabled=True,
        reason=f"on: replay equals eager at start-up (buckets {sorted(graphs.planner.buckets)})",
        checked=True,
        max_logprob_diff=diff,
    )
    log.info("CUDA-graph decode on: replay equals eager at start-up (max log-prob diff %.2g)", diff)
    return _set_state(engine, graphs, state)


def _set_state(engine: SampleEngine, graphs: DecodeGraphs | None, state: GraphState) -> GraphState:
    engine.decode_graphs = graphs
    engine.graph_state = state
    return state


def _off(engine: SampleEngine, why: str) -> GraphState:
    log.warning("CUDA-graph decode off, decode runs eagerly: %s", why)
    return _set_state(engine, None, GraphState(reason=f"off: {why}", checked=True))


@torch.no_grad()
def _check(engine: SampleEngine, graphs: DecodeGraphs, slot: int) -> float:
    """Eager vs replayed decode of the same rows, twice (the second time with the routing
    changed under the same graph); returns the largest log-prob difference."""
    gen = torch.Generator().manual_seed(0)
    bank = engine.bank
    weights = {
        path: (A, 0.5 * torch.randn(B.shape, generator=gen).to(B.device))
        for path, (A, B) in bank.slot_weights(slot).items()
    }
    bank.load_slot_weights(slot, weights)
    vocab = engine.limits.vocab_size
    prompts = [[t % vocab for t in p] for p in _CHECK_PROMPTS][: engine.cache.num_rows]
    n = len(prompts)
    device = engine.device
    lengths = [len(p) for p in prompts]
    ids = torch.zeros(n, max(lengths), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt)
    first = [slot if row % 2 == 0 else BASE_SLOT for row in range(n)]
    logits = engine._forward(
        slice(0, n),
        ids.to(device),
        torch.zeros(n, dtype=torch.int64, device=device),
        torch.tensor(first, dtype=torch.int64, device=device),
        torch.arange(n, device=device),
        torch.tensor([length - 1 for length in lengths], device=device),
        lengths=torch.tensor(lengths, device=device),
    )
    tokens = logits.argmax(-1).tolist()
    tolerance = tolerance_for(engine.dtype, same_implementation=True)
    worst = 0.0
    for routing in (first, [BASE_SLOT if s == slot else slot for s in first]):
        eager = engine._forward(
            slice(0, n),
            torch.tensor([[t] for t in tokens], dtype=torch.int64, device=device),
            torch.tensor(lengths, dtype=torch.int64, device=device),
            torch.tensor(routing, dtype=torch.int64, device=device),
            torch.arange(n, device=device),
            torch.zeros(n, dtype=torch.int64, device=device),
        )
        replayed = graphs.decode(tokens, lengths, routing)
        if replayed is None:
            raise GraphCheckFailed(
                f"the step ran eagerly instead of replaying: {dict(graphs.eager_steps)}"
            )
        replayed_lp = torch.log_softmax(replayed.float(), -1)
        eager_lp = torch.log_softmax(eager.float(), -1)
        diff = float((replayed_lp - eager_lp).abs().max())
        if not diff <= tolerance:
            raise GraphCheckFailed(
                f"replayed log-probs differ from eager by {diff:.3g} (tolerance {tolerance:g})"
            )
        # Greedy picks agree up to near-ties (a random-weight model's top two tokens can be
        # closer than rounding): replay's pick must be eager's best within the tolerance.
        picked = eager_lp.gather(1, replayed_lp.argmax(-1, keepdim=True)).squeeze(1)
        if bool((picked < eager_lp.max(-1).values - tolerance).any()):
            raise GraphCheckFailed("replay picks greedy tokens that eager ranks clearly lower")
        worst = max(worst, diff)
    return worst


def fall_back(engine: SampleEngine, exc: BaseException) -> None:
    """A capture or replay raised while serving: decode stays eager from now on (the step
    that raised runs eagerly too); one log line, and the reason in the engine's state."""
    state = engine.graph_state
    state.enabled = False
    state.fallbacks += 1
    state.last_error = f"{type(exc).__name__}: {exc}"
    state.reason = f"off: a capture or replay failed while serving ({state.last_error})"
    engine.decode_graphs = None
    log.warning("CUDA-graph decode turned off, decode runs eagerly: %s", state.last_error)
