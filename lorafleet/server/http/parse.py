"""Parsing JSON requests into the typed ops the scheduler runs (ops/types.py).

Everything here is a pure function of the request (and of the served base's limits): no store,
no engine. A `UserError` raised here either refuses the request at the door or, once the request
holds a seq_id in its model's order, becomes the failed result of its future (see intake.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import time
from typing import Any

from lorafleet.adapters.hparams import DimuonHParams, OptimHParams
from lorafleet.sample.types import SamplingParams
from lorafleet.sample.validate import MAX_SEED, MIN_TEMPERATURE
from lorafleet.server.errors import UserError
from lorafleet.server.http import prompt_targets, schemas
from lorafleet.server.http.served import RequestLimits, ServedBase
from lorafleet.server.ops.types import (
    CreateModel,
    OptimStep,
    Recording,
    Sample,
    SaveSampler,
    SaveWeights,
)
from lorafleet.server.state.paths import checkpoint_name
from lorafleet.train.optim import AdamHParams

ADAM_FIELDS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
DIMUON_FIELDS = ("learning_rate", "grad_clip_norm", "beta1")  # SDK 0.38's DimuonParams


def fingerprint(data: bytes | Any) -> str:
    """What makes a retry "the same request" for seq_id dedup: the body's bytes, or its JSON
    with sorted keys."""
    raw = (
        data if isinstance(data, bytes) else json.dumps(data, sort_keys=True, default=str).encode()
    )
    return hashlib.sha256(raw).hexdigest()


def unzstd(raw: bytes, limit: int) -> bytes:
    """Decompresses at most `limit` bytes: a frame's declared size is not trusted (zstandard's
    one-shot `decompress` allocates whatever the header claims, a few KB can ask for GBs)."""
    import zstandard

    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(
            io.BytesIO(raw), read_across_frames=True
        ) as reader:
            while chunk := reader.read(min(1 << 20, limit + 1 - len(out))):
                out += chunk
                if len(out) > limit:
                    raise UserError(
                        f"the zstd request body decompresses to more than this server's limit of {limit} bytes",
                        status=413,
                    )
    except zstandard.ZstdError as exc:
        raise UserError(f"request body is not valid zstd: {exc}") from None
    if not out and raw:
        raise UserError("request body is not valid zstd: no complete frame")
    return bytes(out)


def decode_body(raw: bytes, content_encoding: str | None, limit: int) -> bytes:
    """The body as sent before its Content-Encoding (identity or zstd)."""
    if content_encoding and content_encoding.lower() not in ("identity",):
        if content_encoding.lower() != "zstd":
            raise UserError(f"Content-Encoding {content_encoding!r} is not supported (only zstd)")
        return unzstd(raw, limit)
    return raw


def expires_at(ttl_seconds: int | None) -> float | None:
    if ttl_seconds is None:
        return None
    if ttl_seconds < 1:
        raise UserError(f"ttl_seconds must be >= 1 (or null for no expiry), got {ttl_seconds}")
    return time.time() + ttl_seconds


def optimizer_family(optimizer_config: dict[str, Any] | None) -> str:
    """The optimizer family a model is created with: `{"type": "adamw"}` (the default) or
    SDK 0.38's `{"type": "dimuon", "version": 1}`; anything else is refused by name."""
    config = dict(optimizer_config or {})
    kind = config.pop("type", "adamw")
    if kind in ("adam", "adamw"):
        extra = sorted(config)
    elif kind == "dimuon":
        version = config.pop("version", 1)
        if isinstance(version, bool) or version != 1:
            raise UserError(
                f"optimizer_config.version {version!r} of dimuon is not supported (only 1)"
            )
        extra = sorted(config)
    else:
        raise UserError(
            f"optimizer_config.type {kind!r} is not supported by this server (supported: adamw, "
            "dimuon)"
        )
    if extra:
        raise UserError(f"optimizer_config has unknown field(s) {extra} for type {kind!r}")
    return "dimuon" if kind == "dimuon" else "adamw"


def check_optimizer_type(optimizer_config: dict[str, Any] | None) -> None:
    optimizer_family(optimizer_config)


def optim_step(params: dict[str, Any]) -> OptimStep:
    """An optim_step's hyper-parameters: AdamParams (`adam_params`, no type) or a typed
    `optimizer_params` (only dimuon in SDK 0.38). Whether they fit the model's optimizer is
    checked when the step runs, where the model is known."""
    kind = params.get("type")
    hparams: OptimHParams = dimuon_hparams(params) if kind == "dimuon" else adam_hparams(params)
    return OptimStep(hparams)


def dimuon_hparams(params: dict[str, Any]) -> DimuonHParams:
    params = dict(params)
    params.pop("type")
    unknown = sorted(set(params) - set(DIMUON_FIELDS))
    if unknown:
        raise UserError(
            f"optimizer_params has unknown field(s) {unknown} for dimuon; known: "
            f"{', '.join(DIMUON_FIELDS)}"
        )
    if "learning_rate" not in params:
        raise UserError("optimizer_params.learning_rate is required for dimuon")
    values: dict[str, float] = {}
    for key, value in params.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UserError(f"optimizer_params.{key} must be a number, got {value!r}")
        values[key] = float(value)
    hp = DimuonHParams(**values)
    try:
        hp.validate()
    except ValueError as exc:
        raise UserError(f"optimizer_params: {exc}") from None
    return hp


def adam_hparams(params: dict[str, Any]) -> AdamHParams:
    params = dict(params)
    kind = params.pop("type", None)
    if kind not in (None, "adam", "adamw"):
        raise UserError(
            f"optimizer {kind!r} is not supported by this server (supported: adamw via "
            "adam_params, dimuon via optimizer_params)"
        )
    unknown = sorted(set(params) - set(ADAM_FIELDS))
    if unknown:
        raise UserError(
            f"adam_params has unknown field(s) {unknown}; known: {', '.join(ADAM_FIELDS)}"
        )
    values: dict[str, float] = {}
    for key, value in params.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UserError(f"adam_params.{key} must be a number, got {value!r}")
        values[key] = float(value)
    values.setdefault("learning_rate", 1e-4)
    hp = AdamHParams(**values)
    try:
        hp.validate()
    except ValueError as exc:
        raise UserError(f"adam_params: {exc}") from None
    return hp


def create_args(req: schemas.CreateModel, served: ServedBase) -> CreateModel:
    lora = req.lora_config
    r_max = served.max_lora_rank
    if not 1 <= lora.rank <= r_max:
        raise UserError(
            f"lora_config.rank must be between 1 and {r_max} on this server, got {lora.rank}"
        )
    if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
        raise UserError(
            "lora_config: train_attn, train_mlp and train_unembed are all false; nothing would train"
        )
    lora_dict = {**lora.model_dump(), "alpha": served.lora_alpha}
    return CreateModel(
        req.session_id,
        req.base_model,
        lora_dict,
        req.user_metadata,
        optimizer=optimizer_family(req.optimizer_config),
    )


def user_metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """The bounds of schemas.UserMetadata, for requests that hold a seq_id: their errors must
    fail the request's future (a 400 at the door would leave a gap in the model's order)."""
    if value is None:
        return None
    try:
        return schemas.bounded_metadata(value)
    except ValueError as exc:
        raise UserError(f"user_metadata {exc}") from None


def save_args(req: schemas.SaveWeights) -> SaveWeights:
    return SaveWeights(
        checkpoint_name(req.path),
        req.overwrite,
        expires_at(req.ttl_seconds),
        user_metadata(req.user_metadata),
    )


def save_sampler_args(req: schemas.SaveWeightsForSampler) -> SaveSampler:
    if req.path is None and req.sampling_session_seq_id is None:
        raise UserError("save_weights_for_sampler needs a path (name) or a sampling_session_seq_id")
    if req.kind not in ("snapshot", "inflight"):
        raise UserError(f"kind must be 'snapshot' or 'inflight', got {req.kind!r}")
    if req.kind == "inflight" and req.path is not None:
        raise UserError(
            f"kind 'inflight' is for save_weights_and_get_sampling_client (no path); the named sampler "
            f"checkpoint {req.path!r} can only be a snapshot"
        )
    name = None if req.path is None else checkpoint_name(req.path)
    return SaveSampler(
        name,
        req.sampling_session_seq_id,
        expires_at(req.ttl_seconds),
        user_metadata(req.user_metadata),
        inflight=req.kind == "inflight",
    )


def check_num_samples(num_samples: int, max_num_samples: int) -> None:
    if not 1 <= num_samples <= max_num_samples:
        raise UserError(f"num_samples must be between 1 and {max_num_samples}, got {num_samples}")


# Stop strings are checked at every sampled token of every row, over a decoded window of 4
# tokens per character of the longest one (sample/stops.py): their number and length are a
# cost inside the shared sampling step, so they are bounded like any other field.
MAX_STOP_ENTRIES = 64
MAX_STOP_CHARS = 128


def check_stop(stop: str | list[str] | list[int] | None, field: str) -> None:
    """At most MAX_STOP_ENTRIES stops, strings of at most MAX_STOP_CHARS characters each."""
    if stop is None:
        return
    entries = [stop] if isinstance(stop, str) else list(stop)
    if len(entries) > MAX_STOP_ENTRIES:
        raise UserError(
            f"{field} holds {len(entries)} entries; this server takes at most {MAX_STOP_ENTRIES}"
        )
    for i, entry in enumerate(entries):
        if isinstance(entry, str) and len(entry) > MAX_STOP_CHARS:
            where = field if isinstance(stop, str) else f"{field}[{i}]"
            raise UserError(
                f"{where} is {len(entry)} characters long; this server takes stop strings of at "
                f"most {MAX_STOP_CHARS} characters"
            )


# Wire bytes of a SampleResponse (engine/responses.sample_response): each sampled token is an int32 id and
# a float32 logprob, each top-k entry the same pair, each prompt logprob a float32; a sequence's
# own framing is generously rounded up.
TOKEN_BYTES = 8
TOPK_ENTRY_BYTES = 8
PROMPT_LOGPROB_BYTES = 4
SEQUENCE_BYTES = 32


def response_bytes(args: Sample, max_new_tokens: int) -> int:
    """The most a sample response can take on the wire, from the request alone: every sample
    runs to `max_new_tokens` (a stop may end it sooner, never later)."""
    prompt_len = len(args.prompt)
    sampled = args.num_samples * (
        SEQUENCE_BYTES + max_new_tokens * (TOKEN_BYTES + args.topk_sample * TOPK_ENTRY_BYTES)
    )
    prompt = prompt_len * (
        (PROMPT_LOGPROB_BYTES if args.prompt_logprobs else 0)
        + (args.topk_prompt + args.alt_k) * TOPK_ENTRY_BYTES
    )
    if args.targets is not None:
        prompt += int(args.targets.ids.numel()) * TOPK_ENTRY_BYTES
    return sampled + prompt


def check_sample_cost(args: Sample, limits: RequestLimits, context_length: int | None) -> None:
    """Refuses a sample request whose response could exceed this server's caps, before it runs:
    its size is known from the request, and the memory it takes grows with it."""
    cap = limits.max_topk_logprobs
    for field, k in (
        ("topk_sample_logprobs", args.topk_sample),
        ("topk_prompt_logprobs", args.topk_prompt),
    ):
        if k > cap:
            raise UserError(f"{field} must be at most {cap} on this server, got {k}")
    max_new = args.params.max_tokens
    if max_new is None:
        if context_length is None:
            raise UserError(
                "sampling_params.max_tokens is required: this server cannot bound the response otherwise"
            )
        max_new = max(context_length - len(args.prompt), 0)
    size = response_bytes(args, max_new)
    if size > limits.max_response_bytes:
        what = f"num_samples {args.num_samples} x max_tokens {max_new}"
        if args.params.max_tokens is None:
            what += " (unset: the rest of the context)"
        if args.topk_sample:
            what += f" x (1 + topk_sample_logprobs {args.topk_sample})"
        raise UserError(
            f"this sample request could return {size} bytes ({what} x {TOKEN_BYTES} bytes, plus the "
            f"prompt's logprobs), more than this server's limit of {limits.max_response_bytes} bytes "
            "per response; ask for fewer samples or tokens, or split the request"
        )


def sample_args(
    req: schemas.Sample,
    adapter: tuple[str, int] | None,
    checkpoint_path: str | None,
    record: Recording | None = None,
) -> Sample:
    """`record`: where a `record_stability_info=true` sample's record goes (its caller checks
    that the request has a session to record for)."""
    prompt: list[int] = []
    for i, chunk in enumerate(req.prompt.chunks):
        if chunk.type != "encoded_text" or chunk.tokens is None:
            raise UserError(
                f"prompt.chunks[{i}] is a {chunk.type!r} chunk; this server takes encoded_text only"
            )
        prompt += chunk.tokens
    targets = (
        None
        if req.target_prompt_logprobs is None
        else prompt_targets.parse_targets(req.target_prompt_logprobs, len(prompt))
    )
    alt_k = prompt_targets.check_alt_tokens_k(req.prompt_alt_tokens_k, len(prompt))
    wants_prompt = bool(req.prompt_logprobs)
    last_n = req.prompt_logprobs_last_n
    if last_n is not None:
        if not (wants_prompt or req.topk_prompt_logprobs):
            raise UserError("prompt_logprobs_last_n needs prompt_logprobs=true")
        if not 1 <= last_n <= len(prompt) - 1:
            raise UserError(
                f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {len(prompt) - 1}, got {last_n}"
            )
    p = req.sampling_params
    check_stop(p.stop, "sampling_params.stop")
    for name, value in (("temperature", p.temperature), ("top_p", p.top_p)):
        if not math.isfinite(value):
            raise UserError(f"sampling_params.{name} must be finite, got {value!r}")
    if p.temperature < 0:
        raise UserError(f"sampling_params.temperature must be >= 0, got {p.temperature!r}")
    if not 0 < p.top_p <= 1:
        raise UserError(f"sampling_params.top_p must be in (0, 1], got {p.top_p!r}")
    if p.seed is not None and not -MAX_SEED < p.seed < MAX_SEED:
        raise UserError(
            f"sampling_params.seed must be a 64-bit integer, got one of {p.seed.bit_length()} bits"
        )
    # (as the sampler does: below it, float32 logits / temperature overflow)
    temperature = MIN_TEMPERATURE if 0 < p.temperature < MIN_TEMPERATURE else p.temperature
    params = SamplingParams(
        max_tokens=p.max_tokens,
        temperature=temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        stop=p.stop,
        seed=p.seed,
    )
    return Sample(
        prompt=prompt,
        params=params,
        num_samples=req.num_samples,
        prompt_logprobs=wants_prompt,
        topk_prompt=req.topk_prompt_logprobs,
        topk_sample=req.topk_sample_logprobs,
        last_n=last_n,
        adapter=adapter,
        checkpoint_path=checkpoint_path,
        targets=targets,
        alt_k=alt_k,
        record=record,
    )
