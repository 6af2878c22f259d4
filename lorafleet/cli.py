"""`lorafleet` command line.

To add a command: write a `_register_<name>(subparsers)` function that adds a parser and
sets `func` (a callable taking the parsed args and returning an exit code) via
`set_defaults`, then append it to `COMMANDS`. Heavy imports belong inside the command
functions so that `lorafleet --help` and `lorafleet models list` stay instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from lorafleet.model.presets import PRESETS, PresetUnavailableError

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


# --------------------------------------------------------------------------- demo


def _cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lorafleet.demo import run_demo

    run_demo(args.base_model, dtype=args.dtype, steps=args.steps, out_dir=Path(args.out))
    return 0


def _register_demo(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="four adapters train in shared mixed batches")
    parser.add_argument("--base-model", default="smollm2-135m", help="preset name or local HF dir")
    parser.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16")
    parser.add_argument("--steps", type=int, default=8, help="training steps")
    parser.add_argument("--out", default="runs/demo", help="where the PEFT adapters are written")
    parser.set_defaults(func=_cmd_demo)


# --------------------------------------------------------------------------- serve


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from lorafleet.server.auth import load_keys
    from lorafleet.server.executor import EngineConfig
    from lorafleet.server.main import serve
    from lorafleet.server.service import ServerConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = EngineConfig(
        base_model=args.base_model,
        dtype=args.dtype,
        max_adapters=args.max_adapters,
        sampler_slots=args.sampler_slots,
        max_lora_rank=args.max_lora_rank,
        lora_alpha=args.lora_alpha,
    )
    config = ServerConfig(
        base_model=args.base_model,
        data_dir=Path(args.data_dir),
        api_keys=load_keys(args.api_key_file),
        host=args.host,
        port=args.port,
        engine=engine,
        torch_threads=args.torch_threads,
        batch_window_s=args.batch_window_ms / 1000.0,
    )
    serve(config)
    return 0


def _register_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve the Tinker API (SDK 0.38) for many tenants' adapters")
    parser.add_argument("--base-model", required=True, help="preset name or local HF model directory")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--data-dir", required=True, help="SQLite state and adapter files (created 0700)")
    parser.add_argument("--api-key-file", default=None, help="file with one tml-... key per line (adds to $LORAFLEET_API_KEYS)")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    parser.add_argument("--max-adapters", type=int, default=8, help="training adapters held at once")
    parser.add_argument("--sampler-slots", type=int, default=16, help="sampler versions held in memory at once")
    parser.add_argument("--max-lora-rank", type=int, default=32)
    parser.add_argument("--lora-alpha", type=float, default=32.0)
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument(
        "--batch-window-ms", type=float, default=5.0, help="wait this long for more requests before each engine round"
    )
    parser.set_defaults(func=_cmd_serve)


# --------------------------------------------------------------------------- entry point

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _register_models,
    _register_demo,
    _register_serve,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lorafleet", description="Multi-tenant LoRA post-training on one frozen base model."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in COMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as err:
        print(f"lorafleet: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
