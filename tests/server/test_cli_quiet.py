"""`lorafleet rl` / `sft` keep the SDK's per-poll "Retrying request ... because of try_again"
warnings out of the terminal; importing lorafleet leaves the SDK's logging alone."""

from __future__ import annotations

import inspect
import logging
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafleet import cli
from lorafleet.server.config import ServerConfig
from lorafleet.server.main import ServerThread
from tests.server.conftest import connect

SDK_LOGGER = logging.getLogger(cli.SDK_RETRY_LOGGER)


@pytest.fixture
def sdk_logger_level() -> Iterator[None]:
    level = SDK_LOGGER.level
    yield
    SDK_LOGGER.setLevel(level)


@pytest.fixture
def short_polls(server: ServerThread) -> Iterator[None]:
    """Long-polls that end long before the operation does, as on a slow machine."""
    config = server.service.config
    before = config.long_poll_s
    config.long_poll_s = 0.05
    yield
    config.long_poll_s = before


def _retry_warnings(server: ServerThread, caplog: pytest.LogCaptureFixture) -> int:
    """Creates a model while the scheduler is held for a second; counts the SDK's warnings."""
    caplog.clear()
    service = connect(server)
    try:
        server.service.scheduler.pause()
        future = service.create_lora_training_client(base_model="tiny-qwen3", rank=4)
        time.sleep(1.0)
        server.service.scheduler.resume()
        future.result(timeout=60)
    finally:
        server.service.scheduler.resume()
        service.close("success").result(timeout=30)
    return sum(
        "because of try_again" in r.getMessage()
        for r in caplog.records
        if r.name == cli.SDK_RETRY_LOGGER
    )


def test_cli_logger_setup_silences_the_sdk_retry_warnings(
    server: ServerThread,
    short_polls: None,
    sdk_logger_level: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The logger the CLI quiets is the one the SDK warns through: warnings before, none after."""
    caplog.set_level(logging.WARNING)
    SDK_LOGGER.setLevel(logging.NOTSET)  # an earlier in-process `lorafleet rl` run may have set it
    assert _retry_warnings(server, caplog) >= 3
    cli.quiet_sdk_retries()
    assert _retry_warnings(server, caplog) == 0


@pytest.mark.parametrize(
    "argv",
    [["rl", "--tenants", "0"], ["sft", "--data", "x.jsonl", "--steps", "0"]],
    ids=["rl", "sft"],
)
def test_rl_and_sft_quiet_the_sdk_logger(argv: list[str], sdk_logger_level: None) -> None:
    SDK_LOGGER.setLevel(logging.NOTSET)
    assert cli.main(argv) == cli.EXIT_USER_ERROR  # bad input: fails before any work
    assert SDK_LOGGER.level == logging.ERROR


def test_importing_lorafleet_leaves_the_sdk_logger_alone() -> None:
    code = (
        "import logging, lorafleet.cli, lorafleet.rl.loop, lorafleet.rl.sft, lorafleet.rl.connect; "
        f"print(logging.getLogger({cli.SDK_RETRY_LOGGER!r}).getEffectiveLevel())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert int(out.stdout.strip()) == logging.WARNING


def test_long_poll_holds_until_just_under_the_sdk_retrieve_timeout() -> None:
    """Each early try_again costs the client a warning line and a round trip, so the server
    holds a poll as long as the SDK waits for it, less a margin for the answer's way back."""
    import tinker.lib.api_future_impl as sdk_futures

    source = inspect.getsource(sdk_futures)
    (sdk_timeout,) = {
        int(t)
        for t in re.findall(r"futures\.with_raw_response\.retrieve\(.*?timeout=(\d+)", source, re.S)
    }
    default = ServerConfig(base_model="m", data_dir=Path("d"), api_keys=[]).long_poll_s
    assert sdk_timeout - 10 <= default <= sdk_timeout - 3
