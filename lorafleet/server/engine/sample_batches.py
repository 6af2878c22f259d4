"""Sample ops into the sampler: each request's adapter version is resolved first (a named
checkpoint's current version, registered again from its files if the sampler let it go; an
ephemeral one past retention is a user error), then the requests go to the sampler together,
either run to completion (`run`) or queued into its running batch (`start`, then `step`), each
under its tenant's share key and weight so that admission takes turns between tenants by the
same shares as the training rounds (fair_share.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

from lorafleet.interfaces import Sampler
from lorafleet.sample import SampleRequest, SampleResult, VersionError
from lorafleet.server.engine import responses
from lorafleet.server.engine.sampler_versions import INFLIGHT_SUFFIX, LIVE_SUFFIX, VersionPublisher
from lorafleet.server.errors import (
    ApiError,
    NotFound,
    ServerFault,
    UserError,
    exception_text,
    strip_paths,
)
from lorafleet.server.ops import stability
from lorafleet.server.ops.futures import Result
from lorafleet.server.ops.scheduler import PendingSample
from lorafleet.server.ops.types import Job, Sample, sample_op
from lorafleet.server.state import public_checkpoints
from lorafleet.server.state.retention import VersionKey
from lorafleet.server.state.store import Store

Batch = list[tuple[int, Sample, SampleRequest]]
"""(index of the op, its arguments, the sampler's request) for the ops that passed their checks."""


def _not_run() -> Result:
    return Result.error(UserError("request was not run"))


def _result(output: SampleResult, args: Sample) -> Result:
    """The sampler's outcome as the future's result. A failed or cancelled request carries the
    work it did (`SampleResult.prefill_tokens`, `sampled_tokens`) for metering."""
    if output.error is not None:
        return replace(
            Result.error(_error(output.error.code, output.error.message)),
            prefill_tokens=output.prefill_tokens,
            sampled_tokens=output.sampled_tokens,
            cached_prompt_tokens=output.prompt_cache_hit_tokens,
        )
    return Result.proto(
        responses.sample_response(
            output,
            prompt_logprobs=args.prompt_logprobs,
            topk_prompt=args.topk_prompt,
            topk_sample=args.topk_sample,
            last_n=args.last_n,
            targets=args.targets,
        ),
        sampled_tokens=sum(len(seq.tokens) for seq in output.sequences),
        cached_prompt_tokens=output.prompt_cache_hit_tokens,
        prefill_tokens=len(args.prompt),
    )


def _recorded_result(output: SampleResult, args: Sample, job: Job, store: Store) -> Result:
    """As `_result`, and for a `record_stability_info` sample its stability record written
    first: a sample whose record cannot be kept fails (its sequences could not be trained with
    stable_reinforce, which is what the client asked to record them for), charged the work it
    did like any failed sample."""
    if args.record is not None and output.error is None:
        try:
            stability.write_record(
                store, job.request_id, job.tenant, args.record, args.prompt, output
            )
        except ApiError as exc:
            return replace(
                Result.error(exc),
                prefill_tokens=len(args.prompt),
                sampled_tokens=sum(len(seq.tokens) for seq in output.sequences),
                cached_prompt_tokens=output.prompt_cache_hit_tokens,
            )
    return _result(output, args)


def _error(code: str, message: str) -> ApiError:
    text = f"sample: {strip_paths(message)}"
    if code == "engine_unavailable":
        # the rollout replicas are down or restarting: the request is fine, retry it later
        return ServerFault(text, status=503)
    if code == "internal_error":  # this request's own work failed (the others went on)
        return ServerFault(text)
    return UserError(text)


class SampleBatches:
    def __init__(
        self,
        sampler: Sampler,
        store: Store,
        publisher: VersionPublisher,
        share_weight: Callable[[str], float] = lambda tenant: 1.0,
    ):
        self.sampler = sampler
        self.share_weight = share_weight  # a tenant's fair-share weight (tenant config)
        self.store = store
        self.publisher = publisher  # which version of a checkpoint or ephemeral save is current
        self.ephemeral_limit = publisher.ephemeral_limit  # named in the error for one that is gone
        # token ids every tenant's prompts may share prefix-cache blocks within (an operator's
        # system prompts, `ServerConfig.public_prefixes`); all else is cached per tenant
        self.public_prefixes: tuple[tuple[int, ...], ...] = ()

    def run(self, jobs: list[Job]) -> list[Result]:
        """Runs the jobs' samples to completion in one call (samplers without a running batch)."""
        results, batch = self._requests(jobs)
        if batch:
            outputs = self.sampler.generate([request for _, _, request in batch])
            for (i, args, _), output in zip(batch, outputs, strict=True):
                results[i] = _recorded_result(output, args, jobs[i], self.store)
        return [r if r is not None else _not_run() for r in results]

    def start(self, jobs: list[Job]) -> list[Result | PendingSample]:
        """Queues the jobs' samples into the sampler's running batch (continuous batching across
        requests that arrive at different times); the scheduler then calls `step`. A sampler
        whose batches run elsewhere (Ray replicas) completes them inside `submit`."""
        results, batch = self._requests(jobs)
        items: list[Result | PendingSample] = [r if r is not None else _not_run() for r in results]
        if batch:
            futures = self.sampler.submit([request for _, _, request in batch])
            for (i, args, _), future in zip(batch, futures, strict=True):
                items[i] = PendingSample(
                    future, partial(_recorded_result, args=args, job=jobs[i], store=self.store)
                )
        return items

    def step(self) -> bool:
        """One step of the running sample batch; False when it had nothing to do."""
        return bool(self.sampler.step())

    def _requests(self, jobs: list[Job]) -> tuple[list[Result | None], Batch]:
        results: list[Result | None] = [None] * len(jobs)
        batch: Batch = []
        for i, job in enumerate(jobs):
            args = sample_op(job)
            try:
                key = self._version(args, job.tenant)
            except ApiError as exc:
                results[i] = Result.error(exc)
                continue
            request = SampleRequest(
                prompt=args.prompt,
                params=args.params,
                adapter=key,
                num_samples=args.num_samples,
                share_key=job.tenant,  # admission takes turns between tenants
                share_weight=self.share_weight(job.tenant),
                prompt_logprobs=args.prompt_logprobs,
                topk_prompt_logprobs=args.topk_prompt,
                topk_sample_logprobs=args.topk_sample,
                target_prompt_logprobs=None if args.targets is None else args.targets.ids,
                prompt_alt_tokens_k=args.alt_k,
                on_token=args.on_token,
                cancel=args.cancel,
                # the prefix cache keeps each tenant's prompts to that tenant (prefix_cache.py)
                cache_salt=job.tenant,
                public_prefixes=self.public_prefixes,
            )
            batch.append((i, args, request))
        return results, batch

    def _version(self, args: Sample, tenant: str) -> VersionKey | None:
        """The published version the request samples from (None: the base), published again
        from its checkpoint's files if the sampler let it go. Another tenant's checkpoint is
        checked for publication at every request, not only when the sampling client was made:
        unpublishing it ends other tenants' sampling of it at once."""
        key = args.adapter
        if key is None:
            return None
        if key[0].endswith(INFLIGHT_SUFFIX):
            return self.publisher.inflight_target(key[0])
        if args.checkpoint_path is None:
            model_id = key[0].removesuffix(LIVE_SUFFIX)
            if not self.publisher.retention.is_kept(model_id, key):
                raise UserError(
                    "these sampler weights came from save_weights_and_get_sampling_client, whose weights are kept only "
                    f"for the newest {self.ephemeral_limit} saves of a model and never across a server "
                    "restart; use save_weights_for_sampler(name) for durable weights"
                )
            return key
        checkpoint = self.store.checkpoints.get(args.checkpoint_path)
        if checkpoint is None:
            raise NotFound(f"checkpoint {args.checkpoint_path} was deleted")
        if checkpoint.tenant != tenant and not public_checkpoints.is_public(checkpoint):
            raise NotFound(f"checkpoint {args.checkpoint_path} is not published any more")
        if checkpoint.expired():
            raise NotFound(
                f"checkpoint {args.checkpoint_path} has expired (its ttl_seconds ran out)"
            )
        try:
            # The checkpoint's current weights: an overwrite gave them a new version.
            return self.publisher.checkpoint_version(checkpoint.tinker_path, Path(checkpoint.dir))
        except VersionError as exc:
            raise UserError(
                f"checkpoint {args.checkpoint_path} cannot be sampled: {exception_text(exc)}"
            ) from None
