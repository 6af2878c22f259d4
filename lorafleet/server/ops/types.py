"""The operations the server runs: one closed union, `Op`, of plain dataclasses.

An op is what a request asks for, parsed and checked as far as the request alone allows (the
HTTP stage builds it, off the event loop); a `Job` is an op as the scheduler holds it: who
asked, under which request id, and where it sits in its model's `seq_id` order.

Each op type declares, as class attributes, how the stages treat it:

- `kind`: its name in futures, stats and logs;
- `stage`: the part of an engine round that runs it (`Stage`);
- `writes_disk`: refused before it runs while the data disk is full (scheduler.py);
- `quota`: the tenant quota it draws on (quotas.py computes how much);
- `meters`: the usage counters its work adds to (metering.py counts how much).

The stages that need an op's data (quotas, metering, the executor) dispatch with `match` over
`Op` and end in `assert_never`, so a new op type that one of them forgets is a mypy error
rather than a silent default. `tests/server/ops/test_types.py` checks every member declares
its attributes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

import numpy as np
import torch

from lorafleet.adapters.hparams import OptimHParams
from lorafleet.sample.types import SamplingParams, TokenHook
from lorafleet.server.errors import ApiError
from lorafleet.server.state.store import CheckpointRow


class Stage(Enum):
    """Which part of a scheduler round runs an op (see scheduler.py)."""

    CONTROL = "control"  # one at a time, at the head of its model's order
    TRAIN = "forward_backward"  # one mixed forward(_backward) batch, shared by fair share
    OPTIM = "optim_step"  # one optimizer call for every model ready for it
    SAMPLE = "sample"  # joins the sampler's running batch


class Quota(Enum):
    """The tenant quota an op draws on (tenants.py defines the limits)."""

    NONE = "none"
    REGISTERED_RUNS = "registered_runs"  # and max_lora_rank
    TRAINED_TOKENS = "trained_tokens_per_day"
    SAMPLED_TOKENS = "sampled_tokens_per_day"
    STORAGE = "storage_bytes"


class Meter(Enum):
    """Usage counters besides compute seconds, which every op's batch shares (metering.py)."""

    PREFILL_TOKENS = "prefill_tokens"  # prompt tokens computed
    CACHED_PREFILL_TOKENS = "cached_prefill_tokens"  # prompt tokens read from the prefix cache
    SAMPLED_TOKENS = "sampled_tokens"
    TRAINED_TOKENS = "trained_tokens"
    OPTIMIZER_STEPS = "optimizer_steps"


# --------------------------------------------------------------------------- control ops


@dataclass(frozen=True)
class CreateModel:
    session_id: str
    base_model: str
    lora: dict[str, Any]  # rank, seed, alpha, train_attn, train_mlp, train_unembed
    user_metadata: dict[str, Any] | None
    optimizer: str = "adamw"  # its optimizer family for life (adapters.hparams.OPTIMIZERS)

    kind: ClassVar[str] = "create_model"
    stage: ClassVar[Stage] = Stage.CONTROL
    writes_disk: ClassVar[bool] = False
    quota: ClassVar[Quota] = Quota.REGISTERED_RUNS
    meters: ClassVar[frozenset[Meter]] = frozenset()


@dataclass(frozen=True)
class CreateFromState:
    session_id: str
    base_model: str | None
    checkpoint: CheckpointRow
    optimizer: bool  # restore the optimizer state too
    user_metadata: dict[str, Any] | None
    # The request's optimizer_config family; None: the checkpoint's (restored state) or adamw.
    optimizer_family: str | None = None

    kind: ClassVar[str] = "create_from_state"
    stage: ClassVar[Stage] = Stage.CONTROL
    writes_disk: ClassVar[bool] = False
    quota: ClassVar[Quota] = Quota.REGISTERED_RUNS
    meters: ClassVar[frozenset[Meter]] = frozenset()


@dataclass(frozen=True)
class LoadWeights:
    """The deprecated in-place `load_state`."""

    checkpoint: CheckpointRow
    optimizer: bool

    kind: ClassVar[str] = "load_weights"
    stage: ClassVar[Stage] = Stage.CONTROL
    writes_disk: ClassVar[bool] = False
    quota: ClassVar[Quota] = Quota.NONE
    meters: ClassVar[frozenset[Meter]] = frozenset()


@dataclass(frozen=True)
class SaveWeights:
    """`save_state`: the training state, optimizer included."""

    name: str
    overwrite: bool
    expires_at: float | None
    user_metadata: dict[str, Any] | None

    kind: ClassVar[str] = "save_weights"
    stage: ClassVar[Stage] = Stage.CONTROL
    writes_disk: ClassVar[bool] = True
    quota: ClassVar[Quota] = Quota.STORAGE
    meters: ClassVar[frozenset[Meter]] = frozenset()


@dataclass(frozen=True)
class SaveSampler:
    """A named sampler checkpoint, or (no name) an ephemeral version for
    `save_weights_and_get_sampling_client`, whose files back it while it is kept."""

    name: str | None
    sampling_session_seq_id: int | None
    expires_at: float | None
    user_metadata: dict[str, Any] | None
    inflight: bool = False  # kind="inflight": the session follows the model's later inflight saves

    kind: ClassVar[str] = "save_sampler"
    stage: ClassVar[Stage] = Stage.CONTROL
    writes_disk: ClassVar[bool] = True
    quota: ClassVar[Quota] = Quota.STORAGE
    meters: ClassVar[frozenset[Meter]] = frozenset()


@dataclass(frozen=True)
class SaveExternal:
    """`save_weights_external`: a PEFT export for download, age-encrypted on request."""

    name: str
    recipients: tuple[str, ...]  # age recipients (native or SSH keys); empty: files in the clear
    expires_at: float | None
    user_metadata: dict[str, Any] | None = None

    kind: ClassVar[str] = "save_external"
    stage: ClassVar[Stage] = Stage.CONTROL
    writes_disk: ClassVar[bool] = True
    quota: ClassVar[Quota] = Quota.STORAGE
    meters: ClassVar[frozenset[Meter]] = frozenset()


@dataclass(frozen=True)
class Refused:
    """A request that holds a place in its model's order but cannot run: its future fails with
    `error`, in order (a 4xx at the door would leave a gap its model's later requests wait on).
    `asked` is the kind the request wanted to be."""

    error: ApiError
    asked: str

    kind: ClassVar[str] = "refused"
    stage: ClassVar[Stage] = Stage.CONTROL
    writes_disk: ClassVar[bool] = False
    quota: ClassVar[Quota] = Quota.NONE
    meters: ClassVar[frozenset[Meter]] = frozenset()


# --------------------------------------------------------------------------- training


@dataclass
class WireDatum:
    tokens: torch.Tensor  # int64 [T]
    loss_inputs: dict[str, torch.Tensor]


@dataclass(frozen=True)
class TrainCall:
    """A forward(_backward) call: its data and loss, and its datums measured once when it was
    parsed (fair share and metering read these, never the tensors)."""

    loss_fn: str
    loss_config: dict[str, float] | None
    data: list[WireDatum]
    datum_tokens: tuple[int, ...]  # tokens of each datum: metered
    datum_costs: tuple[int, ...]  # what fair share counts of each (fair_share.datum_costs)

    def __post_init__(self) -> None:
        if not (len(self.data) == len(self.datum_tokens) == len(self.datum_costs)):
            raise ValueError(
                f"a call of {len(self.data)} datums measured as {len(self.datum_tokens)} "
                f"(tokens) and {len(self.datum_costs)} (costs)"
            )

    @property
    def tokens(self) -> int:
        return sum(self.datum_tokens)


@dataclass(frozen=True)
class Forward(TrainCall):
    kind: ClassVar[str] = "forward"
    stage: ClassVar[Stage] = Stage.TRAIN
    writes_disk: ClassVar[bool] = False
    quota: ClassVar[Quota] = Quota.NONE
    meters: ClassVar[frozenset[Meter]] = frozenset({Meter.PREFILL_TOKENS})


@dataclass(frozen=True)
class ForwardBackward(TrainCall):
    kind: ClassVar[str] = "forward_backward"
    stage: ClassVar[Stage] = Stage.TRAIN
    writes_disk: ClassVar[bool] = False
    quota: ClassVar[Quota] = Quota.TRAINED_TOKENS
    meters: ClassVar[frozenset[Meter]] = frozenset({Meter.TRAINED_TOKENS})


@dataclass(frozen=True)
class OptimStep:
    hparams: OptimHParams

    kind: ClassVar[str] = "optim_step"
    stage: ClassVar[Stage] = Stage.OPTIM
    writes_disk: ClassVar[bool] = False
    quota: ClassVar[Quota] = Quota.NONE
    meters: ClassVar[frozenset[Meter]] = frozenset({Meter.OPTIMIZER_STEPS})


# --------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class PromptTargets:
    """A request's `target_prompt_logprobs`: the ids (sparse CSR densified with -1), and the
    CSR indices when it came sparse, so that the response keeps the request's layout."""

    ids: torch.Tensor  # int64 [len(prompt) - 1, K], -1 = unused
    crow: np.ndarray | None  # int64 [rows + 1]; None: the request was dense
    col: np.ndarray | None  # int64 [nnz]


@dataclass(frozen=True)
class Recording:
    """A sample taken with `record_stability_info=true`: whose session its record belongs to
    and the tenant's record quota in bytes (server/ops/stability.py)."""

    session_id: str
    quota_bytes: int


@dataclass(frozen=True)
class Sample:
    prompt: list[int]
    params: SamplingParams
    num_samples: int
    prompt_logprobs: bool
    topk_prompt: int
    topk_sample: int
    last_n: int | None
    adapter: tuple[str, int] | None  # sampler version key; None = base model
    checkpoint_path: str | None  # tinker path whose files back `adapter` (None: ephemeral)
    targets: PromptTargets | None = None
    alt_k: int = 0  # prompt_alt_tokens_k
    record: Recording | None = None  # record_stability_info: keep a stability record
    # Progress for a streaming caller (the OpenAI routes); never part of the request's identity.
    on_token: TokenHook | None = field(default=None, compare=False, repr=False)
    # Set when the client is gone (a closed stream, an abandoned long-poll): the sampler drops
    # the request's rows at its next step; the tokens it produced are still metered.
    cancel: threading.Event | None = field(default=None, compare=False, repr=False)

    kind: ClassVar[str] = "sample"
    stage: ClassVar[Stage] = Stage.SAMPLE
    writes_disk: ClassVar[bool] = False
    quota: ClassVar[Quota] = Quota.SAMPLED_TOKENS
    meters: ClassVar[frozenset[Meter]] = frozenset(
        {Meter.PREFILL_TOKENS, Meter.CACHED_PREFILL_TOKENS, Meter.SAMPLED_TOKENS}
    )


# --------------------------------------------------------------------------- the union

ControlOp = (
    CreateModel | CreateFromState | LoadWeights | SaveWeights | SaveSampler | SaveExternal | Refused
)
TrainOp = Forward | ForwardBackward
Op = ControlOp | TrainOp | OptimStep | Sample
"""Every operation the scheduler runs. Adding one: a dataclass here with the five class
attributes, a member of this union, and then whatever mypy reports missing in the stages."""


@dataclass(eq=False)
class Job:
    """An op as queued: `request_id` names its future; `seq_id` (None: not ordered) places it in
    its model's order; `scope` is what batching counts as one client (a model or a sampling
    session)."""

    request_id: str
    tenant: str
    op: Op
    model_id: str | None = None
    seq_id: int | None = None
    scope: str | None = None
    submitted: float = field(default_factory=time.monotonic)

    @property
    def kind(self) -> str:
        return self.op.kind


def train_op(job: Job) -> TrainOp:
    """The job's op as the training call the scheduler routed it as (`Stage.TRAIN`)."""
    if isinstance(job.op, Forward | ForwardBackward):
        return job.op
    raise TypeError(f"{job.request_id} is a {job.op.kind} op, not a forward(_backward) call")


def optim_op(job: Job) -> OptimStep:
    if isinstance(job.op, OptimStep):
        return job.op
    raise TypeError(f"{job.request_id} is a {job.op.kind} op, not an optim_step")


def sample_op(job: Job) -> Sample:
    if isinstance(job.op, Sample):
        return job.op
    raise TypeError(f"{job.request_id} is a {job.op.kind} op, not a sample")
