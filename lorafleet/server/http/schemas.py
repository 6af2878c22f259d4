"""JSON request bodies the SDK sends, as lenient pydantic models (unknown keys ignored: newer SDKs
add fields), and one parse function whose errors name the field and the offending value.

Integers that reach SQLite (seq ids, offsets) are bounded to int64 here, and a TTL to what a
timestamp can hold, so a hostile value is a 400 naming the field rather than an overflow deep
in the store.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
)

from lorafleet.server.errors import UserError
from lorafleet.server.http.text_check import check_text

M = TypeVar("M", bound=BaseModel)

INT64_MAX = 2**63 - 1
MAX_TTL_SECONDS = 10**10  # ~300 years: past that a timestamp stops being representable
SeqId = Annotated[StrictInt, Field(ge=1, le=INT64_MAX)]
Counter = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
Int64 = Annotated[StrictInt, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
Ttl = Annotated[StrictInt, Field(le=MAX_TTL_SECONDS)]
# user_metadata is stored with its session, model or checkpoint and shown again in every
# listing row (a run row carries its own and its last two checkpoints'), so these bounds times
# the page size bound a listing: 1000 rows x 3 x 4 KiB
MAX_METADATA_KEYS = 64
MAX_METADATA_BYTES = 4 << 10
MAX_LABEL_CHARS = 1024  # a session's project id, display name, SDK version and each tag
MAX_TAGS = 64


def bounded_metadata(value: dict[str, Any]) -> dict[str, Any]:
    if len(value) > MAX_METADATA_KEYS:
        raise ValueError(
            f"has {len(value)} keys, more than this server's limit of {MAX_METADATA_KEYS}"
        )
    try:
        size = len(json.dumps(value, ensure_ascii=False).encode())
    except (RecursionError, ValueError, TypeError):
        raise ValueError("is not plain JSON (nested too deeply?)") from None
    if size > MAX_METADATA_BYTES:
        raise ValueError(
            f"is {size} bytes as JSON, more than this server's limit of {MAX_METADATA_BYTES}"
        )
    return value


UserMetadata = Annotated[dict[str, Any], AfterValidator(bounded_metadata)]
Label = Annotated[str, Field(max_length=MAX_LABEL_CHARS)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


def parse_json(raw: bytes) -> Any:
    """The body as JSON; a string in it that is not valid Unicode (a lone surrogate escape) is
    a 400 naming its field (text_check.py), before any parser, tokenizer or store sees it."""
    try:
        value = json.loads(raw) if raw else {}
    except RecursionError:
        raise UserError("request body is not acceptable JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, integers of > 4300 digits
        raise UserError(f"request body is not valid JSON: {str(exc)[:200]}") from None
    check_text(raw, value)
    return value


def _show(value: Any) -> str:
    try:
        return json.dumps(value, default=str)[:80]
    except (RecursionError, ValueError):
        return type(value).__name__


def parse(model: type[M], data: Any) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors()[:5]:
            where = ".".join(str(p) for p in err["loc"]) or "body"
            value = err.get("input")
            shown = "" if err["type"] == "missing" else f" (got {_show(value)})"
            problems.append(f"{where}: {err['msg']}{shown}")
        raise UserError(f"invalid {model.__name__} request: " + "; ".join(problems)) from None


class CreateSession(_Body):
    tags: Annotated[list[Label], Field(max_length=MAX_TAGS)] = Field(default_factory=list)
    user_metadata: UserMetadata | None = None
    sdk_version: Label | None = None
    project_id: Label | None = None
    display_name: Label | None = None


class SessionRef(_Body):
    session_id: str


class FinishSession(_Body):
    reason: dict[str, Any] | None = None
    detail: str | None = None


class LoraConfig(_Body):
    rank: StrictInt = 32
    seed: Int64 | None = None
    train_unembed: StrictBool = True
    train_mlp: StrictBool = True
    train_attn: StrictBool = True


class CreateModel(_Body):
    session_id: str
    model_seq_id: Counter
    base_model: str
    lora_config: LoraConfig = Field(default_factory=LoraConfig)
    user_metadata: UserMetadata | None = None
    optimizer_config: dict[str, Any] | None = None


class ModelRef(_Body):
    model_id: str


class OptimStep(_Body):
    model_id: str
    seq_id: SeqId
    optim_params: dict[str, Any] = Field(
        validation_alias=AliasChoices("optim_params", "adam_params", "optimizer_params")
    )


class SaveWeights(_Body):
    model_id: str
    seq_id: SeqId
    path: str
    overwrite: StrictBool = False
    ttl_seconds: Ttl | None = None
    user_metadata: dict[str, Any] | None = None  # bounded in requests.py (seq_id order)


class SaveWeightsForSampler(_Body):
    model_id: str
    seq_id: SeqId
    path: str | None = None
    sampling_session_seq_id: Counter | None = None
    kind: str = "snapshot"
    ttl_seconds: Ttl | None = None
    user_metadata: dict[str, Any] | None = None  # bounded in requests.py (seq_id order)


class LoadWeights(_Body):
    path: str
    optimizer: StrictBool = False
    model_id: str | None = None
    seq_id: SeqId | None = None
    session_id: str | None = None
    model_seq_id: Counter | None = None
    base_model: str | None = None
    user_metadata: UserMetadata | None = None
    optimizer_config: dict[str, Any] | None = None
    weights_access_token: str | None = None


class CreateSamplingSession(_Body):
    session_id: str
    sampling_session_seq_id: Counter
    base_model: str | None = None
    model_path: str | None = None


class Chunk(_Body):
    type: str = "encoded_text"
    tokens: list[StrictInt] | None = None


class ModelInput(_Body):
    chunks: list[Chunk]


class SamplingParams(_Body):
    max_tokens: StrictInt | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | list[StrictInt] | None = None
    temperature: float = 1.0
    top_k: StrictInt = -1
    top_p: float = 1.0


class Sample(_Body):
    prompt: ModelInput
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    num_samples: StrictInt = 1
    sampling_session_id: str | None = None
    seq_id: Int64 | None = None
    base_model: str | None = None
    model_path: str | None = None
    prompt_logprobs: StrictBool | None = None
    topk_prompt_logprobs: StrictInt = 0
    topk_sample_logprobs: StrictInt = 0
    prompt_logprobs_last_n: StrictInt | None = None
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: StrictInt = 0
    record_stability_info: StrictBool | None = None


class RetrieveFuture(_Body):
    request_id: str
    allow_metadata_only: bool = False


class WeightsInfo(_Body):
    tinker_path: str


class SetTtl(_Body):
    ttl_seconds: Ttl | None = None


# ------------------------------------------------------------------ external weights, copies, sessions
class SaveWeightsExternal(_Body):
    model_id: str
    seq_id: SeqId
    path: str
    ttl_seconds: Ttl | None = None
    age_encryption_recipients: list[str] | None = None


class CopyWeights(_Body):
    source_path: str
    session_id: str | None = None
    model_seq_id: Counter | None = None
    destination_project_id: Label | None = None  # becomes the copy's session's project_id
    ttl_seconds: Ttl | None = None
    weights_access_token: str | None = None


class AssignProject(_Body):
    project_id: str


class SearchOwner(_Body):
    type: str = "own"
    owner_urns: list[str] | None = None


class SearchCursor(_Body):
    last_created_at: str
    last_session_id: str


class SessionSearch(_Body):
    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = Field(default_factory=dict)
    display_name: str | None = None
    owner: SearchOwner = Field(default_factory=SearchOwner)
    statuses: list[dict[str, Any]] | None = None
    limit: Annotated[StrictInt, Field(ge=1, le=200)] = 50
    cursor: SearchCursor | None = None
