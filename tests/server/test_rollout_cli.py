"""`--rollout-engine` / `--sync` on `lorafleet serve` and `lorafleet rl`: an impossible pair is
a clear error naming both values before anything starts, and the option reaches the engine
config (serve) or the embedded server's config (rl). Fast: nothing is loaded."""

from __future__ import annotations

import pytest

from lorafleet import cli
from lorafleet.sync.base import SyncMode


@pytest.mark.parametrize(
    ("command", "spec", "sync", "message"),
    [
        ("serve", "vllm=spawn", "merged", "'vllm=spawn' cannot sync by --sync 'merged'"),
        ("serve", "embedded", "files", "'embedded' cannot sync by --sync 'files'"),
        ("rl", "sglang=spawn:2", None, "only vllm can be spawned"),
        ("rl", "vllm=spawn:99", None, "spawn:N takes N from 1 to 16"),
    ],
)
def test_an_impossible_rollout_option_is_a_clear_error(
    tmp_path, capsys, command, spec, sync, message
):
    argv = [command, "--base-model", "tiny-qwen3", "--rollout-engine", spec]
    argv += ["--data-dir", str(tmp_path / "data")] if command == "serve" else []
    argv += ["--run-dir", str(tmp_path / "run")] if command == "rl" else []
    argv += [] if sync is None else ["--sync", sync]
    with pytest.raises(SystemExit, match=message) as exc:
        cli.main(argv)
    assert str(exc.value).startswith(f"lorafleet {command}: ")
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def test_rl_hands_the_rollout_engine_to_its_embedded_server_only(tmp_path):
    args = cli.build_parser().parse_args(
        ["rl", "--rollout-engine", "vllm=spawn:2", "--rollout-max-loras", "3"]
    )
    config = cli._rollout_config(args, "rl")
    assert config is not None
    assert (config.engine, config.spawn, config.sync, config.max_loras) == (
        "vllm",
        2,
        SyncMode.FILES,
        3,
    )
    embedded = cli.build_parser().parse_args(["rl"])
    assert cli._rollout_config(embedded, "rl") is None  # the embedded sampler, as before
    with pytest.raises(SystemExit, match="a --base-url server has its own"):
        cli.main(
            [
                *("rl", "--rollout-engine", "vllm=spawn"),
                *("--base-url", "http://127.0.0.1:9", "--run-dir", str(tmp_path / "run")),
            ]
        )


def test_auto_dtype_is_fp32_with_an_external_rollout_engine(capsys):
    """At bf16's canary tolerance a stale version could pass for the new one; an explicit
    --dtype still wins, and the embedded sampler keeps the machine's choice."""
    args = cli.build_parser().parse_args(
        ["serve", "--base-model", "x", "--data-dir", "d", "--rollout-engine", "vllm=spawn"]
    )
    rollout = cli._rollout_config(args, "serve")
    assert cli._rollout_dtype("auto", rollout) == "float32"
    assert "external rollout engine" in capsys.readouterr().err
    assert cli._rollout_dtype("bfloat16", rollout) == "bfloat16"
    assert cli._rollout_dtype("auto", None) == "auto"
