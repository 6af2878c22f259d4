"""The rollout pool's routing, health and paging, with replicas that are our own sampler in
this process (a RolloutEngine that can die, skip loads, or be restarted): no vLLM needed.

Each fake replica has its own copy of the tiny model (same seed as the trainer's), so the pool's
base check, per-replica canary and page-ins run for real; only the process around it is fake.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest
import torch

from lorafleet.canary import SyncVerificationError
from lorafleet.engines import colocate
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample.reports import SamplerFeatures
from lorafleet.sample.types import SampleRequest, SamplingParams
from lorafleet.sample.versions import VersionError
from lorafleet.sync.base import (
    AdapterVersion,
    RolloutEngineError,
    RolloutRequest,
    SyncError,
    SyncMode,
)
from lorafleet.sync.embedded import EmbeddedEngine
from lorafleet.sync.pool import RolloutPool
from lorafleet.sync.rollout_config import RolloutConfig
from lorafleet.sync.rollout_faults import ENV as FAULT_ENV
from tests._models import tiny_qwen3
from tests.sync._helpers import new_adapter, randomize

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [5, 9, 17, 33, 2]
SEEDING = threading.Lock()


class FakeReplicaEngine(EmbeddedEngine):
    """Our sampler as a pool replica: files loaded by path, and faults on demand."""

    def __init__(self, source: FakeSource):
        with SEEDING:  # replicas start on threads; torch's global seed is shared
            model = tiny_qwen3()
        stack = colocate(model, resolve_tinker_targets(model), base_model_id="tiny", r_max=8)
        super().__init__(stack.sampler)
        self.source = source
        self.requests = 0

    def load_staged(self, version: AdapterVersion, path: str) -> None:
        self._check_alive()
        if self.source.skip_loads:
            return
        try:
            key = self.versions.register(version.adapter_id, version.version, path)
            self.versions.acquire(key)
            self.versions.release(key)
        except (VersionError, ValueError) as exc:  # our sampler refuses unknown modules
            with contextlib.suppress(VersionError):
                self.versions.drop(version.key)
            raise SyncError(f"cannot load {version.name}: {exc}") from exc

    def generate(self, requests):
        self._check_alive()
        self.requests += 1
        if self.source.hold is not None:
            self.source.hold.wait(timeout=30)
        self._check_alive()
        return super().generate(requests)

    def held(self) -> list[str]:
        return sorted(f"{a}@{v}" for a, v in self.versions.resident())

    def _check_alive(self) -> None:
        if not self.source.alive():
            raise RolloutEngineError(f"{self.source.name}: connection refused")


class FakeSource:
    def __init__(self, name: str, *, restartable: bool = True):
        self.name = name
        self.url = f"http://{name}.invalid"
        self.restartable = restartable
        self.up = False
        self.starts = 0
        self.skip_loads = False
        self.hold: threading.Event | None = None
        self.engines: list[FakeReplicaEngine] = []

    def start(self) -> str:
        self.up = True
        self.starts += 1
        return self.url

    def alive(self) -> bool:
        return self.up

    def stop(self) -> None:
        self.up = False

    @property
    def engine(self) -> FakeReplicaEngine:
        return self.engines[-1]


@pytest.fixture
def trainer():
    model = tiny_qwen3()
    return colocate(model, resolve_tinker_targets(model), base_model_id="tiny", r_max=8)


def make_pool(trainer, sources, tmp_path: Path, **options) -> RolloutPool:
    by_url = {s.url: s for s in sources}

    def factory(url: str) -> FakeReplicaEngine:
        engine = FakeReplicaEngine(by_url[url])
        by_url[url].engines.append(engine)
        return engine

    config = RolloutConfig(
        engine="vllm",
        sync=SyncMode.FILES,
        urls=tuple(by_url),
        staging_dir=tmp_path / "staging",
        **options,
    )
    config.validate()
    return RolloutPool(
        config,
        trainer.trainer,
        sources,
        limits=trainer.sampler.limits,
        dtype=torch.float32,
        engine_factory=factory,
        base_model_id="tiny",
        start_supervisor=False,
    )


def request(key, **kwargs) -> SampleRequest:
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop=[])
    return SampleRequest(PROMPT, params, adapter=key, **kwargs)


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def publish(pool: RolloutPool, trainer, name: str, seed: int):
    slot = new_adapter(trainer.trainer, seed)
    return pool.versions.publish(name, trainer.trainer.bank, slot), slot


def test_versions_reach_every_replica_verified_and_requests_spread(trainer, tmp_path):
    sources = [FakeSource("a"), FakeSource("b")]
    pool = make_pool(trainer, sources, tmp_path)
    try:
        key, slot = publish(pool, trainer, "tinker://run/sampler_weights/one", 1)
        assert pool.versions.verified(key).differs_check == "passed"
        stats = pool.rollout_stats().as_dict()
        assert stats["engine"] == "vllm" and stats["sync"] == "files"
        for replica in stats["replicas"]:
            assert replica["state"] == "healthy" and replica["versions"] == [f"{key[0]}@0"]
            assert replica["last_canary"]["ok"] and replica["last_canary"]["max_abs_diff"] <= 1e-4
        before = [s.engine.requests for s in sources]  # base check and canary: 2 each
        hold = threading.Event()
        for source in sources:
            source.hold = hold
        running = pool.submit([request(key), request(key)])
        # least outstanding: while the first runs (held), the second goes to the other replica
        wait_until(lambda: [s.engine.requests for s in sources] == [b + 1 for b in before])
        hold.set()
        results = [f.result(timeout=60) for f in running]
        assert all(r.error is None and r.adapter == key for r in results)
        assert all(s.adapter == key for r in results for s in r.sequences)
        # the engine's tokens, scored by the trainer, match the engine's log-probs
        (result,) = pool.generate([request(key, prompt_logprobs=True)])
        lp = trainer.trainer.canary_logprobs(slot, PROMPT + result.sequences[0].tokens)
        assert torch.allclose(
            lp[len(PROMPT) - 1 :], torch.tensor(result.sequences[0].logprobs), atol=1e-4
        )
        assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(PROMPT)
    finally:
        pool.close()


def test_a_version_no_replica_verifies_is_never_served(trainer, tmp_path, monkeypatch):
    pool = make_pool(trainer, [FakeSource("a")], tmp_path)
    try:
        good, _ = publish(pool, trainer, "good", 1)
        monkeypatch.setenv(FAULT_ENV, "skipped_load:broken")
        with pytest.raises(SyncVerificationError, match="could not run"):
            publish(pool, trainer, "broken", 2)
        monkeypatch.setenv(FAULT_ENV, "wrong_module_names:renamed")
        with pytest.raises(SyncVerificationError, match="no vllm replica verified renamed@0"):
            publish(pool, trainer, "renamed", 3)
        monkeypatch.delenv(FAULT_ENV)
        assert pool.versions.resident() == [good]
        assert sorted(p.name for p in (tmp_path / "staging").iterdir()) == [
            pool.catalogue[good].engine_version.name
        ]
        (bad,) = pool.generate([request(("broken", 0))])
        assert bad.error.code == "unknown_version"
        (ok,) = pool.generate([request(good)])
        assert ok.error is None and ok.adapter == good
        assert pool.rollout_stats().as_dict()["replicas"][0]["state"] == "healthy"
        last = pool.rollout_stats().as_dict()["replicas"][0]["last_canary"]
        assert (last["version"], last["ok"]) == ("broken@0", False)  # renamed failed to load
    finally:
        pool.close()


def test_a_replica_that_fails_its_canary_leaves_rotation_and_comes_back(trainer, tmp_path):
    sources = [FakeSource("a"), FakeSource("b")]
    pool = make_pool(trainer, sources, tmp_path)
    try:
        sources[1].skip_loads = True
        key, _ = publish(pool, trainer, "one", 1)  # "a" verified it: published
        b = pool.rollout_stats().as_dict()["replicas"][1]
        assert b["state"] == "unhealthy" and "failed to sync one@0" in b["error"]
        assert b["last_canary"]["ok"] is False
        assert pool.health() == "degraded"
        results = pool.generate([request(key)] * 3)
        assert all(r.error is None for r in results)
        assert sources[1].engine.requests == 2  # its base check and its failed canary
        sources[1].skip_loads = False
        pool.supervisor.check()  # restarts it and re-syncs the versions in use
        for thread in pool.supervisor._recovering.values():
            thread.join(60)
        b = pool.rollout_stats().as_dict()["replicas"][1]
        assert b["state"] == "healthy" and b["restarts"] == 1 and b["versions"] == ["one@0"]
        assert sources[1].engine.held() == [f"{pool.catalogue[key].engine_version.name}"]
        assert pool.health() == "ok"
    finally:
        pool.close()


def test_a_request_on_a_replica_that_dies_runs_again_on_another(trainer, tmp_path):
    sources = [FakeSource("a"), FakeSource("b")]
    pool = make_pool(trainer, sources, tmp_path)
    try:
        key, _ = publish(pool, trainer, "one", 1)
        before = [s.engine.requests for s in sources]
        sources[0].hold = threading.Event()
        (running,) = pool.submit([request(key)])
        wait_until(lambda: sources[0].engine.requests == before[0] + 1)
        sources[0].up = False  # dies mid-request
        sources[0].hold.set()
        result = running.result(timeout=60)
        assert result.error is None and result.adapter == key
        assert sources[1].engine.requests == before[1] + 1  # ran again there
        a = pool.rollout_stats().as_dict()["replicas"][0]
        assert a["state"] == "unhealthy" and "connection refused" in a["error"]
    finally:
        pool.close()


def test_no_verified_replica_left_is_a_retryable_error_naming_why(trainer, tmp_path):
    source = FakeSource("a", restartable=False)
    pool = make_pool(trainer, [source], tmp_path)
    try:
        key, _ = publish(pool, trainer, "one", 1)
        source.up = False
        pool.supervisor.check()
        (result,) = pool.generate([request(key)])
        assert result.error.code == "engine_unavailable"
        assert "no verified vllm replica" in result.error.message
        assert "/health stopped answering" in result.error.message
        assert pool.health() == "unavailable"
    finally:
        pool.close()


def test_past_max_loras_the_least_recently_used_idle_version_pages_out(trainer, tmp_path):
    source = FakeSource("a")
    pool = make_pool(trainer, [source], tmp_path, max_loras=1)
    try:
        first, slot = publish(pool, trainer, "first", 1)
        second, _ = publish(pool, trainer, "second", 2)
        names = {k: pool.catalogue[k].engine_version.name for k in (first, second)}
        assert source.engine.held() == [names[second]]
        randomize(trainer.trainer, slot, 99)  # training moved on: the version must not
        (again,) = pool.generate([request(first, prompt_logprobs=True)])
        assert again.error is None and again.adapter == first
        assert source.engine.held() == [names[first]]
        paging = pool.versions.paging()
        assert paging["page_ins"] == 3 and paging["page_outs"] == 2
        assert pool.rollout_stats().as_dict()["replicas"][0]["last_canary"]["version"] == "first@0"
    finally:
        pool.close()


def test_what_the_engine_cannot_honour_is_refused_by_name(trainer, tmp_path):
    pool = make_pool(trainer, [FakeSource("a")], tmp_path)
    try:
        # declared, so the server refuses these up front (the OpenAI routes), and the pool's
        # own refusals below are what a request that got past it meets
        assert pool.features == SamplerFeatures(
            engine="vllm", stop_strings=False, top_logprobs=False, token_streaming=False
        )
        assert pool.prefix_cache_stats() is None
        for field, value in [("topk_prompt_logprobs", 2), ("prompt_alt_tokens_k", 1)]:
            (result,) = pool.generate([request(None, **{field: value})])
            assert result.error.code == "invalid_request"
            assert f"{field} is not supported by the vllm rollout engine" in result.error.message
        params = SamplingParams(max_tokens=2, stop=["\n"])
        (result,) = pool.generate([SampleRequest(PROMPT, params)])
        assert "stop strings" in result.error.message
        (base,) = pool.generate([request(None, num_samples=3)])
        assert base.adapter is None and len(base.sequences) == 3
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("spec", "sync", "message"),
    [
        ("vllm=spawn", "merged", "cannot sync by --sync 'merged'"),
        ("vllm=spawn", "tensor", "no HTTP endpoint that takes LoRA tensors"),
        ("embedded", "files", "cannot sync by --sync 'files'"),
        ("vllm=spawn:0", None, "spawn:N takes N from 1"),
        ("vllm=spawn:", None, "spawn:N takes N from 1 to 16, got ''"),
        ("vllm=spawn:\u00b2", None, "spawn:N takes N from 1"),
        ("vllm=http://u:secret@h:1", None, r"must not carry credentials .*://\.\.\.@h$"),
        ("vllm=http://h:1?x=1", None, "must not have a query"),
        ("sglang=spawn", None, "only vllm can be spawned"),
        ("vllm=ftp://x", None, r"not an http\(s\) URL"),
        ("vllm", None, "needs =URL"),
        ("tgi=http://x", None, "unknown engine 'tgi'"),
    ],
)
def test_rollout_config_refuses_what_cannot_work(spec, sync, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig.parse(spec, sync)


def test_rollout_config_defaults_per_engine():
    assert RolloutConfig.parse("embedded").sync.value == "tensor"
    spawned = RolloutConfig.parse("vllm=spawn:2")
    assert (spawned.sync.value, spawned.spawn, spawned.urls) == ("files", 2, ())
    urls = RolloutConfig.parse("sglang=http://a:1,http://b:2")
    assert (urls.sync.value, urls.urls) == ("files", ("http://a:1", "http://b:2"))


def test_engine_requests_name_their_version():
    with pytest.raises(ValueError, match="adapter must be an AdapterVersion"):
        RolloutRequest([1, 2], None)  # type: ignore[arg-type]
