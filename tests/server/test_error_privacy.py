"""Errors a tenant sees carry no server paths (data dir, model dir) and no tenant's id: the
reason is the tenant's, where the server keeps its files is not. The main error paths that
wrap file-level failures are driven through the SDK: corrupt and missing checkpoint files,
bad loads, bad names and bases, another tenant's (published) checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import tinker

from lorafleet.adapters.checkpoint import STATE_NAME, WEIGHTS_NAME
from lorafleet.server.main import ServerThread
from tests.server.conftest import KEY_A, KEY_B, connect, sl_datum

SECRET_BASE = "/srv/private-models/not-served"


def _secrets(server: ServerThread) -> list[str]:
    service = server.service
    return [
        str(service.data_dir),
        str(service.executor.base_path),
        service.authenticate(KEY_A).id,
        service.authenticate(KEY_B).id,
    ]


def _error_text(call) -> str:
    with pytest.raises((tinker.RequestFailedError, tinker.APIStatusError)) as caught:
        call()
    return str(caught.value)


def _checkpoint_dir(server: ServerThread, tinker_path: str) -> Path:
    row = server.service.store.checkpoints.get(tinker_path)
    assert row is not None
    return Path(row.dir)


def _trained(service: tinker.ServiceClient, base_model: str):
    training = service.create_lora_training_client(base_model=base_model, rank=4).result(
        timeout=120
    )
    training.forward_backward([sl_datum([1, 2, 3, 4, 5])], "cross_entropy").result(timeout=120)
    training.optim_step(tinker.types.AdamParams(learning_rate=1e-3)).result(timeout=120)
    return training


def test_error_messages_name_no_server_path_and_no_tenant(server, client_a, base_model):
    secrets = _secrets(server)
    messages: dict[str, str] = {}
    training = _trained(client_a, base_model)

    # a corrupt training state: its JSON, then its weights file
    corrupt = training.save_state("privacy-corrupt").result(timeout=120).path
    state_dir = _checkpoint_dir(server, corrupt)
    (state_dir / STATE_NAME).write_text("{not json")
    messages["corrupt state"] = _error_text(
        lambda: client_a.create_training_client_from_state(corrupt).result(timeout=120)
    )
    messages["corrupt state, load_state"] = _error_text(
        lambda: training.load_state(corrupt).result(timeout=120)
    )
    truncated = training.save_state("privacy-truncated").result(timeout=120).path
    (_checkpoint_dir(server, truncated) / WEIGHTS_NAME).write_bytes(b"\x00" * 16)
    messages["truncated weights"] = _error_text(
        lambda: client_a.create_training_client_from_state(truncated).result(timeout=120)
    )
    missing = training.save_state("privacy-missing").result(timeout=120).path
    (_checkpoint_dir(server, missing) / WEIGHTS_NAME).unlink()
    messages["missing weights"] = _error_text(
        lambda: client_a.create_training_client_from_state(missing).result(timeout=120)
    )

    # bad loads and bad names
    sampler_path = training.save_weights_for_sampler("privacy-sampler").result(timeout=120).path
    messages["sampler weights as a state"] = _error_text(
        lambda: client_a.create_training_client_from_state(sampler_path).result(timeout=120)
    )
    messages["unknown checkpoint"] = _error_text(
        lambda: client_a.create_training_client_from_state(
            f"tinker://{training.model_id}/weights/never-saved"
        ).result(timeout=120)
    )
    messages["bad name"] = _error_text(
        lambda: training.save_state("../../escape").result(timeout=120)
    )
    messages["unserved base"] = _error_text(
        lambda: client_a.create_lora_training_client(base_model=SECRET_BASE, rank=4).result(
            timeout=120
        )
    )

    # another tenant's checkpoint: unknown to A, whatever state its files are in
    service_b = connect(server, KEY_B)
    try:
        training_b = _trained(service_b, base_model)
        path_b = training_b.save_state("privacy-b").result(timeout=120).path
        (_checkpoint_dir(server, path_b) / STATE_NAME).write_text("[")
        messages["other tenant's checkpoint"] = _error_text(
            lambda: client_a.create_training_client_from_state(path_b).result(timeout=120)
        )
        # published, it is readable by A: the reason its files cannot be read reaches A
        rest_b = tinker.RestClient(base_url=server.base_url, api_key=KEY_B)
        rest_b.publish_checkpoint_from_tinker_path(path_b).result(timeout=60)
        messages["other tenant's published checkpoint"] = _error_text(
            lambda: client_a.create_training_client_from_state(path_b).result(timeout=120)
        )
        assert "cannot be read" in messages["other tenant's published checkpoint"]
    finally:
        service_b.close("success").result(timeout=30)

    # each message still says what went wrong, about the tenant's own names
    assert corrupt in messages["corrupt state"] and STATE_NAME in messages["corrupt state"]
    assert WEIGHTS_NAME in messages["truncated weights"]
    assert "weights" in messages["missing weights"]
    assert "never-saved" in messages["unknown checkpoint"]
    assert SECRET_BASE in messages["unserved base"]  # the caller's own input, echoed
    for what, message in messages.items():
        for secret in secrets:
            assert secret not in message, f"{what}: {secret!r} in {message!r}"
