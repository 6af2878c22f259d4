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


# --------------------------------------------------------------------------- entry point

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _register_models,
    _register_demo,
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
