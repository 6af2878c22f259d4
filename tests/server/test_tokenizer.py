"""Tokenizers by preset name, offline, through the real SDK: `get_info` reports a hub-style
`tokenizer_id` (never a server path), the server places the tokenizer in its machine's hub
cache under that name, and a client elsewhere gets the same with `lorafleet tokenizer`. Then
`TrainingClient.get_tokenizer()`, `SamplingClient.get_tokenizer()` and the cookbook's
`get_tokenizer("tiny-qwen3")` all load it with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tinker

from lorafleet import cli
from lorafleet.server.main import ServerThread
from tests.server.conftest import KEY_A

CLIENT = """
import json, sys
import tinker
from tinker_cookbook.tokenizer_utils import get_tokenizer

service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
tc = service.create_lora_training_client(base_model="tiny-qwen3", rank=4).result(timeout=60)
sampler = service.create_sampling_client(base_model="tiny-qwen3")
tokenizers = [tc.get_tokenizer(), sampler.get_tokenizer(), get_tokenizer("tiny-qwen3")]
print(json.dumps({
    "tokenizer_id": tc.get_info().model_data.tokenizer_id,
    "encodings": [t.encode("12 + 7 = 19") for t in tokenizers],
}))
service.close("success").result(timeout=30)
"""


def test_get_info_names_the_tokenizer_not_a_server_path(
    client_a: tinker.ServiceClient, server: ServerThread
) -> None:
    tc = client_a.create_lora_training_client(base_model="tiny-qwen3", rank=4).result(timeout=60)
    tokenizer_id = tc.get_info().model_data.tokenizer_id
    assert tokenizer_id == "tiny-qwen3"
    assert str(server.service.executor.base_path) not in json.dumps(
        tc.get_info().model_dump(mode="json")
    )
    cache = server.service.config.tokenizer_cache
    assert cache is not None
    revision = (cache / "models--tiny-qwen3" / "refs" / "main").read_text()
    assert (cache / "models--tiny-qwen3" / "snapshots" / revision / "tokenizer.json").is_file()


def test_sdk_and_cookbook_load_the_preset_tokenizer_offline(
    server: ServerThread, tmp_path: Path
) -> None:
    """A client machine whose hub cache got the tokenizer from `lorafleet tokenizer` (the same
    snapshot the server placed in its own cache) loads it by the preset's name, offline."""
    assert cli.main(["tokenizer", "tiny-qwen3", "--cache", str(tmp_path)]) == 0
    server_cache = server.service.config.tokenizer_cache
    assert server_cache is not None
    assert (tmp_path / "models--tiny-qwen3" / "refs" / "main").read_text() == (
        server_cache / "models--tiny-qwen3" / "refs" / "main"
    ).read_text()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(tmp_path),
        "TINKER_TELEMETRY": "0",
    }
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, server.base_url, KEY_A],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(str(server.service.executor.base_path))
    assert result["tokenizer_id"] == "tiny-qwen3"
    assert result["encodings"] == [expected.encode("12 + 7 = 19")] * 3
