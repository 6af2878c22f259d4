"""What a Ray sampler replica receives: a request without its process-local parts (the server
sets a cancel event on every Tinker sample, and a thread event cannot be pickled), and nothing
at all for a request cancelled before it was sent. No Ray cluster needed."""

from __future__ import annotations

import pickle
import threading
from types import SimpleNamespace

from lorafleet.distributed import ray_samplers
from lorafleet.distributed.ray_samplers import RaySamplerPool, _cancelled, _for_replica
from lorafleet.sample.types import SampleError, SampleRequest, SampleResult, SamplingParams


def test_a_request_crosses_without_its_event_and_hook():
    request = SampleRequest(
        [1, 2, 3],
        SamplingParams(max_tokens=4),
        cancel=threading.Event(),
        on_token=lambda *_: None,
        cache_salt="tenant-a",
    )
    sent = pickle.loads(pickle.dumps(_for_replica(request)))
    assert sent.cancel is None and sent.on_token is None
    assert list(sent.prompt) == [1, 2, 3] and sent.cache_salt == "tenant-a"
    assert sent.params.max_tokens == 4
    plain = SampleRequest([1, 2])
    assert _for_replica(plain) is plain


def test_a_cancelled_request_gets_the_cancelled_error():
    result = _cancelled(SampleRequest([1, 2]))
    assert result.error is not None and result.error.code == "cancelled"
    assert result.sequences == []


# ------------------------------------------------------------ generate(), over a fake Ray


class _ActorDied(Exception):
    pass


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class _Replica:
    """Answers a batch at once (`ray.get` of the fake returns what `remote` returned); lacks
    the versions it does not hold, and runs `before` (once) when it is first sent a batch."""

    def __init__(self, index: int, held: set[str], die: bool = False, before=None):
        self.index, self.incarnation, self.state = index, 0, "ready"
        self.held, self.die, self.before, self.sent = held, die, before, []
        self.handle = SimpleNamespace(generate=_Remote(self._generate), load=_Remote(self._load))

    def _generate(self, batch):
        if self.before is not None:
            self.before()
            self.before = None
        if self.die:
            raise _ActorDied()
        self.sent.append([len(r.prompt) for r in batch])
        return [
            SampleResult([], r.adapter, error=SampleError("unknown_version", "evicted"))
            if r.adapter is not None and r.adapter not in self.held
            else SampleResult([], r.adapter, prefill_tokens=len(r.prompt))
            for r in batch
        ]

    def _load(self, key, source):
        self.held.add(key)


def _pool(monkeypatch, replicas: list[_Replica]) -> RaySamplerPool:
    died = SimpleNamespace(RayActorError=_ActorDied, ActorUnavailableError=_ActorDied)
    monkeypatch.setattr(
        ray_samplers, "ray_module", lambda: SimpleNamespace(get=lambda x: x, exceptions=died)
    )
    pool = object.__new__(RaySamplerPool)
    pool.lock = threading.RLock()
    pool._busy, pool.resent, pool._replicas = {}, 0, replicas
    pool.versions = SimpleNamespace(
        serves=lambda key: key is not None, info=lambda key: key, source_of=lambda info: "files"
    )
    turns = iter(replicas * 4)
    pool._pick = lambda: next(turns)
    pool._holds = lambda *args: None
    pool._failed = lambda *args: None
    return pool


def test_results_keep_the_batch_order_around_cancelled_and_resent_requests(monkeypatch):
    gone, waiting = threading.Event(), threading.Event()
    gone.set()
    requests = [
        SampleRequest([1], adapter=None),
        SampleRequest([1, 2], adapter="v1", cancel=gone),  # never sent
        SampleRequest([1, 2, 3], adapter="v1", cancel=waiting),  # evicted: sent again
        SampleRequest([1, 2, 3, 4], adapter=None, cancel=gone),
        SampleRequest([1, 2, 3, 4, 5], adapter="v2", on_token=lambda *_: None),
    ]
    dead, live = _Replica(0, set(), die=True), _Replica(1, {"v2"})
    out = _pool(monkeypatch, [dead, live]).generate(requests)
    assert [r.error.code if r.error else None for r in out] == [
        None,
        "cancelled",
        None,
        "cancelled",
        None,
    ]
    assert [r.prefill_tokens for r in out] == [1, 0, 3, 0, 5]
    assert live.sent == [[1, 3, 5], [3]]  # the evicted one alone, the second time


def test_a_request_cancelled_before_a_retry_is_not_sent_again(monkeypatch):
    """Its client went away while its first replica died: the retry leaves it out."""
    gone = threading.Event()
    requests = [SampleRequest([1], cancel=gone), SampleRequest([1, 2])]
    dead, live = _Replica(0, set(), die=True, before=gone.set), _Replica(1, set())
    out = _pool(monkeypatch, [dead, live]).generate(requests)
    assert live.sent == [[2]]
    assert out[0].error is not None and out[0].error.code == "cancelled"
    assert out[1].ok and out[1].prefill_tokens == 2
