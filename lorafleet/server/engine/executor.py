"""The engine side of the server: every method here runs on the scheduler's worker thread.

One frozen base carries two bank sets (colocate): "train" slots hold the live adapters of
training clients, "sample" slots hold immutable published versions that samplers read. Requests
arrive already parsed (requests.py); each is validated against the engine before it is batched
(`TrainEngine.prepare`, `AdamHParams.validate`, the sampler's per-request checks), so a bad
request fails alone.

The `Executor` loads the base, builds the engines and composes the parts that use them, one job
each: `LiveModels` (which run holds which trainer slot; slots are a cache, runs page out to
host memory and disk), `AdapterSetup` (adapters into slots),
`CheckpointFiles` (checkpoints on disk), `VersionPublisher` (sampler versions, canary and
ephemeral retention), `TrainBatches` and `SampleBatches` (ops as engine batches). It dispatches
the scheduler's calls to them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, assert_never

from lorafleet.engines import EngineConfig, build_engines, device_report, plan_engine_config
from lorafleet.interfaces import EngineSet
from lorafleet.model.loader import load_base
from lorafleet.sample.reports import SamplerHealth
from lorafleet.server.engine.adapter_setup import AdapterSetup
from lorafleet.server.engine.checkpoint_files import CheckpointFiles
from lorafleet.server.engine.live_models import PAGED_DIR, LiveModels
from lorafleet.server.engine.sample_batches import SampleBatches
from lorafleet.server.engine.sampler_versions import VersionPublisher
from lorafleet.server.engine.target_sets import TargetSets
from lorafleet.server.engine.train_batches import TrainBatches
from lorafleet.server.errors import ApiError, UserError
from lorafleet.server.ops.futures import Result
from lorafleet.server.ops.scheduler import Partial, PendingSample, TrainChunk
from lorafleet.server.ops.types import (
    CreateFromState,
    CreateModel,
    Forward,
    ForwardBackward,
    Job,
    LoadWeights,
    OptimStep,
    Refused,
    Sample,
    SaveExternal,
    SaveSampler,
    SaveWeights,
)
from lorafleet.server.state import ids
from lorafleet.server.state.retention import EphemeralRetention
from lorafleet.server.state.store import CheckpointRow, SamplingSessionRow, Store

__all__ = ["EPHEMERAL_DIR", "EngineConfig", "Executor"]

EPHEMERAL_DIR = "ephemeral"  # under the data dir; wiped at start-up


class Executor:
    def __init__(
        self,
        config: EngineConfig,
        store: Store,
        data_dir: Path,
        *,
        torch_threads: int | None = None,
        has_work: Callable[[str], bool] | None = None,
        max_resident: Callable[[str], int | None] | None = None,
        share_weight: Callable[[str], float] = lambda tenant: 1.0,
    ):
        """`torch_threads`: as the worker thread sees them (reported in stats). `has_work`:
        the scheduler's answer to "does this model have queued or running work" (paging keeps
        such runs in their slots longest). `max_resident`: a tenant's `resident_runs` quota,
        which paging keeps it to. `share_weight`: a tenant's fair-share weight, which
        its sample rows get in the sampler's admission."""
        self.config = config
        self.store = store
        self.data_dir = data_dir
        self.torch_threads = torch_threads
        base = load_base(config.base_model, dtype=config.dtype, device=config.device)
        self.base_id = base.model_id  # preset name or absolute dir: what checkpoints record
        self.base_path = base.path
        model_config = base.model.config
        self.arch = (getattr(model_config, "architectures", None) or [type(base.model).__name__])[0]
        self.context_length = int(getattr(model_config, "max_position_embeddings", 0) or 0) or None
        targets = TargetSets(base.model)  # before the engines wrap the base's linears
        # sizes left to the device's free memory are planned now (engines.plan_engine_config)
        self.config = config = plan_engine_config(config, base, targets.everything())
        # Same seams whether the engines run here, in trainer ranks or in sampler replicas.
        self.engines: EngineSet = build_engines(config, base, targets.everything())
        self.trainer = self.engines.trainer
        self.sampler = self.engines.sampler
        self.versions = self.engines.versions

        self.live = LiveModels(
            store,
            self.trainer,
            config.max_adapters,
            paged_dir=data_dir / PAGED_DIR,
            warm_bytes=config.warm_bytes,
            has_work=has_work,
            max_resident=max_resident,
        )
        self.publisher = VersionPublisher(
            self.trainer,
            self.sampler,
            EphemeralRetention(data_dir / EPHEMERAL_DIR, config.ephemeral_keep),
            self.base_path,
        )
        self.checkpoints = CheckpointFiles(
            store, self.trainer, self.publisher, data_dir, self.base_id, self.base_path
        )
        self.adapters = AdapterSetup(self.trainer, targets, self.live, self.checkpoints)
        self.train_batches = TrainBatches(self.trainer, self.live)
        self.sample_batches = SampleBatches(self.sampler, store, self.publisher, share_weight)

    # ================================================================== control ops
    def run_control(self, job: Job) -> Result:
        try:
            return self._control(job)
        except ApiError as exc:
            return Result.error(exc)

    def _control(self, job: Job) -> Result:
        op = job.op
        match op:
            case CreateModel():
                return self.adapters.create_model(job, op)
            case CreateFromState():
                return self.adapters.create_from_state(job, op)
            case LoadWeights():
                return self.adapters.load_weights(job, op)
            case SaveWeights():
                path = self.checkpoints.save_state(job.tenant, self.live.get(job.model_id), op)
                return Result.json({"path": path, "type": "save_weights"})
            case SaveExternal():
                path = self.checkpoints.save_external(job.tenant, self.live.get(job.model_id), op)
                return Result.json({"path": path, "type": "save_weights_external"})
            case SaveSampler():
                return self._save_sampler(job, op)
            case Refused():
                return Result.error(op.error)
            case Forward() | ForwardBackward() | OptimStep() | Sample():
                raise RuntimeError(f"{job.request_id}: a {op.kind} op is not a control op")
            case _:
                assert_never(op)

    def _save_sampler(self, job: Job, op: SaveSampler) -> Result:
        """A named save is a sampler checkpoint; an unnamed one (save_weights_and_get_sampling_client)
        publishes an ephemeral version and opens a sampling session on it."""
        live = self.live.get(job.model_id)
        if op.name is not None:
            path = self.checkpoints.save_sampler(job.tenant, live, op.name, op)
            return Result.json({"path": path, "type": "save_weights_for_sampler"})
        assert op.sampling_session_seq_id is not None
        sampler_id = ids.sampling_session_id(live.session_id, op.sampling_session_seq_id)
        if self.store.sampling_sessions.get(sampler_id) is not None:
            raise UserError(
                f"sampling_session_seq_id {op.sampling_session_seq_id} is already used in session {live.session_id}"
            )
        adapter_id, version = self.publisher.publish_ephemeral(live, inflight=op.inflight)
        self.store.sampling_sessions.add(
            SamplingSessionRow(
                sampler_id,
                job.tenant,
                live.session_id,
                live.base_model,
                None,
                adapter_id,
                version,
                time.time(),
            )
        )
        return Result.json({"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})

    # ================================================================== maintenance (via Scheduler.call)
    def unload_models(self, model_ids: list[str]) -> None:
        """Frees the models' adapter slots; the caller fails what they still have queued."""
        self.live.unload(model_ids)

    def delete_checkpoint(self, checkpoint: CheckpointRow) -> None:
        self.checkpoints.delete(checkpoint)

    # ================================================================== batches
    def run_train(self, chunks: list[TrainChunk]) -> list[Result | Partial]:
        with self.live.hold(c.job.model_id for c in chunks):  # the batch's runs stay in their slots
            return self.train_batches.forward_backward(chunks)

    def run_optim(self, jobs: list[Job]) -> list[Result]:
        with self.live.hold(job.model_id for job in jobs):
            return self.train_batches.optim_step(jobs)

    def run_sample(self, jobs: list[Job]) -> list[Result]:
        return self.sample_batches.run(jobs)

    def start_sample(self, jobs: list[Job]) -> list[Result | PendingSample]:
        return self.sample_batches.start(jobs)

    def step_sampler(self) -> bool:
        return self.sample_batches.step()

    # ================================================================== introspection
    def close(self) -> None:
        """Stops what the engines started (trainer ranks, sampler replicas); no-op in one process."""
        self.engines.close()

    def stats(self) -> dict[str, Any]:
        return {
            "models_loaded": len(self.live),
            "adapter_slots": self.config.max_adapters,
            "sampler_slots": self.config.sampler_slots,
            "sampler_versions_resident": len(self.versions.resident()),
            # deleted, overwritten or past retention while in use: dropped after their samples
            "sampler_versions_retiring": len(self.versions.retiring()),
            # trainer slots and sampler slots are caches under one policy (model/paging.py)
            "paging": {"training": self.live.paging(), "sampler": self.versions.paging()},
            "torch_threads": self.torch_threads,
            "prefix_cache": self.prefix_cache_stats(),
            "device": device_report(self.config, self.engines),  # where, memory, kernels
        }

    # What the sampler reports about itself (interfaces.Sampler), as JSON for the stats.
    def rollout_stats(self) -> dict[str, object]:
        """Which engine samples and how its replicas are (the console reads this shape)."""
        return self.sampler.rollout_stats().as_dict()

    def rollout_health(self) -> SamplerHealth:
        """ "ok", "degraded" or "unavailable": /healthz's `rollout`."""
        return self.sampler.health()

    def prefix_cache_stats(self) -> dict[str, object] | None:
        """The sampler's prefix cache (lorafleet/sample/prefix_cache.py); None where it keeps
        none it can read (vLLM/SGLang replicas)."""
        stats = self.sampler.prefix_cache_stats()
        return None if stats is None else stats.as_dict()
