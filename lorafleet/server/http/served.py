"""What this server serves, as the HTTP side sees it: the base model's names and limits, read
once from the executor when it is built, so that request checks never reach into the engine;
and the per-request size caps (`RequestLimits`), which clients can read from the server's
capabilities before they send something too big."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from lorafleet.server.errors import UserError


@dataclass(frozen=True)
class ServedBase:
    base_id: str  # preset name or absolute directory: what checkpoints record
    base_path: Path  # the directory (a server path: never shown to tenants as a tokenizer id)
    arch: str
    context_length: int | None
    max_lora_rank: int
    lora_alpha: float
    limits: RequestLimits
    tokenizer_id: str  # hub-style name the tokenizer loads by (model.hub_cache.publish_tokenizer)

    @property
    def names(self) -> list[str]:
        """The names `get_server_capabilities` lists: the preset name, or for a base served from
        a directory the hub-style name its tokenizer is placed under. Never the directory, a
        server path; a client that still sends it is served all the same (`check`)."""
        public = self.tokenizer_id if Path(self.base_id).is_absolute() else self.base_id
        return [public]

    def check(self, name: str | None, field: str = "base_model") -> str:
        """The base is addressable by its listed name, by `base_id`, and by its directory (older
        clients loaded the tokenizer from the directory, the one name that worked offline)."""
        if isinstance(name, str) and name in (*self.names, self.base_id, str(self.base_path)):
            return name
        if isinstance(name, str) and name and ("/" in name or name.startswith("~")):
            try:
                if Path(name).expanduser().resolve() == self.base_path.resolve():
                    return name
            except (OSError, RuntimeError, ValueError):  # ValueError: a NUL byte in the name
                pass
        raise UserError(
            f"{field} {name!r} is not served here; this server serves {self.base_id!r} "
            "(get_server_capabilities lists its names)"
        )


# Text per token a prompt that fits the context may reasonably hold: English runs about 4 bytes
# a token and code 3; 8 leaves room for whitespace runs and non-Latin scripts. A text over
# the cap is refused before the tokenizer runs, whose time and memory grow with the bytes (a
# 7.5 MB prompt took 8 s and 870 MB to be refused once tokenized).
PROMPT_BYTES_PER_TOKEN = 8
MIN_PROMPT_BYTES = 64 << 10
UNKNOWN_CONTEXT_PROMPT_BYTES = 1 << 20


def prompt_bytes_cap(configured: int | None, context_length: int | None) -> int:
    """`max_prompt_bytes`: the configured cap, else PROMPT_BYTES_PER_TOKEN per context token."""
    if configured is not None:
        if isinstance(configured, bool) or configured < 1:
            raise ValueError(f"max_prompt_bytes must be >= 1, got {configured!r}")
        return configured
    if context_length is None:
        return UNKNOWN_CONTEXT_PROMPT_BYTES
    return max(MIN_PROMPT_BYTES, PROMPT_BYTES_PER_TOKEN * context_length)


@dataclass(frozen=True)
class RequestLimits:
    """Caps on what one request may cost, checked before any work starts (and reported to
    clients as `lorafleet_limits` in `get_server_capabilities`).

    A sample response is bounded by its wire size, estimated from the request alone
    (`requests.response_bytes`): the server holds each sampled token and top-k entry as Python
    objects until the response is encoded, several times its wire size, so this cap is what
    bounds a request's memory. Top-k lists are capped on their own because their cost is per
    token and per sample; 20 is what vLLM and OpenAI-style APIs allow by default, enough for
    distillation and entropy estimates. Metadata is stored per session, model and checkpoint
    and shown again in every listing row, so its bound times the page size bounds a listing."""

    max_num_samples: int
    max_response_bytes: int
    max_prompt_bytes: int  # text handed to the tokenizer per request (prompt_bytes_cap)
    max_topk_logprobs: int
    max_metadata_keys: int
    max_metadata_bytes: int
    max_page: int
    max_json_bytes: int
    max_body_bytes: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
