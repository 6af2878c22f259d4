"""Sampling: continuous-batching generation over sampler slots, adapter versions, verified sync."""

from lorafleet.sample.engine import SampleEngine
from lorafleet.sample.types import (
    SampledSequence,
    SampleError,
    SampleRequest,
    SampleResult,
    SamplingParams,
    SequenceTrace,
    VersionKey,
)
from lorafleet.sample.verify import (
    CanaryResult,
    SyncVerificationError,
    canary_check,
    publish_verified,
)
from lorafleet.sample.versions import (
    NoFreeSlotError,
    UnknownVersionError,
    VersionError,
    VersionStore,
    VersionUnavailableError,
)

__all__ = [
    "CanaryResult",
    "NoFreeSlotError",
    "SampleEngine",
    "SampleError",
    "SampleRequest",
    "SampleResult",
    "SampledSequence",
    "SamplingParams",
    "SequenceTrace",
    "SyncVerificationError",
    "UnknownVersionError",
    "VersionError",
    "VersionKey",
    "VersionStore",
    "VersionUnavailableError",
    "canary_check",
    "publish_verified",
]
