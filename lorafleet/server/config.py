"""What a server is told at start: `ServerConfig`, plain data (the CLI's `lorafleet serve` flags
fill it; tests build it directly). Nothing here opens or starts anything."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafleet.engines import EngineConfig
from lorafleet.server.http import resource_json, schemas
from lorafleet.server.http.served import RequestLimits, prompt_bytes_cap
from lorafleet.server.ops.scheduler import (
    DEFAULT_ROUND_TOKENS,
    DEFAULT_SOLO_ROUND_TOKENS,
    STEPPING_S,
)


@dataclass
class ServerConfig:
    base_model: str
    data_dir: Path
    api_keys: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    # the base URL signed links and redirects name (http/public_url.py), never the request's
    # Host header; None: http://<host>:<port>
    public_url: str | None = None
    engine: EngineConfig | None = None  # None: defaults for `base_model`
    # retrieve_future holds this long before try_again: the SDK's read timeout for it is 45 s
    # (tinker/lib/api_future_impl.py), and each early try_again costs the client a log line
    long_poll_s: float = 40.0
    # a sample whose client hung up during a retrieve_future poll and did not poll again
    # within this many seconds is cancelled (ops/abandoned.py): its rows are freed
    abandon_grace_s: float = 5.0
    batch_window_s: float = 0.005  # lets requests that arrive together share a batch
    # a seq_id missing this long is skipped (scheduler._expire_gaps); the SDK numbers a call
    # before sending it, so a lost request would otherwise hold up its model for good
    gap_timeout_s: float = 30.0
    # where the base's tokenizer is placed for clients on this machine (None: the hub cache
    # transformers uses here, $HF_HUB_CACHE)
    tokenizer_cache: Path | None = None
    future_ttl_s: float = 24 * 3600.0
    # stability records (record_stability_info samples, for stable_reinforce): each lasts this
    # long after its last use (Tinker: a day, renewed by each training request naming it), and
    # a tenant's records take at most this many bytes (past it: 403); ops/stability.py
    stability_ttl_s: float = 24 * 3600.0
    stability_quota_bytes: int = 256 << 20
    # no heartbeat for this long: the session's models are unloaded
    session_timeout_s: float = 900.0
    # how often maintenance runs (a thread, and on requests): stale sessions, old futures, and
    # checkpoints past their TTL are deleted within about this long
    maintenance_interval_s: float = 60.0
    # start-up recovery may delete more than a crash explains (see recovery.py); off, it refuses
    allow_recovery_deletes: bool = False
    max_body_bytes: int = 64 << 20  # protobuf forward_backward bodies; the SDK sends <= 5 MB chunks
    max_json_bytes: int = 8 << 20  # every JSON body (prompts, saves, polls)
    body_timeout_s: float = 120.0  # a body that trickles in slower than this is refused (408)
    # every route's blocking work (body decoding, hashing, SQLite, intake) runs off the event
    # loop on this many worker threads, each tenant's requests in arrival order; work for a
    # body of `large_body_bytes` or more (decompressed) holds at most `large_body_workers` of
    # them, so big bodies always leave workers to small requests (http/off_loop.py)
    request_workers: int = 4
    large_body_bytes: int = 1 << 20
    large_body_workers: int = 2
    max_num_samples: int = 1024  # per asample request
    # a sample response's estimated wire size (requests.response_bytes); the server holds it
    # as Python objects until it is encoded, several times this (docs/reliability.md)
    max_response_bytes: int = 6 << 20
    max_topk_logprobs: int = 20  # topk_sample/topk_prompt_logprobs (see served.RequestLimits)
    # the bytes of text one request may hand the tokenizer: an OpenAI prompt, a chat's messages
    # together, the chat template's output; checked before the tokenizer runs. None:
    # PROMPT_BYTES_PER_TOKEN per token of the base's context (at least MIN_PROMPT_BYTES)
    max_prompt_bytes: int | None = None
    # texts (system prompts) whose KV every tenant's prompts may share in the prefix cache;
    # everything else is cached per tenant (sample/prefix_cache.py)
    public_prefixes: list[str] = field(default_factory=list)
    torch_threads: int | None = None
    # finished results: in memory up to this many bytes in all (newest kept)...
    results_memory_bytes: int = 64 << 20
    # ... each at most this big (bigger ones are read back from SQLite when polled)
    results_memory_entry_bytes: int = 1 << 20
    # in SQLite up to this many bytes in all (oldest deleted first), besides `future_ttl_s`
    results_stored_bytes: int = 1 << 30
    # kept free on the data disk so that deletions still work when it fills (disk.py); at most
    # 1/16 of the filesystem
    disk_reserve_bytes: int = 8 << 20
    # a round running, or ready work waiting, this long makes /healthz report the engine stalled
    engine_stall_s: float = 600.0
    # fair share (fair_share.py): the tokens of forward(_backward) work one engine round runs;
    # tenants take turns by weighted deficit round-robin and a bigger call runs in chunks over
    # several rounds. Bounds how long another tenant's step waits behind a big call.
    round_token_budget: int = DEFAULT_ROUND_TOKENS
    # ... and while one tenant is alone on the server (no other tenant's operation queued,
    # running or finished for SOLO_AFTER_S), a round may run this many: the small budget only
    # cost a lone tenant (its multi-turn calls lost their shared prefixes at every cut).
    # 0: off (every round takes round_token_budget).
    solo_round_token_budget: int = DEFAULT_SOLO_ROUND_TOKENS
    # ... and for this long after a tenant's training op finished (until it submits anything
    # else), a round holding one other tenant's training work alone runs one fair-share quantum
    # of it, so the stepping tenant's next call waits behind a short round. 0: off.
    stepping_s: float = STEPPING_S
    # the tenants file (tenants.py): keys as hashes, weights, operators, quotas; reloaded on
    # SIGHUP. Without one, `api_keys` are the tenants (weight 1, no quotas, no operator).
    tenants_file: Path | None = None
    # requests queued (admitted, not finished) in all; past it a request gets 429 + Retry-After
    # (admission.py), which the SDK retries
    max_queued_ops: int = 4096
    queue_retry_after_s: float = 1.0
    usage_flush_s: float = 5.0  # metering counts reach SQLite this often (metering.py)
    # the web console (console/): sign-in sessions (lifetime, how many at once), its live
    # event streams (in all, per session) and how often a stream looks for changes
    console_session_ttl_s: float = 8 * 3600.0
    console_max_sessions: int = 1024
    console_sessions_per_tenant: int = 64  # past it the tenant's own oldest session goes
    console_streams: int = 64
    console_streams_per_session: int = 4
    console_streams_per_tenant: int = 16  # one tenant's sessions together
    # of `console_streams`, the last places kept for operators, and before them for tenants
    # holding no stream yet (console/sse.py): filled per-tenant bounds lock nobody out
    console_operator_streams: int = 4
    console_newcomer_streams: int = 8
    # the share of wall time (of one core) the console's snapshots may take, all streams
    # together; more streams stretch each one's cadence instead
    console_cpu_share: float = 0.1
    console_refresh_s: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)


def request_limits(config: ServerConfig, context_length: int | None = None) -> RequestLimits:
    return RequestLimits(
        max_prompt_bytes=prompt_bytes_cap(config.max_prompt_bytes, context_length),
        max_num_samples=config.max_num_samples,
        max_response_bytes=config.max_response_bytes,
        max_topk_logprobs=config.max_topk_logprobs,
        max_metadata_keys=schemas.MAX_METADATA_KEYS,
        max_metadata_bytes=schemas.MAX_METADATA_BYTES,
        max_page=resource_json.MAX_PAGE,
        max_json_bytes=config.max_json_bytes,
        max_body_bytes=config.max_body_bytes,
    )
