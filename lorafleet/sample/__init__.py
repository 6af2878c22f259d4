"""Sampling: continuous-batching generation over sampler slots and adapter versions (the canary
that verifies a publish against the trainer is `lorafleet.verification`, above this package)."""

from lorafleet.sample.engine import SampleEngine
from lorafleet.sample.types import (
    PromptAltTokens,
    SampledSequence,
    SampleError,
    SampleRequest,
    SampleResult,
    SamplingParams,
    SequenceTrace,
    VersionKey,
)
from lorafleet.sample.versions import (
    NoFreeSlotError,
    UnknownVersionError,
    VersionError,
    VersionRetiredError,
    VersionStore,
    VersionUnavailableError,
)

__all__ = [
    "NoFreeSlotError",
    "PromptAltTokens",
    "SampleEngine",
    "SampleError",
    "SampleRequest",
    "SampleResult",
    "SampledSequence",
    "SamplingParams",
    "SequenceTrace",
    "UnknownVersionError",
    "VersionError",
    "VersionKey",
    "VersionRetiredError",
    "VersionStore",
    "VersionUnavailableError",
]
