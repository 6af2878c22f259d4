"""The newest Tinker cookbook (0.6.1) runs unmodified against this server: its `math_rl` recipe
with `env=arithmetic` and its default loss (`stable_reinforce`: samples recorded with
`record_stability_info`, datums sent with provenance spans), synchronously and with
`async_config` (`max_steps_off_policy=2`, which goes through `rl/train`'s async loop), three
steps each, as a new user would launch it (`python -m tinker_cookbook.recipes.math_rl.train`).

The cookbook is installed with `--no-deps` (scripts/setup.sh; its `tml-renderers` dependency
is not on the registry and its imports of it are lazy), with the libraries its RL recipes
import listed there too. The only arguments beyond the recipe's defaults are the ones a
self-hosted server needs (docs/tinker_api.md): the model, a renderer that works with any
tokenizer, a small batch, and where to log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafleet.server.http.training import Training
from lorafleet.server.main import ServerThread
from tests.server.conftest import KEY_A, server_config

pytestmark = pytest.mark.slow

cookbook = pytest.importorskip("tinker_cookbook")
if getattr(cookbook, "__version__", None) not in (None, "0.6.1"):
    pytest.skip(
        f"needs tinker-cookbook 0.6.1, found {cookbook.__version__}", allow_module_level=True
    )
pytest.importorskip(
    "tinker_cookbook.recipes.math_rl.train",
    reason="the cookbook's RL dependencies (chz, datasets, math-verify; scripts/setup.sh)",
)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[ServerThread]:
    srv = ServerThread(server_config(tmp_path_factory.mktemp("cookbook-server")))
    yield srv
    srv.stop()


@pytest.fixture
def losses(served: ServerThread, monkeypatch) -> list[tuple[str, int]]:
    """(loss_fn, datums) of every forward(_backward) the server parsed."""
    seen: list[tuple[str, int]] = []
    original = Training._with_provenance

    def spy(self, tenant, row, msg):  # type: ignore[no-untyped-def]
        call = original(self, tenant, row, msg)
        seen.append((call.loss_fn, len(call.data)))
        return call

    monkeypatch.setattr(Training, "_with_provenance", spy)
    return seen


def run_math_rl(served: ServerThread, log_path: Path, *extra: str) -> list[dict]:
    env = {
        **os.environ,
        "TINKER_API_KEY": KEY_A,
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(served.config.tokenizer_cache),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    command = [
        sys.executable,
        "-m",
        "tinker_cookbook.recipes.math_rl.train",
        "env=arithmetic",
        "model_name=tiny-qwen3",
        "renderer_name=role_colon",
        "lora_rank=8",
        "group_size=4",
        "groups_per_batch=4",
        "max_steps=3",
        "eval_every=0",
        "save_every=0",
        f"base_url={served.base_url}",
        f"log_path={log_path}",
        "behavior_if_log_dir_exists=delete",
        *extra,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "Training completed successfully" in done.stdout + done.stderr
    lines = (log_path / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def check_steps(steps: list[dict]) -> None:
    trained = [s for s in steps if "tokens/trained" in s]
    assert len(trained) == 3
    assert all(s["tokens/trained"] > 0 for s in trained)
    # prompt_cache_hit_tokens: the few-shot prefix is shared by every prompt of a step
    assert sum(s["tokens/prefill_cached"] for s in trained) > 0


def test_math_rl_arithmetic_with_its_default_loss(served, losses, tmp_path):
    steps = run_math_rl(served, tmp_path / "sync")
    check_steps(steps)
    assert {loss for loss, _ in losses} == {"stable_reinforce"}
    assert sum(n for _, n in losses) == 3 * 4 * 4  # every rollout trained, none refused


def test_rl_train_async_two_steps_off_policy(served, losses, tmp_path):
    steps = run_math_rl(served, tmp_path / "async", "max_steps_off_policy=2")
    check_steps(steps)
    assert any("async/staleness_max" in s for s in steps)
    assert {loss for loss, _ in losses} == {"stable_reinforce"}
