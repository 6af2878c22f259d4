"""The tenants file (issue 22, item 4): parsed into ids, weights, operators and quotas; every
mistake refused with the file, the line and the key; a reload swaps the whole config or, on a
bad file, keeps the old one; SIGHUP reloads a `lorafleet serve` without dropping work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from tinker import types

from lorafleet.server.errors import Unauthorized
from lorafleet.server.main import ServerThread, free_port
from lorafleet.server.state.keys import hash_key, tenant_id
from lorafleet.server.state.tenants import Quotas, Tenancy, TenantsFileError, parse_tenants
from tests.server.conftest import KEY_A, KEY_B, sl_datum, wait_pending
from tests.server.tenant_files import (
    key_hash,
    tenants_server_config,
    tenants_toml,
    write_tenants,
)

KEY_C = "tml-tenant-c-0123456789abcdef"
KEY_OP = "tml-operator-0123456789abcdef"
TWO = {
    "alice": {"keys": [KEY_A], "weight": 2.5, "quotas": {"max_lora_rank": 8, "resident_runs": 2}},
    "bob": {"keys": [KEY_B]},
    "ops": {"keys": [KEY_OP], "operator": True},
}


def test_a_tenants_file_names_ids_weights_operators_and_quotas():
    config = parse_tenants(tenants_toml(TWO), "t.toml")
    assert set(config.tenants) == {"alice", "bob", "ops"}
    assert config.weight_of("alice") == 2.5 and config.weight_of("bob") == 1.0
    assert config.quotas("alice") == Quotas(max_lora_rank=8, resident_runs=2)
    assert config.quotas("bob") == Quotas() and config.max_resident("alice") == 2
    assert config.keys.authenticate(KEY_A).id == "alice"
    assert config.keys.authenticate(KEY_OP).operator
    assert not config.keys.authenticate(KEY_B).operator
    with pytest.raises(Unauthorized):
        config.keys.authenticate(KEY_C)


def test_a_key_only_tenant_keeps_its_id_under_its_name_in_a_tenants_file():
    """Moving from $LORAFLEET_API_KEYS to a tenants file keeps a tenant's data when its table
    is named after the old id (what `lorafleet keyhash` prints)."""
    old_id = tenant_id(hash_key(KEY_A))
    config = parse_tenants(tenants_toml({old_id: {"keys": [KEY_A]}}), "t.toml")
    assert config.keys.authenticate(KEY_A).id == old_id


def test_lorafleet_keyhash_prints_the_hash_and_the_key_only_id():
    out = subprocess.run(
        [sys.executable, "-m", "lorafleet.cli", "keyhash"],
        input=KEY_A + "\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert key_hash(KEY_A) in out and tenant_id(hash_key(KEY_A)) in out and KEY_A not in out


BAD = [
    # (file text, line, words the message must hold)
    ("[tenants.alice]\nkey_sha256 = [\n", 2, ["not valid TOML"]),
    ("[tenants.alice]\n\nweight = = 1\nkey_sha256 = []\n", 3, ["not valid TOML"]),
    (
        f'[tenants.alice]\nkey_sha256 = ["{key_hash(KEY_A)}"]\nweight = 0\n',
        3,
        ["[tenants.alice] weight", "> 0", "0"],
    ),
    (
        f'[tenants.alice]\nkey_sha256 = ["{key_hash(KEY_A)}"]\n\n[tenants.alice.quotas]\n'
        "max_lora_rank = 8\ntrained_tokens_day = 5\n",
        6,
        ["[tenants.alice.quotas] trained_tokens_day", "unknown quota"],
    ),
    (
        f'[tenants.alice]\nkey_sha256 = ["{key_hash(KEY_A)}"]\n[tenants.alice.quotas]\n'
        "storage_bytes = -1\n",
        4,
        ["[tenants.alice.quotas] storage_bytes", ">= 0", "-1"],
    ),
    (f'[tenants.alice]\nkey_sha256 = ["{KEY_A}"]\n', 2, ["never the key itself"]),
    (f'[tenants."Alice/x"]\nkey_sha256 = ["{key_hash(KEY_A)}"]\n', None, ["'Alice/x'"]),
    (
        f'[tenants.alice]\nkey_sha256 = ["{key_hash(KEY_A)}"]\n'
        f'[tenants.bob]\nkey_sha256 = ["{key_hash(KEY_A)}"]\n',
        4,
        ["[tenants.bob] key_sha256", "'alice'"],
    ),
    (
        f'[tenants.alice]\nkey_sha256 = ["{key_hash(KEY_A)}"]\noperator = "yes"\n',
        3,
        ["operator", "true or false"],
    ),
]


@pytest.mark.parametrize(("text", "line", "words"), BAD)
def test_a_bad_tenants_file_is_refused_naming_the_line_and_the_key(text, line, words):
    with pytest.raises(TenantsFileError) as caught:
        parse_tenants(text, "tenants.toml")
    message = str(caught.value)
    assert message.startswith("tenants.toml")
    if line is not None:
        assert f"line {line}" in message
    for word in words:
        assert word in message
    assert KEY_A not in message  # a key pasted by mistake is not echoed into logs


def test_a_reload_swaps_the_whole_config_or_keeps_the_old_one(tmp_path):
    path = write_tenants(tmp_path / "tenants.toml", TWO)
    tenancy = Tenancy(parse_tenants(path.read_text(), str(path)), path)
    old = tenancy.current
    path.write_text(tenants_toml(TWO) + "\n[tenants.carol]\nkey_sha256 = 5\n")
    with pytest.raises(TenantsFileError, match=r"line \d+: \[tenants.carol\] key_sha256"):
        tenancy.reload()
    assert tenancy.current is old and tenancy.reload_failures == 1
    assert tenancy.last_error is not None and "carol" in tenancy.last_error
    write_tenants(path, {**TWO, "carol": {"keys": [KEY_C], "weight": 4}})
    tenancy.reload()
    assert tenancy.current.keys.authenticate(KEY_C).id == "carol"
    assert tenancy.weight_of("carol") == 4.0 and tenancy.reloads == 1


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory) -> Iterator[ServerThread]:
    root = tmp_path_factory.mktemp("tenants-server")
    path = write_tenants(root / "tenants.toml", TWO)
    server = ServerThread(tenants_server_config(root / "data", path))
    yield server
    server.stop()


def test_a_reload_on_a_running_server_changes_keys_and_keeps_queued_work(tenant_server):
    service = tenant_server.service
    path = service.tenancy.path
    assert path is not None
    client = tinker.ServiceClient(base_url=tenant_server.base_url, api_key=KEY_A)
    try:
        tc = client.create_lora_training_client(
            base_model=str(service.executor.base_path), rank=4, seed=1
        ).result()
        service.scheduler.pause()
        try:
            queued = tc.forward_backward([sl_datum([3, 6, 9, 12])], "cross_entropy")
            wait_pending(tenant_server, 1)
            write_tenants(path, {"alice": TWO["alice"], "carol": {"keys": [KEY_C]}})
            service.reload_tenants()
        finally:
            service.scheduler.resume()
        assert queued.result(timeout=60).loss_fn_outputs  # admitted before: it still runs
    finally:
        client.close("success").result(timeout=30)
    assert service.authenticate(KEY_C).id == "carol"
    with pytest.raises(Unauthorized):
        service.authenticate(KEY_B)  # removed by the reload
    path.write_text("[tenants.alice\n")
    with pytest.raises(TenantsFileError, match="line 1"):
        service.reload_tenants()
    assert service.authenticate(KEY_C).id == "carol"  # the old config stays in force


def _get(base_url: str, key: str) -> int:
    request = urllib.request.Request(
        f"{base_url}/api/v1/lorafleet/usage", headers={"X-API-Key": key}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            json.load(response)
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def test_sighup_reloads_the_tenants_file_of_lorafleet_serve(tmp_path: Path):
    path = write_tenants(tmp_path / "tenants.toml", {"alice": {"keys": [KEY_A]}})
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "LORAFLEET_API_KEYS"}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"))
    log = (tmp_path / "serve.log").open("w")
    command = [sys.executable, "-m", "lorafleet.cli", "serve", "--base-model", "tiny-qwen3"]
    command += ["--port", str(port), "--data-dir", str(tmp_path / "data")]
    command += ["--tenants-file", str(path), "--torch-threads", "1"]
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: _status(base_url) == 200, 120, "the server did not start")
        assert _get(base_url, KEY_A) == 200 and _get(base_url, KEY_C) == 401
        write_tenants(path, {"alice": {"keys": [KEY_A]}, "carol": {"keys": [KEY_C]}})
        proc.send_signal(signal.SIGHUP)
        _wait_for(lambda: _get(base_url, KEY_C) == 200, 20, "SIGHUP did not reload")
        path.write_text('[tenants.alice]\nkey_sha256 = ["nope"]\n')
        proc.send_signal(signal.SIGHUP)
        _wait_for(
            lambda: "not reloaded" in (tmp_path / "serve.log").read_text(), 20, "no reload error"
        )
        assert _get(base_url, KEY_C) == 200 and _get(base_url, KEY_A) == 200  # old config
        assert "line 2" in (tmp_path / "serve.log").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _status(base_url: str) -> int:
    try:
        with urllib.request.urlopen(f"{base_url}/api/v1/healthz", timeout=2) as response:
            return int(response.status)
    except (urllib.error.URLError, ConnectionError):
        return 0


def test_a_server_given_keys_and_a_tenants_file_refuses_to_start(tmp_path):
    import dataclasses

    from lorafleet.server.service import Service

    path = write_tenants(tmp_path / "tenants.toml", TWO)
    config = dataclasses.replace(tenants_server_config(tmp_path / "data", path), api_keys=[KEY_A])
    with pytest.raises(ValueError, match="api_keys and tenants_file were both given"):
        Service(config)


def test_the_sdk_sees_a_tenant_of_the_file(tenant_server):
    """A tenant from the file is an ordinary Tinker user."""
    client = tinker.ServiceClient(base_url=tenant_server.base_url, api_key=KEY_A)
    try:
        sampler = client.create_sampling_client(
            base_model=str(tenant_server.service.executor.base_path)
        ).result()
        out = sampler.sample(
            types.ModelInput.from_ints([5, 6, 7]),
            1,
            types.SamplingParams(max_tokens=2, temperature=0.0, stop=[]),
        ).result()
        assert len(out.sequences[0].tokens) == 2
    finally:
        client.close("success").result(timeout=30)


def test_serve_refuses_a_tenants_file_beside_other_keys(tmp_path, monkeypatch):
    """One source of keys: otherwise which key means which tenant would be a guess."""
    from lorafleet import cli

    path = write_tenants(tmp_path / "tenants.toml", TWO)
    keys = tmp_path / "keys.txt"
    keys.write_text(KEY_C + "\n")
    monkeypatch.delenv("LORAFLEET_API_KEYS", raising=False)
    argv = ["serve", "--base-model", "tiny-qwen3", "--data-dir", str(tmp_path / "data")]
    with pytest.raises(SystemExit, match="--tenants-file lists the keys"):
        cli.main([*argv, "--tenants-file", str(path), "--api-key-file", str(keys)])
    monkeypatch.setenv("LORAFLEET_API_KEYS", KEY_C)
    with pytest.raises(SystemExit, match="unset \\$LORAFLEET_API_KEYS"):
        cli.main([*argv, "--tenants-file", str(path)])
    assert not (tmp_path / "data").exists()  # refused before anything was made
