"""Continuous-batching generation for many adapter versions over one shared base model.

The engine keeps one running batch of rows over the frozen base, each row routed to its own
sampler slot (slot 0 = base model). Rows live in a fixed pool with a `RowCache` (kvcache.py): a
finished sequence frees its row at once and a waiting one is prefilled into it while the others
keep decoding, so a long sequence never holds the batch hostage. Requests join the running batch
whenever they arrive: `submit` queues them from any thread and returns futures, `step` advances
the batch by one engine step (whoever drives it: the server's worker between training rounds,
or `generate`, which submits and steps until its own requests are done). One engine step is:
1. admit waiting sequences into free rows, callers taking turns (admission.py; pinning their
   adapter version; one prefill forward per admission round, a prompt shared by several
   samples is prefilled once and its KV copied);
2. one decode forward over all running rows (one new token each);
3. retire finished rows, compacting the pool so running rows stay contiguous.

Log-probs. The log-prob reported for each sampled token (and for prompt tokens, top-k lists,
target ids and alternative prompt tokens) is `log_softmax` of the model's raw logits:
temperature 1, before top-k/top-p filtering. This is vLLM's default
(`logprobs_mode="raw_logprobs"`) and it is the quantity the training engine
computes for the same tokens, which importance-sampling losses compare against (`logprobs` in
`loss_fn_inputs` is the sampler's). With temperature != 1 or filtering, the distribution that
actually drew the token differs from the one reported; callers that need the sampling
distribution's log-prob must correct for it.

Stops: see stops.py (stop token kept; stop string: tokens up to and including the one that
completes it). Requests are validated one by one (validate.py): a bad request, an unknown or
unloadable version gets its own `SampleResult.error`; the others run unchanged.

Isolation within a step. The forwards are shared, but everything done per request after them
is the request's own: its token choice (retried row by row when the batched choice raises,
with the same uniforms, so the others' tokens do not change), its log-probs, progress hook,
stop check and prompt scores. An exception there, or non-finite logits in its rows (a
diverged adapter), fails that request alone (`internal_error`, `non_finite_logits`) and frees
its rows; the rest of the batch goes on. Only a failing forward fails every running request.

Work done is reported with every result (`SampleResult.prefill_tokens`, `sampled_tokens`),
failed and cancelled ones included, so the server can meter it. A request whose `cancel`
event is set is dropped at the start of the next step.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.memory import is_out_of_memory, release_cached
from lorafleet.model.routing import BASE_SLOT
from lorafleet.sample.admission import FairQueue
from lorafleet.sample.canary_probe import version_name
from lorafleet.sample.cuda_graphs import DecodeGraphs, GraphState, fall_back
from lorafleet.sample.kvcache import RowCache
from lorafleet.sample.prefix_cache import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_TOKENS_PER_ROW,
    Block,
    PrefixCache,
    PrefixCacheStats,
)
from lorafleet.sample.reports import ReplicaStats, RolloutStats, SamplerFeatures, SamplerHealth
from lorafleet.sample.sampling import (
    alternatives_generator,
    choose_tokens_drawn,
    draw_alternatives,
    draw_uniforms,
    gather_logprobs,
    sequence_generator,
    topk_lists,
)
from lorafleet.sample.stops import StopChecker
from lorafleet.sample.types import (
    PromptAltTokens,
    SampledSequence,
    SampleError,
    SampleRequest,
    SampleResult,
    SequenceTrace,
    StopReason,
    TokenHook,
    TopK,
    VersionKey,
)
from lorafleet.sample.validate import ModelLimits, PreparedRequest, prepare_all
from lorafleet.sample.versions import (
    NoFreeSlotError,
    UnknownVersionError,
    VersionError,
    VersionStore,
    VersionUnavailableError,
)

log = logging.getLogger(__name__)

_NON_FINITE = SampleError(
    "non_finite_logits",
    "the model's logits for this request are not finite (NaN or infinite): the weights of "
    "the adapter version it samples hold NaN or infinite values, or overflow; check the "
    "training run that saved them",
)

DEFAULT_MAX_ROWS = 32
DEFAULT_PREFILL_TOKENS = 4096


@dataclass(eq=False)
class _Group:
    """One request while it runs: its version pin and the samples still to finish."""

    request: PreparedRequest
    future: Future[SampleResult]
    traces: list[SequenceTrace]  # the submission's trace list
    share_key: str | None = None  # whose turn admitting it takes (admission.py)
    share_weight: float = 1.0  # that key's share of the rows
    slot: int | None = None  # sampler slot once pinned (BASE_SLOT for the base model)
    pinned: bool = False
    remaining: int = 0
    sequences: list[SampledSequence | None] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    topk_prompt: list[TopK | None] | None = None
    target_logprobs: torch.Tensor | None = None
    alt_tokens: PromptAltTokens | None = None
    prompt_recorded: bool = False
    error: SampleError | None = None
    prefix_root: int | None = None  # its chain in the prefix cache, once prefilled
    prompt_ids: list[int] = field(default_factory=list)  # the prompt as a list, once needed
    on_token: TokenHook | None = None  # the request's progress hook
    cache_hit_tokens: int | None = None  # prompt tokens its first prefill took from the cache
    cancel: threading.Event | None = None  # set by the caller: drop it at the next step
    prefilled: int = 0  # prompt tokens prefilled for it (once per request)
    sampled: int = 0  # tokens drawn over all its samples, finished or not


@dataclass(eq=False)
class _Seq:
    group: _Group
    sample: int
    generator: torch.Generator
    stop: StopChecker
    admitted_step: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[TopK] | None = None
    length: int = 0  # positions held in the cache (the last sampled token is not yet there)
    stop_reason: StopReason | None = None


def _eos_ids(model: Any, tokenizer: Any | None, vocab: int) -> frozenset[int]:
    ids: set[int] = set()
    sources = [getattr(model.config, "eos_token_id", None)]
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        sources.append(getattr(generation_config, "eos_token_id", None))
    if tokenizer is not None:
        sources.append(getattr(tokenizer, "eos_token_id", None))
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(t for t in source if isinstance(t, int))
    return frozenset(t for t in ids if 0 <= t < vocab)


class SampleEngine:
    """Batched, continuously refilled generation over the sampler bank of an AdaptedModel.

    `max_rows` bounds the sequences decoding at once (the KV row pool); `prefill_tokens` bounds
    one admission round's padded prompt tokens. Waiting sequences take turns by their request's
    `share_key` (admission.py). The pool has `reserved_rows` (default `max(1, max_rows // 16)`)
    rows beyond `max_rows` that only a key holding no row may take, so a newcomer starts at the
    next step even when one caller fills the batch, and a lone caller still gets all `max_rows`
    rows (a reserve carved out of them would cost it a whole extra wave when its sequences end
    together). Steps run one at a time (a lock); `submit` and publishing into the version store
    from other threads stay safe meanwhile.
    `last_traces` records when each sequence of the last `generate` joined and left the batch
    (in engine steps, counted over the engine's life).
    """

    def __init__(
        self,
        adapted: AdaptedModel,
        versions: VersionStore,
        *,
        tokenizer: Any | None = None,
        max_rows: int = DEFAULT_MAX_ROWS,
        prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
        reserved_rows: int | None = None,
        prefix_cache_bytes: int | None = None,
        prefix_block_tokens: int = DEFAULT_BLOCK_TOKENS,
    ):
        if adapted.banks.get(versions.bank.name) is not versions.bank:
            raise ValueError(
                f"the version store's bank {versions.bank.name!r} is not a bank of this model"
            )
        if max_rows < 1 or prefill_tokens < 1:
            raise ValueError(
                f"max_rows and prefill_tokens must be >= 1, got {max_rows}, {prefill_tokens}"
            )
        self.adapted = adapted
        self.versions = versions
        self.bank = versions.bank
        self.tokenizer = tokenizer
        self.max_rows = max_rows
        self.prefill_tokens = prefill_tokens
        self.reserved_rows = max(1, max_rows // 16) if reserved_rows is None else reserved_rows
        if self.reserved_rows < 0:
            raise ValueError(f"reserved_rows must be >= 0, got {reserved_rows}")
        model: Any = adapted.model  # an HF causal LM; nn.Module types its accessors as Tensor
        config = model.config.get_text_config(decoder=True)
        self._check_supported(config)
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        if self.lm_head is None:
            raise NotImplementedError(f"{type(model).__name__} has no output embedding (lm_head)")
        vocab = int(model.get_input_embeddings().num_embeddings)
        context = int(getattr(config, "max_position_embeddings", 0) or 0)
        if context < 2:
            raise ValueError("the model config has no usable max_position_embeddings")
        self.limits = ModelLimits(
            vocab_size=vocab,
            context=context,
            eos_token_ids=_eos_ids(model, tokenizer, vocab),
            has_tokenizer=tokenizer is not None,
        )
        self.device = self.bank.params.device
        self.dtype = next(model.parameters()).dtype
        self._additive_mask = config._attn_implementation == "eager"
        # CUDA-graph decode (cuda_graphs.py): set by prove_decode_graphs or enable, CUDA only
        self.decode_graphs: DecodeGraphs | None = None
        self.graph_state = GraphState()
        self.cache = RowCache(int(config.num_hidden_layers), max_rows + self.reserved_rows)
        if prefix_cache_bytes is None:
            prefix_cache_bytes = self.default_prefix_cache_bytes(
                config, self.dtype, max_rows + self.reserved_rows
            )
        self.prefix_cache = PrefixCache(prefix_cache_bytes, block_tokens=prefix_block_tokens)
        self._lock = threading.Lock()  # held while stepping
        self._queue_lock = threading.Lock()  # guards _incoming
        self._incoming: deque[_Group] = deque()
        self._waiting: FairQueue[str | None, tuple[_Group, int]] = FairQueue()
        self._active: list[_Seq] = []
        self._cancellable: list[_Group] = []  # unfinished requests that have a cancel event
        self._step = 0
        self.last_traces: list[SequenceTrace] = []
        # the last step that failed (its requests failed with it), until a step succeeds again
        self._last_failure: str | None = None
        self.out_of_memory_failures = 0  # requests failed because the device ran out of memory
        self.prefix_cache_oom_skips = 0  # prefixes not cached for want of device memory
        self._check_logits_path()

    # ------------------------------------------------------------------ set-up checks
    @staticmethod
    def default_prefix_cache_bytes(config: Any, dtype: torch.dtype, rows: int) -> int:
        """The KV of `DEFAULT_TOKENS_PER_ROW` tokens per row of the pool: enough for every row's
        conversation history at the length of a typical multi-turn episode."""
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        per_token = 2 * int(config.num_hidden_layers) * kv_heads * head_dim * dtype.itemsize
        return per_token * rows * DEFAULT_TOKENS_PER_ROW

    @staticmethod
    def _check_supported(config: Any) -> None:
        layer_types = getattr(config, "layer_types", None) or []
        odd = sorted({t for t in layer_types if t != "full_attention"})
        if odd:
            raise NotImplementedError(
                f"layer types {odd} (e.g. sliding windows) are not supported by the row cache"
            )
        if config._attn_implementation not in ("sdpa", "eager"):
            raise NotImplementedError(
                f"attention implementation {config._attn_implementation!r}: the sampler passes explicit "
                "4-D masks, which it only builds for 'sdpa' and 'eager'"
            )

    @torch.no_grad()
    def _check_logits_path(self) -> None:
        """The engine computes logits as lm_head(decoder(x)) on selected positions only; refuse
        models whose forward does more (logit soft-capping, scaling), instead of sampling wrong."""
        ids = torch.arange(min(3, self.limits.vocab_size), device=self.device).unsqueeze(0)
        base = torch.zeros_like(ids)
        with self.adapted.routing(self.bank.name, base):
            full = self.adapted.model(input_ids=ids).logits
            split = self.lm_head(self.decoder(input_ids=ids).last_hidden_state)
        if not torch.allclose(full.float(), split.float(), atol=1e-3, rtol=1e-3):
            raise NotImplementedError(
                f"{type(self.adapted.model).__name__} does not compute logits as lm_head(hidden states); "
                "the sampler cannot serve it"
            )

    # ------------------------------------------------------------------ reports (interfaces.Sampler)
    # Every token is drawn here, so every request feature is honoured and `on_token` is called
    # as each one is drawn.
    features = SamplerFeatures(
        engine="embedded", stop_strings=True, top_logprobs=True, token_streaming=True
    )

    def health(self) -> SamplerHealth:
        """ "ok": the engine is this object, in this process; a step that failed failed its own
        requests only (the next step starts afresh), so it shows as the replica's `error`."""
        return self.rollout_stats().health()

    def rollout_stats(self) -> RolloutStats:
        """One replica, this engine: the versions in its sampler slots now, and the last
        failed step while no step has succeeded since. Its canary is run and recorded by the
        publisher (`verification.publish_verified`), not here."""
        versions = tuple(version_name(k) for k in self.versions.resident())
        replica = ReplicaStats(
            name="embedded",
            url="in-process",
            state="healthy",
            versions=versions,
            last_canary=None,
            restarts=0,
            error=self._last_failure,
        )
        return RolloutStats(engine="embedded", sync="tensor", replicas=(replica,))

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix cache's counters and size (prefix_cache.py), for the server's stats."""
        return self.prefix_cache.report()

    def decode_graph_stats(self) -> dict[str, object]:
        """Whether decode replays CUDA graphs and why, with the runner's counters."""
        return self.graph_state.record(self.decode_graphs)

    def release_cache(self) -> None:
        """Frees the KV buffers between sampling phases (they come back on the next step; the
        prefix cache keeps its blocks, which are bounded on their own)."""
        with self._lock:
            if self._active or self._waiting or self._incoming:
                raise RuntimeError("release_cache: sequences are still running or queued")
            self.cache.release()

    # ------------------------------------------------------------------ public
    def submit(self, requests: Sequence[SampleRequest]) -> list[Future[SampleResult]]:
        """Queues requests to join the running batch; one future per request, in order.

        Bad requests resolve at once with their `error`; the others resolve as their last
        sample finishes, on whichever thread drives `step`.
        """
        return self._submit(list(requests), [])

    def has_work(self) -> bool:
        with self._queue_lock:
            return bool(self._active or self._waiting or self._incoming)

    def step(self) -> bool:
        """One engine step (admit + prefill, decode, retire); False when there was nothing to do.

        An exception inside a forward fails every running and queued request with it (their
        state is not recoverable) and is re-raised.
        """
        with self._lock:
            self._take_incoming()
            self._drop_cancelled()
            if not self._waiting and not self._active:
                return False
            self._step += 1
            try:
                self._advance(self._step)
            except BaseException as exc:
                self._abort(exc)
                self._last_failure = f"step {self._step} failed: {type(exc).__name__}: {exc}"
                raise
            self._last_failure = None
            return True

    @torch.no_grad()
    def generate(self, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        """One result per request, in order. Never raises for a bad request (see its `error`).

        Requests submitted meanwhile by other threads share the batch; each caller steps the
        engine until its own requests are done.
        """
        traces: list[SequenceTrace] = []
        futures = self._submit(list(requests), traces)
        while not all(f.done() for f in futures):
            self.step()
        self.last_traces = traces
        return [f.result() for f in futures]

    @torch.no_grad()
    def probe_logprobs(self, key: VersionKey | None, tokens: Sequence[int]) -> torch.Tensor:
        """Log-probs (fp32, CPU) of tokens[1:], each given the tokens before it, under version
        `key` (None = the base model).

        A one-row prefill through the sampling path (row-cache attention, split head), but over
        a row cache of its own and at once, between steps: the publish canary asks this while the
        running batch may hold other callers' long samples, and must not wait for a free row.
        Raises ValueError for bad tokens and the version store's errors for `key`."""
        ids = list(tokens)
        vocab = self.limits.vocab_size
        if len(ids) < 2 or len(ids) > self.limits.context:
            raise ValueError(f"tokens: need 2 to {self.limits.context} token ids, got {len(ids)}")
        bad = [
            t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
        ]
        if bad:
            raise ValueError(f"tokens: ids must be integers in [0, {vocab}), got {bad[:5]!r}")
        device = self.device
        with self._lock:
            slot = BASE_SLOT if key is None else self.versions.acquire(key)
            try:
                n = len(ids)
                logits = self._forward(
                    slice(0, 1),
                    torch.tensor([ids], dtype=torch.int64, device=device),
                    torch.zeros(1, dtype=torch.int64, device=device),
                    torch.tensor([slot], dtype=torch.int64, device=device),
                    torch.zeros(n - 1, dtype=torch.int64, device=device),
                    torch.arange(n - 1, device=device),
                    lengths=torch.tensor([n], device=device),
                    cache=RowCache(len(self.cache.layers), 1),
                )
            finally:
                if key is not None:
                    self.versions.release(key)
        targets = torch.tensor(ids[1:], dtype=torch.int64, device=logits.device)
        return gather_logprobs(torch.log_softmax(logits, dim=-1), targets).float().cpu()

    # ------------------------------------------------------------------ the running batch
    def _submit(
        self, requests: list[SampleRequest], traces: list[SequenceTrace]
    ) -> list[Future[SampleResult]]:
        prepared = prepare_all(requests, self.limits)
        futures: list[Future[SampleResult]] = []
        groups: list[_Group] = []
        for index, item in enumerate(prepared):
            future: Future[SampleResult] = Future()
            future.set_running_or_notify_cancel()
            futures.append(future)
            if isinstance(item, SampleError):
                future.set_result(
                    SampleResult([], adapter=getattr(requests[index], "adapter", None), error=item)
                )
                continue
            groups.append(
                _Group(
                    request=item,
                    future=future,
                    traces=traces,
                    share_key=requests[index].share_key,
                    share_weight=float(requests[index].share_weight),
                    on_token=requests[index].on_token,
                    cancel=requests[index].cancel,
                    remaining=item.num_samples,
                    sequences=[None] * item.num_samples,
                )
            )
        with self._queue_lock:
            self._incoming.extend(groups)
        return futures

    def _drop_cancelled(self) -> None:
        """Requests whose caller set their `cancel` event leave now, with the work they did."""
        live = [g for g in self._cancellable if not g.future.done()]
        cancelled = [g for g in live if g.cancel is not None and g.cancel.is_set()]
        self._cancellable = [g for g in live if g.cancel is not None and not g.cancel.is_set()]
        if cancelled:
            self._drop(
                cancelled,
                SampleError("cancelled", "the request was cancelled (its client went away)"),
            )

    def _take_incoming(self) -> None:
        with self._queue_lock:
            while self._incoming:
                group = self._incoming.popleft()
                if group.cancel is not None:
                    self._cancellable.append(group)
                for sample in range(group.request.num_samples):
                    self._waiting.push(group.share_key, (group, sample), group.share_weight)

    @torch.no_grad()
    def _advance(self, step: int) -> None:
        waiting, active = self._waiting, self._active
        admitted = self._admit(waiting, active, step)
        if admitted:
            oom = self._out_of_memory(lambda: self._prefill(admitted, active))
            if oom is None:
                self._retire(active, step)
            else:  # the new requests fail; the rows already running go on
                groups = {id(s.group): s.group for s in admitted}
                self._drop(
                    groups.values(), self._oom_error(oom, f"prefilling {len(groups)} request(s)")
                )
        if active:
            self._decode(active, step)
        elif not admitted and waiting:
            self._fail_stuck(waiting)

    def _out_of_memory(self, run: Callable[[], object]) -> str | None:
        """Runs `run`; None when it finished, the error's text when the device ran out of
        memory (any other error propagates). The failed forward's tensors are released when
        this returns (the exception and its frames are gone by then)."""
        try:
            run()
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        return None

    def _oom_error(self, detail: str, doing: str) -> SampleError:
        release_cached(self.device)
        return SampleError(
            "out_of_memory",
            f"out of memory on {self.device} while {doing}; the sampler goes on serving. "
            f"Ask for fewer samples or tokens, or retry when the server is less busy "
            f"({detail[:300]})",
        )

    def _drop(self, groups: Iterable[_Group], error: SampleError) -> None:
        """Fails these requests now and frees their rows (the pool is compacted as `_retire`
        does); their samples still waiting are skipped when their turn comes."""
        doomed = {id(g): g for g in groups}
        active = self._active
        for row in range(len(active) - 1, -1, -1):
            if id(active[row].group) in doomed:
                last = len(active) - 1
                if row != last:
                    self.cache.copy_row(last, row, active[last].length)
                    active[row] = active[last]
                active.pop()
        for group in doomed.values():
            self._unpin(group)
            if not group.future.done():
                self._fail(group, error)
                self.out_of_memory_failures += error.code == "out_of_memory"

    def _abort(self, exc: BaseException) -> None:
        """A shared forward failed: every request fails with it, each told the work it had
        done (so it is still metered)."""
        groups = {id(g): g for g, _ in self._waiting.drain()}
        groups.update({id(s.group): s.group for s in self._active})
        error = SampleError(
            "internal_error", f"the sampling step failed: {type(exc).__name__}: {exc}"[:500]
        )
        for group in groups.values():
            self._unpin(group)
            if not group.future.done():
                self._fail(group, error)
        self._active.clear()

    # ------------------------------------------------------------------ scheduling
    def _admit(
        self, waiting: FairQueue[str | None, tuple[_Group, int]], active: list[_Seq], step: int
    ) -> list[_Seq]:
        """Moves waiting sequences into free rows, taking turns between share keys (in order
        within one), skipping requests whose version cannot be made resident right now (they
        wait for slots to unpin)."""
        free = self.max_rows + self.reserved_rows - len(active)
        held = Counter(seq.group.share_key for seq in active)
        admitted: list[_Seq] = []
        prefill_groups: list[_Group] = []
        longest = 0
        deferred: list[tuple[str | None, tuple[_Group, int]]] = []
        blocked: set[int] = set()
        while free > 0:
            picked = waiting.pop(held, free=free, reserved=self.reserved_rows)
            if picked is None:
                break
            group, sample = picked[1]
            if group.error is not None:
                continue
            if id(group) in blocked:
                deferred.append((group.share_key, (group, sample)))
                continue
            if group not in prefill_groups:
                new_longest = max(longest, self._new_tokens_estimate(group))
                if prefill_groups and new_longest * (len(prefill_groups) + 1) > self.prefill_tokens:
                    waiting.push_front(group.share_key, (group, sample), group.share_weight)
                    break
                if not group.pinned and not self._pin(group):
                    if group.error is None:
                        blocked.add(id(group))
                        deferred.append((group.share_key, (group, sample)))
                    continue
                prefill_groups.append(group)
                longest = new_longest
            request = group.request
            try:
                seq = _Seq(
                    group=group,
                    sample=sample,
                    generator=sequence_generator(request.seed, sample),
                    stop=StopChecker(request.stop, self.tokenizer),
                    admitted_step=step,
                    topk=[] if request.topk_sample else None,
                )
            except Exception as exc:  # noqa: BLE001 - its own failure, never the batch's
                self._row_failed([group], exc, "admitting")
                admitted = [s for s in admitted if s.group is not group]
                prefill_groups.remove(group)
                continue
            admitted.append(seq)
            held[group.share_key] += 1
            free -= 1
        for key, item in reversed(deferred):
            waiting.push_front(key, item, item[0].share_weight)
        return admitted

    def _new_tokens_estimate(self, group: _Group) -> int:
        """Prompt tokens the group's prefill will compute, for the round's budget: what the
        prefix cache does not hold now (looked up again after pinning, in `_prefill`)."""
        try:
            hit = len(self._prefix_hit(group))
        except VersionError:
            return group.request.prompt_len  # its pin fails and says why
        return group.request.prompt_len - hit * self.prefix_cache.block_tokens

    def _prefix_hit(self, group: _Group) -> list[Block]:
        """The cached blocks this group's prompt may reuse: never its last position (its logits
        sample the first token) nor any position whose logits the request reads (prompt
        log-probs, top-k, targets, alternatives are computed, not cached)."""
        request = group.request
        key = request.adapter
        group.prefix_root = self.prefix_cache.root(
            key, None if key is None else self.versions.info(key)
        )
        if not group.prompt_ids:
            group.prompt_ids = request.prompt.tolist()
        start = None if group.prompt_recorded else request.prompt_logits_from
        limit = request.prompt_len - 1 if start is None else min(start, request.prompt_len - 1)
        return self.prefix_cache.lookup(
            group.prefix_root,
            group.prompt_ids,
            limit,
            request.cache_salt,
            request.public_prefixes,
        )

    def _cache_prefix(self, group: _Group, row: int, tokens: list[int]) -> None:
        """Adds the full blocks of `tokens`, whose KV row `row` holds, to the prefix cache
        (skipped, and counted, when the device has no memory left for the copy)."""
        if group.prefix_root is not None and self.prefix_cache.enabled:
            root = group.prefix_root
            request = group.request
            oom = self._out_of_memory(
                lambda: self.prefix_cache.insert(
                    root,
                    tokens,
                    lambda start, stop: self.cache.read_span(row, start, stop),
                    request.cache_salt,
                    request.public_prefixes,
                )
            )
            if oom is not None:
                release_cached(self.device)
                self.prefix_cache_oom_skips += 1

    def _pin(self, group: _Group) -> bool:
        key = group.request.adapter
        if key is None:
            group.slot, group.pinned = BASE_SLOT, True
            return True
        try:
            group.slot = self.versions.acquire(key)
        except NoFreeSlotError:
            return False
        except UnknownVersionError as exc:
            self._fail(group, SampleError("unknown_version", str(exc)))
            return False
        except VersionUnavailableError as exc:
            self._fail(group, SampleError("version_unavailable", str(exc)))
            return False
        group.pinned = True
        return True

    def _unpin(self, group: _Group) -> None:
        if group.pinned:
            group.pinned = False
            if group.request.adapter is not None:
                self.versions.release(group.request.adapter)

    def _fail(self, group: _Group, error: SampleError) -> None:
        group.error = error
        group.future.set_result(
            SampleResult(
                [],
                adapter=group.request.adapter,
                error=error,
                prompt_cache_hit_tokens=group.cache_hit_tokens or 0,
                prefill_tokens=group.prefilled,
                sampled_tokens=group.sampled,
            )
        )

    def _fail_stuck(self, waiting: FairQueue[str | None, tuple[_Group, int]]) -> None:
        """Nothing runs and nothing could be admitted: the remaining versions cannot get a slot."""
        for group, _ in waiting.drain():
            if group.error is None:
                self._fail(
                    group,
                    SampleError(
                        "version_unavailable",
                        f"version {group.request.adapter!r}: no sampler slot could be freed for it "
                        f"(capacity {self.versions.capacity}, all pinned elsewhere)",
                    ),
                )

    # ------------------------------------------------------------------ forwards
    def _forward(
        self,
        rows: slice,
        input_ids: torch.Tensor,
        starts: torch.Tensor,
        row_slots: torch.Tensor,
        pick_rows: torch.Tensor,
        pick_pos: torch.Tensor,
        lengths: torch.Tensor | None = None,
        cache: RowCache | None = None,
    ) -> torch.Tensor:
        """Runs rows `rows` of the pool on `input_ids` [n, q]; fp32 logits of (pick_rows, pick_pos).

        `lengths` (prefill): each row's real token count; the padding after it is computed
        with the rest of the block but never read, so it is routed to the base (no LoRA).
        `cache`: another row cache than the running batch's (`probe_logprobs`)."""
        cache = self.cache if cache is None else cache
        n, q = input_ids.shape
        _, mask, positions = cache.plan(
            rows, starts, q, dtype=self.dtype, additive=self._additive_mask
        )
        slot_ids = row_slots.unsqueeze(1).expand(n, q)
        if lengths is not None:
            padding = torch.arange(q, device=lengths.device).unsqueeze(0) >= lengths.unsqueeze(1)
            slot_ids = slot_ids.masked_fill(padding, BASE_SLOT)
        try:
            with self.adapted.routing(self.bank.name, slot_ids):
                hidden = self.decoder(
                    input_ids=input_ids,
                    attention_mask=mask,
                    position_ids=positions,
                    cache=cache,
                    use_cache=True,
                ).last_hidden_state
        finally:
            cache.finish()
        picked = hidden[pick_rows, pick_pos]
        with self.adapted.routing(self.bank.name, row_slots[pick_rows]):
            return self.lm_head(picked).float()

    def _prefill(self, admitted: list[_Seq], active: list[_Seq]) -> None:
        """Runs each admitted request's prompt once, fans its KV out to its other new rows and
        samples every new sequence's first token."""
        leaders: dict[int, _Seq] = {}
        for seq in admitted:
            leaders.setdefault(id(seq.group), seq)
        ordered = list(leaders.values()) + [s for s in admitted if leaders[id(s.group)] is not s]
        first_row = len(active)
        groups = [seq.group for seq in leaders.values()]
        # Cached prefixes go into the rows first; the forward computes the rest of each prompt.
        hit_len: list[int] = []
        for b, group in enumerate(groups):
            blocks = self._prefix_hit(group)
            if blocks:
                self.cache.write_span(
                    first_row + b,
                    0,
                    torch.cat([block.keys for block in blocks], dim=2).to(self.device),
                    torch.cat([block.values for block in blocks], dim=2).to(self.device),
                )
            hit_len.append(len(blocks) * self.prefix_cache.block_tokens)
            self.prefix_cache.record(
                hit_len[b], group.request.prompt_len - hit_len[b], group.request.cache_salt
            )
            if group.cache_hit_tokens is None:
                group.cache_hit_tokens = hit_len[b]
        new_len = [g.request.prompt_len - h for g, h in zip(groups, hit_len, strict=True)]
        input_ids = torch.zeros(len(groups), max(new_len), dtype=torch.int64)
        pick_rows: list[int] = []
        pick_pos: list[int] = []
        last_pick: list[int] = []
        scored_from: list[int | None] = []
        for b, group in enumerate(groups):
            prompt = group.request.prompt
            input_ids[b, : new_len[b]] = prompt[hit_len[b] :]
            # Prompt log-probs are recorded once per request, on its first prefill.
            start = None if group.prompt_recorded else group.request.prompt_logits_from
            positions = range(prompt.numel() - 1 if start is None else start, prompt.numel())
            pick_rows.extend([b] * len(positions))
            pick_pos.extend(p - hit_len[b] for p in positions)  # (_prefix_hit: none is cached)
            last_pick.append(len(pick_pos) - 1)
            scored_from.append(start)
        device = self.device
        logits = self._forward(
            slice(first_row, first_row + len(groups)),
            input_ids.to(device),
            torch.tensor(hit_len, dtype=torch.int64, device=device),
            torch.tensor([g.slot for g in groups], dtype=torch.int64, device=device),
            torch.tensor(pick_rows, device=device),
            torch.tensor(pick_pos, device=device),
            lengths=torch.tensor(new_len, device=device),
        )
        for b, group in enumerate(groups):
            self._cache_prefix(group, first_row + b, group.prompt_ids)
        logprobs = torch.log_softmax(logits, dim=-1)
        for b, group in enumerate(groups):
            group.prefilled = group.prefilled or group.request.prompt_len
            start = scored_from[b]
            if start is not None:
                first = last_pick[b] + 1 - (group.request.prompt_len - start)
                try:
                    self._record_prompt_logprobs(group, logprobs[first : last_pick[b]], start)
                except Exception as exc:  # its own failure, never the batch's
                    if is_out_of_memory(exc):
                        raise
                    group.error = self._row_error(exc, "scoring its prompt")
        leader_index = {id(g): b for b, g in enumerate(groups)}
        for offset, seq in enumerate(ordered):
            seq.length = seq.group.request.prompt_len
            if offset >= len(groups):
                self.cache.copy_row(
                    first_row + leader_index[id(seq.group)], first_row + offset, seq.length
                )
            active.append(seq)
        picks = torch.tensor([last_pick[leader_index[id(s.group)]] for s in ordered], device=device)
        failed = {id(g): g for g in groups if g.error is not None}
        if failed:  # (their error is set, so `_drop` keeps it rather than failing them again)
            for group in failed.values():
                error, group.error = group.error, None
                assert error is not None
                self._drop([group], error)
            keep = [i for i, s in enumerate(ordered) if id(s.group) not in failed]
            ordered = [ordered[i] for i in keep]
            picks = picks[torch.tensor(keep, dtype=torch.int64, device=device)]
        self._sample(ordered, logits[picks], logprobs[picks])

    def _record_prompt_logprobs(self, group: _Group, predicting: torch.Tensor, start: int) -> None:
        """`predicting[i]` is the distribution after prompt[: start + i + 1], i.e. over
        prompt[start + i + 1]; `start` is 0 unless only target ids from a later row are asked."""
        request = group.request
        group.prompt_recorded = True
        if request.targets is not None:
            group.target_logprobs = self._target_logprobs(request.targets, predicting, start)
        if request.alt_k:
            tokens = draw_alternatives(
                predicting, request.temperature, request.alt_k, alternatives_generator(request.seed)
            )
            group.alt_tokens = PromptAltTokens(
                tokens=tokens.cpu(), logprobs=predicting.gather(1, tokens).float().cpu()
            )
        if not (request.prompt_logprobs or request.topk_prompt):
            return  # (when they are asked for, every position is scored: start is 0)
        targets = request.prompt[1:].to(predicting.device)
        values = gather_logprobs(predicting, targets).tolist() if targets.numel() else []
        if request.prompt_logprobs:
            group.prompt_logprobs = [None, *values]
        if request.topk_prompt:
            group.topk_prompt = (
                [None, *topk_lists(predicting, request.topk_prompt)] if targets.numel() else [None]
            )

    @staticmethod
    def _target_logprobs(
        targets: torch.Tensor, predicting: torch.Tensor, start: int
    ) -> torch.Tensor:
        """Row i of `targets` names ids at prompt position i + 1; rows before `start` name none."""
        out = torch.zeros(targets.shape, dtype=torch.float32)
        ids = targets[start:].to(predicting.device)
        values = predicting.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, 0.0)
        out[start:] = values.float().cpu()
        return out

    def _decode(self, active: list[_Seq], step: int) -> None:
        """One decode step of the running rows. Out of memory in its forward: the requests
        whose rows needed the KV cache to grow fail (every running one when none did), and
        the others decode again once; the engine goes on either way."""
        capacity = self.cache.capacity
        logits: list[torch.Tensor] = []
        oom = self._out_of_memory(lambda: logits.append(self._decode_logits(active)))
        if oom is not None:
            growing = {id(s.group): s.group for s in active if s.length + 1 > capacity}
            culprits = growing or {id(s.group): s.group for s in active}
            self._drop(culprits.values(), self._oom_error(oom, f"decoding {len(active)} row(s)"))
            if not active or not growing:
                return
            oom = self._out_of_memory(lambda: logits.append(self._decode_logits(active)))
            if oom is not None:
                groups = {id(s.group): s.group for s in active}
                self._drop(groups.values(), self._oom_error(oom, f"decoding {len(active)} row(s)"))
                return
        for seq in active:
            seq.length += 1
        self._sample(active, logits[0], torch.log_softmax(logits[0], dim=-1))
        self._retire(active, step)

    def _decode_logits(self, active: list[_Seq]) -> torch.Tensor:
        """The running rows' next-token logits (their KV written at their current length)."""
        device = self.device
        n = len(active)
        input_ids = torch.tensor([[s.tokens[-1]] for s in active], dtype=torch.int64, device=device)
        starts = torch.tensor([s.length for s in active], dtype=torch.int64, device=device)
        slots = torch.tensor([s.group.slot for s in active], dtype=torch.int64, device=device)
        rows = torch.arange(n, device=device)
        graphs = self.decode_graphs  # CUDA graph replay when enabled (cuda_graphs.py)
        logits = None
        if graphs is not None:
            try:
                logits = graphs.decode(
                    [s.tokens[-1] for s in active],
                    [s.length for s in active],
                    [s.group.slot for s in active],
                )
            except Exception as exc:  # noqa: BLE001 - a graph failure must not fail the step
                fall_back(self, exc)  # logged and recorded; this step and the next run eagerly
                logits = None
        if logits is None:
            logits = self._forward(
                slice(0, n), input_ids, starts, slots, rows, torch.zeros_like(rows)
            )
        return logits

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Each row's next token, log-prob, hook and stop check. A row whose work raises, or
        whose logits are not finite, fails its own request (its rows are dropped); the other
        rows' tokens are the ones they would have drawn alone."""
        if not seqs:
            return
        requests = [s.group.request for s in seqs]
        temperature = [r.temperature for r in requests]
        draws = draw_uniforms(temperature, [s.generator for s in seqs])
        tokens: list[int | None]
        chosen: list[float]
        errors: dict[int, SampleError] = {}
        try:
            picked = choose_tokens_drawn(
                logits,
                temperature,
                [r.top_k for r in requests],
                [r.top_p for r in requests],
                draws,
            )
            chosen = gather_logprobs(logprobs, picked).tolist()
            tokens = list(picked.tolist())
        except Exception as exc:  # redone row by row, each failing on its own
            if is_out_of_memory(exc):
                raise
            log.warning("a batched token choice raised (%s); choosing row by row", exc)
            tokens, chosen = [], []
            for i, request in enumerate(requests):
                try:
                    one = choose_tokens_drawn(
                        logits[i : i + 1],
                        [request.temperature],
                        [request.top_k],
                        [request.top_p],
                        draws[i : i + 1],
                    )
                    chosen.append(float(gather_logprobs(logprobs[i : i + 1], one)[0]))
                    tokens.append(int(one[0]))
                except Exception as row_exc:  # this row's request fails alone
                    if is_out_of_memory(row_exc):
                        raise
                    errors[i] = (
                        _NON_FINITE
                        if not bool(torch.isfinite(logits[i]).all())
                        else self._row_error(row_exc, "choosing its next token")
                    )
                    tokens.append(None)
                    chosen.append(math.nan)
        vocab = self.limits.vocab_size
        failed: dict[int, tuple[_Group, SampleError]] = {}
        for i, seq in enumerate(seqs):
            group = seq.group
            if id(group) in failed:
                continue
            token = tokens[i]
            error = errors.get(i)
            if error is None and (token is None or not 0 <= token < vocab):
                error = self._row_error(
                    IndexError(f"token {token} outside the vocabulary [0, {vocab})"),
                    "choosing its next token",
                )
            elif error is None and not math.isfinite(chosen[i]):
                error = _NON_FINITE
            if error is None:
                assert token is not None
                try:
                    self._take_token(seq, token, chosen[i], logprobs, i)
                    continue
                except Exception as exc:  # this row's request fails alone
                    if is_out_of_memory(exc):
                        raise
                    error = self._row_error(exc, "recording its token")
            failed[id(group)] = (group, error)
        for group, error in failed.values():
            self._drop([group], error)

    def _take_token(
        self, seq: _Seq, token: int, logprob: float, logprobs: torch.Tensor, row: int
    ) -> None:
        """A row's drawn token into its sequence: hook, top-k alternatives, stop."""
        group = seq.group
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        group.sampled += 1
        if group.on_token is not None:
            group.on_token(seq.sample, token)
        if seq.topk is not None:
            seq.topk.extend(topk_lists(logprobs[row : row + 1], group.request.topk_sample))
        if seq.stop.update(seq.tokens):
            seq.stop_reason = "stop"
        elif len(seq.tokens) >= group.request.max_new_tokens:
            seq.stop_reason = "length"

    @staticmethod
    def _row_error(exc: BaseException, doing: str) -> SampleError:
        log.error("one request failed while %s; the batch goes on", doing, exc_info=exc)
        return SampleError(
            "internal_error",
            f"this request failed while {doing} ({type(exc).__name__}: {exc}"[:400]
            + "); the other requests of the batch were not affected",
        )

    def _row_failed(self, groups: list[_Group], exc: BaseException, doing: str) -> None:
        self._drop(groups, self._row_error(exc, doing))

    def _retire(self, active: list[_Seq], step: int) -> None:
        """Removes finished rows, moving the last running row into each hole."""
        for row in range(len(active) - 1, -1, -1):
            seq = active[row]
            if seq.stop_reason is None:
                continue
            prompt_len = seq.group.request.prompt_len
            # The next turn of a conversation resends this history: keep its KV.
            self._cache_prefix(
                seq.group, row, seq.group.prompt_ids + seq.tokens[: seq.length - prompt_len]
            )
            last = len(active) - 1
            if row != last:
                self.cache.copy_row(last, row, active[last].length)
                active[row] = active[last]
            active.pop()
            self._complete(seq, step)

    def _complete(self, seq: _Seq, step: int) -> None:
        group = seq.group
        request = group.request
        assert seq.stop_reason is not None
        group.sequences[seq.sample] = SampledSequence(
            tokens=seq.tokens,
            logprobs=seq.logprobs,
            stop_reason=seq.stop_reason,
            adapter=request.adapter,
            topk_logprobs=seq.topk,
        )
        group.traces.append(
            SequenceTrace(request.index, seq.sample, seq.admitted_step, step, len(seq.tokens))
        )
        group.remaining -= 1
        if group.remaining == 0:
            self._unpin(group)
            group.future.set_result(
                SampleResult(
                    sequences=[s for s in group.sequences if s is not None],
                    adapter=request.adapter,
                    prompt_logprobs=group.prompt_logprobs,
                    topk_prompt_logprobs=group.topk_prompt,
                    target_prompt_logprobs=group.target_logprobs,
                    prompt_alt_tokens=group.alt_tokens,
                    prompt_cache_hit_tokens=group.cache_hit_tokens or 0,
                    prefill_tokens=group.prefilled,
                    sampled_tokens=group.sampled,
                )
            )
