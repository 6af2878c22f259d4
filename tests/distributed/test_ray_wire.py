"""What a Ray sampler replica receives: a request without its process-local parts (the server
sets a cancel event on every Tinker sample, and a thread event cannot be pickled), and nothing
at all for a request cancelled before it was sent. No Ray cluster needed."""

from __future__ import annotations

import pickle
import threading

from lorafleet.distributed.ray_samplers import _cancelled, _for_replica
from lorafleet.sample.types import SampleRequest, SamplingParams


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
