"""OpenAI completions through the Tinker sample path: the request becomes the same `SampleArgs`
the `sample` route builds, goes through the same intake (quotas, the queue bound, metering) and
scheduler (fair share) to whichever sampler is configured, and its result is the same
SampleResponse, rendered as OpenAI objects.

Streaming: the sampler calls the request's progress hook (`sample.types.TokenHook`) on its own
thread as each token is drawn; the hook hands the token to the request's event loop, and the
route sends the text as it grows. A sampler that cannot call the hook (its batch runs in
another process: Ray replicas, a vLLM pool; `SamplerFeatures.token_streaming` false) is not
given one, and the stream then carries the whole completion at once. What is buffered is at
most the request's own tokens, which its cost check bounded before it ran.

A client that disconnects (a stream or a non-streamed request; the routes listen for it,
http/disconnect.py) cancels its sample: the request's cancel event is set, the sampler drops
its rows at its next step, and the tokens it had produced are metered (issue 34)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from lorafleet.sample.reports import SamplerFeatures
from lorafleet.sample.types import SamplingParams
from lorafleet.server.errors import ApiError, ServerFault, UserError
from lorafleet.server.http import parse
from lorafleet.server.http.served import ServedBase
from lorafleet.server.openai import asks, render
from lorafleet.server.openai.errors import OpenAIError, body
from lorafleet.server.openai.errors import from_failed_result as failed
from lorafleet.server.openai.models import Models, Target
from lorafleet.server.openai.sizes import openai_response_bytes
from lorafleet.server.openai.text import Incremental, Text, cut_at_stop, safe_prefix
from lorafleet.server.ops.futures import FutureTable, Result
from lorafleet.server.ops.intake import Intake, Place
from lorafleet.server.ops.types import Sample
from lorafleet.server.state.keys import Tenant

log = logging.getLogger(__name__)


class StreamHook:
    """The progress hook of one streaming request: tokens onto its event loop's queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[tuple[int, int]]):
        self._loop = loop
        self._queue = queue
        self._open = True

    def __call__(self, sample: int, token: int) -> None:
        if not self._open:
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (sample, token))
        except RuntimeError:  # the loop is closed (server shutdown): nobody to tell
            self._open = False

    def close(self) -> None:
        """The client is gone or the result is in: later tokens are not queued."""
        self._open = False


class Completions:
    def __init__(
        self,
        intake: Intake,
        futures: FutureTable,
        models: Models,
        served: ServedBase,
        text: Text,
        poll_s: float,
        features: SamplerFeatures,
    ):
        self.intake = intake
        self.futures = futures
        self.models = models
        self.served = served
        self.text = text
        self.poll_s = poll_s
        self.features = features  # what the sampler honours (`Sampler.features`)

    def parse(self, tenant: Tenant, raw: Any, chat: bool) -> tuple[asks.Ask, Target]:
        limits = self.served.limits
        ask = asks.chat(raw, self.text, limits) if chat else asks.completion(raw, self.text, limits)
        self._check_engine(ask)
        return ask, self.models.resolve(tenant, ask.model)

    def _check_engine(self, ask: asks.Ask) -> None:
        """What the sampler declares it cannot honour (`SamplerFeatures`: vLLM and SGLang end
        samples at token ids, not strings, and return the sampled tokens' log-probs without
        alternatives) is refused here, before anything is queued, with OpenAI's field named,
        rather than as a failed sample naming the Tinker fields the request was turned into."""
        engine = self.features.engine
        if ask.stop and not self.features.stop_strings:
            raise OpenAIError(
                f"stop is not supported with the {engine} rollout engine this server samples "
                "with (it ends samples at token ids, not strings); send the request without it",
                "stop",
                code="unsupported",
            )
        if ask.logprobs and not self.features.top_logprobs:
            field = "top_logprobs" if ask.chat else "logprobs"
            raise OpenAIError(
                f"{field} {ask.logprobs} is not supported with the {engine} rollout engine this "
                "server samples with (it returns the sampled tokens' log-probs only); ask for "
                + ("logprobs: true without top_logprobs" if ask.chat else "logprobs: 0"),
                field,
                code="unsupported",
            )

    def _check_response_size(self, ask: asks.Ask, args: Sample) -> None:
        """The JSON response's size (sizes.py), which is several times the Tinker estimate
        `check_sample_cost` made: log-prob entries are objects here, repeated per choice."""
        limit = self.served.limits.max_response_bytes
        max_new = args.params.max_tokens
        if max_new is None:  # check_sample_cost let it through: the context bounds it
            max_new = max((self.served.context_length or 0) - len(ask.prompt), 0)
        size = openai_response_bytes(ask, max_new)
        if size <= limit:
            return
        tokens = "max_completion_tokens" if ask.chat else "max_tokens"
        what = f"n {ask.n} x {tokens} {max_new}"
        field = tokens
        if ask.logprobs:
            top = "top_logprobs" if ask.chat else "logprobs"
            what += f" x (1 + {top} {ask.logprobs}) log-prob entries"
            field = top
        raise OpenAIError(
            f"this request's response could carry about {size} bytes of JSON ({what}, each with "
            f"its text and framing), more than this server's limit of {limit} bytes per response; "
            "ask for fewer choices, tokens or top log-probs",
            field,
        )

    def submit(
        self,
        tenant: Tenant,
        raw: Any,
        ask: asks.Ask,
        target: Target,
        hook: StreamHook | None,
        cancel: threading.Event | None = None,
    ) -> str:
        """The request into the scheduler (cost checked first); its request id."""
        stop: list[str] | None = None
        if ask.stop:
            stop = list(dict.fromkeys([*ask.stop, *self.text.eos_strings()]))
        args = Sample(
            prompt=ask.prompt,
            params=SamplingParams(
                max_tokens=ask.max_tokens,
                temperature=ask.temperature,
                top_k=ask.top_k,
                top_p=ask.top_p,
                stop=stop,
                seed=ask.seed,
            ),
            num_samples=ask.n,
            prompt_logprobs=False,
            topk_prompt=0,
            topk_sample=ask.logprobs or 0,
            last_n=None,
            adapter=target.adapter,
            checkpoint_path=target.checkpoint_path,
            # only a sampler that calls it as tokens are drawn gets it (`SamplerFeatures`)
            on_token=hook if self.features.token_streaming else None,
            cancel=cancel,
        )
        try:
            parse.check_sample_cost(args, self.served.limits, self.served.context_length)
        except UserError as exc:
            field = "max_completion_tokens" if ask.chat else "max_tokens"
            raise OpenAIError(exc.message, field) from None
        self._check_response_size(ask, args)
        promise = self.intake.submit(tenant, args, Place(), parse.fingerprint(raw))
        return promise.request_id

    async def result(self, tenant: Tenant, rid: str) -> list[render.Sampled]:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            result: Result | None = await self.futures.wait(rid, tenant.id, self.poll_s)
            if result is not None:
                break
            if loop.time() - started < self.poll_s / 2:  # released early: the table closed
                raise ServerFault("the server is shutting down; send the request again")
        if result.failed:
            raise failed(result.body)
        return render.sampled(result.body)

    async def answer(
        self, tenant: Tenant, raw: Any, chat: bool, cancel: threading.Event | None = None
    ) -> dict[str, Any]:
        """`cancel`: set by the route when the client hangs up (the sample then stops)."""
        ask, target = self.parse(tenant, raw, chat)
        rid = self.submit(tenant, raw, ask, target, None, cancel)
        seqs = await self.result(tenant, rid)
        return render.response(ask, rid, int(time.time()), seqs, self.text)

    def stream(
        self, tenant: Tenant, raw: Any, chat: bool, cancel: threading.Event | None = None
    ) -> AsyncIterator[str]:
        """Everything that can fail at the door fails here, before the stream starts (as an
        ordinary JSON error); the returned iterator yields the server-sent events. However
        the iterator ends before the result (the client gone, the stream closed), `cancel`
        is set: the sample stops."""
        ask, target = self.parse(tenant, raw, chat)
        queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        hook = StreamHook(asyncio.get_running_loop(), queue)
        cancel = cancel if cancel is not None else threading.Event()
        rid = self.submit(tenant, raw, ask, target, hook, cancel)
        return self._events(tenant, ask, rid, hook, queue, cancel)

    async def _events(
        self,
        tenant: Tenant,
        ask: asks.Ask,
        rid: str,
        hook: StreamHook,
        queue: asyncio.Queue[tuple[int, int]],
        cancel: threading.Event,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        live = [Incremental(self.text) for _ in range(ask.n)]
        shown = [""] * ask.n
        stopped = [False] * ask.n
        done = asyncio.ensure_future(self.result(tenant, rid))
        getter: asyncio.Future[tuple[int, int]] | None = None
        try:
            if ask.chat:
                for i in range(ask.n):
                    yield _sse(render.chunk(ask, rid, created, i, "", first=True))
            while not done.done():
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    break
                events = [getter.result()]
                while not queue.empty():
                    events.append(queue.get_nowait())
                for i in sorted({sample for sample, _ in events}):
                    live[i].add([token for sample, token in events if sample == i])
                    if stopped[i]:
                        continue
                    so_far, stopped[i] = cut_at_stop(live[i].text, ask.stop)
                    visible = so_far if stopped[i] else safe_prefix(so_far, ask.stop)
                    if len(visible) > len(shown[i]) and visible.startswith(shown[i]):
                        delta, shown[i] = visible[len(shown[i]) :], visible
                        yield _sse(render.chunk(ask, rid, created, i, delta))
            try:
                seqs = await done
            except ApiError as exc:
                yield _sse(body(exc))
                return
            for i, seq in enumerate(seqs):
                final = render.final_text(seq, ask, self.text)
                if not final.startswith(shown[i]):  # never expected: the tokens are the same
                    log.error(
                        "stream %s choice %d: streamed text is not a prefix of the result", rid, i
                    )
                yield _sse(
                    render.chunk(
                        ask,
                        rid,
                        created,
                        i,
                        final[len(shown[i]) :] if final.startswith(shown[i]) else "",
                        finish_reason=seq.finish_reason,
                        logprobs_=render.logprobs(seq, ask, self.text),
                    )
                )
            if ask.include_usage:
                yield _sse(render.usage_chunk(ask, rid, created, seqs))
            yield "data: [DONE]\n\n"
        finally:
            hook.close()
            if not done.done():
                cancel.set()  # ended before the result: nobody wants the rest
            if getter is not None:
                getter.cancel()
            done.cancel()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
