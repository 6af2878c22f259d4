"""One in-process server (tiny-qwen3, loaded once per test session) driven by the real `tinker`
SDK over loopback HTTP. Two tenants: A and B."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TINKER_TELEMETRY"] = "0"

import pytest
import tinker
from tinker import types

from lorafleet.server.config import ServerConfig
from lorafleet.server.engine.executor import EngineConfig
from lorafleet.server.main import ServerThread, free_port

KEY_A = "tml-tenant-a-0123456789abcdef"
KEY_B = "tml-tenant-b-0123456789abcdef"
VOCAB = 512  # tiny-qwen3's tokenizer


def server_config(data_dir, port: int | None = None, **overrides) -> ServerConfig:
    engine = EngineConfig(
        base_model="tiny-qwen3",
        max_adapters=12,
        sampler_slots=8,
        max_lora_rank=16,
        max_sample_rows=16,
    )
    return ServerConfig(
        base_model="tiny-qwen3",
        data_dir=data_dir,
        api_keys=[KEY_A, KEY_B],
        port=port or free_port(),
        engine=engine,
        torch_threads=1,
        batch_window_s=0.0,
        **{"tokenizer_cache": _hub_cache_beside(data_dir), **overrides},
    )


def _hub_cache_beside(data_dir) -> Path:
    """Test servers place their tokenizer next to their data dir, not in the user's hub cache."""
    data_dir = Path(data_dir)
    return data_dir.parent / f"{data_dir.name}-hf-hub"


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[ServerThread]:
    srv = ServerThread(server_config(tmp_path_factory.mktemp("server-data")))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def base_model(server: ServerThread) -> str:
    """The model's directory: the name under which the SDK can load the tokenizer offline."""
    return str(server.service.executor.base_path)


def connect(server: ServerThread, key: str = KEY_A) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=server.base_url, api_key=key)


@pytest.fixture
def client_a(server: ServerThread) -> Iterator[tinker.ServiceClient]:
    sc = connect(server, KEY_A)
    yield sc
    sc.close("success").result(timeout=30)


@pytest.fixture
def client_b(server: ServerThread) -> Iterator[tinker.ServiceClient]:
    sc = connect(server, KEY_B)
    yield sc
    sc.close("success").result(timeout=30)


def sl_datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    """Next-token prediction over `tokens`."""
    weights = [1.0] * (len(tokens) - 1) if weights is None else weights
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


TRAIN_DATA = [
    sl_datum([8, 16, 24, 32, 40, 48, 56, 64, 72, 80]),
    sl_datum([301, 302, 303, 304, 305]),
]


def trained(sc: tinker.ServiceClient, base_model: str, seed: int) -> tinker.TrainingClient:
    """A rank-8 run one step into TRAIN_DATA: weights that differ from a fresh adapter's."""
    tc = sc.create_lora_training_client(base_model=base_model, rank=8, seed=seed).result()
    fwd = tc.forward_backward(TRAIN_DATA, "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=5e-2))
    fwd.result()
    opt.result()
    return tc


def forward_logprobs(tc: tinker.TrainingClient) -> list[Any]:
    """The run's target log-probs of TRAIN_DATA, one array per datum."""
    out = tc.forward(TRAIN_DATA, "cross_entropy").result().loss_fn_outputs
    return [o["logprobs"].to_numpy() for o in out]


def rl_datum(
    prompt: list[int], sampled: list[int], sampler_logprobs: list[float], advantage: float
) -> types.Datum:
    """The cookbook's layout: input = prompt + sampled[:-1], targets/logprobs/advantages 0 over the prompt."""
    pad = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(prompt + sampled[:-1]),
        loss_fn_inputs={
            "target_tokens": [0] * pad + sampled,
            "logprobs": [0.0] * pad + sampler_logprobs,
            "advantages": [0.0] * pad + [advantage] * len(sampled),
        },
    )


def wait_pending(server: ServerThread, count: int, timeout: float = 30.0) -> None:
    """Waits until the (paused) scheduler holds `count` queued operations."""
    deadline = time.monotonic() + timeout
    while server.service.scheduler.pending() < count:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {server.service.scheduler.pending()} of {count} operations arrived"
            )
        time.sleep(0.01)
