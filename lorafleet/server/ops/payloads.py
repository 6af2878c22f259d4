"""The typed payloads of control and sample ops: what request parsing (requests.py) hands the
executor through the scheduler. They sit apart from both so that the HTTP side can build them
without importing the engine, and the engine can read them without knowing JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lorafleet.sample.types import SamplingParams, TokenHook
from lorafleet.server.state.store import CheckpointRow


@dataclass
class CreateArgs:
    session_id: str
    base_model: str
    lora: dict[str, Any]  # rank, seed, alpha, train_attn, train_mlp, train_unembed
    user_metadata: dict[str, Any] | None
    optimizer: str = "adamw"  # its optimizer family for life (adapters.hparams.OPTIMIZERS)


@dataclass
class FromStateArgs:
    session_id: str
    base_model: str | None
    checkpoint: CheckpointRow
    optimizer: bool
    user_metadata: dict[str, Any] | None
    # The request's optimizer_config family; None: the checkpoint's (restored state) or adamw.
    optimizer_family: str | None = None


@dataclass
class LoadArgs:
    checkpoint: CheckpointRow
    optimizer: bool


@dataclass
class SaveArgs:
    name: str
    overwrite: bool
    expires_at: float | None
    user_metadata: dict[str, Any] | None


@dataclass
class SaveSamplerArgs:
    name: str | None  # None: ephemeral, for save_weights_and_get_sampling_client
    sampling_session_seq_id: int | None
    expires_at: float | None
    user_metadata: dict[str, Any] | None
    inflight: bool = False  # kind="inflight": the session follows the model's later inflight saves


@dataclass
class SaveExternalArgs:
    name: str
    recipients: tuple[str, ...]  # age recipients (native or SSH keys); empty: files in the clear
    expires_at: float | None
    user_metadata: dict[str, Any] | None = None


@dataclass(frozen=True)
class PromptTargets:
    """A request's `target_prompt_logprobs`: the ids (sparse CSR densified with -1), and the
    CSR indices when it came sparse, so that the response keeps the request's layout."""

    ids: torch.Tensor  # int64 [len(prompt) - 1, K], -1 = unused
    crow: np.ndarray | None  # int64 [rows + 1]; None: the request was dense
    col: np.ndarray | None  # int64 [nnz]


@dataclass
class SampleArgs:
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
    # Progress for a streaming caller (the OpenAI routes); never part of the request's identity.
    on_token: TokenHook | None = field(default=None, compare=False, repr=False)


@dataclass
class WireDatum:
    tokens: torch.Tensor  # int64 [T]
    loss_inputs: dict[str, torch.Tensor]


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_config: dict[str, float] | None
    forward_only: bool
    data: list[WireDatum]
