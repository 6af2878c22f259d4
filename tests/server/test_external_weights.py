"""save_weights_external + external_weights_urls + the signed download route, through the real
SDK and (when installed) tinker-cookbook 0.5.8's `weights.download`: the files that arrive are a
PEFT adapter that `peft` loads with the trainer's own log-probs."""

from __future__ import annotations

import json
import stat
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import numpy as np
import pyrage
import pytest
import tinker
import torch
from safetensors.torch import load_file

from lorafleet.model.loader import load_base
from tests.server.conftest import (
    KEY_A,
    KEY_B,
    TRAIN_DATA,
    forward_logprobs,
    trained,
)


def _peft_logprobs(adapter_dir: Path) -> list[np.ndarray]:
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_base("tiny-qwen3").model, str(adapter_dir))
    result = []
    with torch.no_grad():
        for datum in TRAIN_DATA:
            ids = torch.tensor([datum.model_input.to_ints()])
            targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].to_numpy())
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            result.append(logp.gather(-1, targets[:, None])[:, 0].numpy())
    return result


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


def _status(url: str) -> int:
    try:
        _fetch(url)
    except urllib.error.HTTPError as exc:
        return exc.code
    return 200


def _with_query(url: str, **changes: str) -> str:
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    query.update(changes)
    return urlunsplit(parts._replace(query=urlencode(query)))


def test_plain_export_urls_and_signed_links(server, client_a, base_model):
    tc = trained(client_a, base_model, seed=3)
    path = tc.save_weights_external("plain").result().path
    assert path == f"tinker://{tc.model_id}/external_weights/plain"

    rc = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    listed = rc.list_checkpoints(tc.model_id).result().checkpoints
    assert [(c.checkpoint_type, c.checkpoint_id) for c in listed] == [
        ("external", "external_weights/plain")
    ]
    response = rc.get_external_weights_urls(path).result()
    assert sorted(response.urls) == ["adapter_config.json", "adapter_model.safetensors"]
    assert response.expires.timestamp() > time.time() + 600

    # the files as served (no API key on the GET) are the export on disk, owner-only there
    export_dir = Path(server.service.store.checkpoints.get(path).dir)
    assert stat.S_IMODE(export_dir.stat().st_mode) == 0o700
    for name, url in response.urls.items():
        assert _fetch(url) == (export_dir / name).read_bytes()
        assert stat.S_IMODE((export_dir / name).stat().st_mode) == 0o600
    config = json.loads(_fetch(response.urls["adapter_config.json"]))
    assert config["r"] == 8 and config["peft_type"] == "LORA"

    url = response.urls["adapter_model.safetensors"]
    sig = parse_qs(urlsplit(url).query)["sig"][0]
    forged = sig[:-1] + ("0" if sig[-1] != "0" else "1")
    assert _status(_with_query(url, sig=forged)) == 403
    assert _status(_with_query(url, tenant="0123456789abcdef")) == 403  # re-aimed at a tenant
    assert _status(_with_query(url, expires=str(int(time.time()) + 10**6))) == 403
    assert _status(url.split("?")[0]) == 403  # unsigned
    # the other file's signature does not open this one
    other = response.urls["adapter_config.json"]
    assert _status(_with_query(url, sig=parse_qs(urlsplit(other).query)["sig"][0])) == 403

    # a correctly signed link that has expired
    signer = server.service.rest.signer
    tenant = server.service.store.checkpoints.get(path).tenant
    version = parse_qs(urlsplit(url).query)["version"][0]  # the save the link is bound to
    resource = f"{path}/adapter_model.safetensors@{version}"
    old = signer.sign(tenant, resource, now=time.time() - 2 * signer.ttl_s)
    assert _status(_with_query(url, **old.query)) == 403
    # a valid signature for a name that is not one of the export's files serves nothing
    outside = signer.sign(tenant, f"{path}/lorafleet.db@{version}")
    target = url.replace("adapter_model.safetensors", "lorafleet.db")
    assert _status(_with_query(target, **outside.query)) == 404

    # another tenant can neither sign links for the export nor list it
    with pytest.raises(tinker.NotFoundError):
        tinker.RestClient(base_url=server.base_url, api_key=KEY_B).get_external_weights_urls(
            path
        ).result()

    # deleting the export kills its links
    rc.delete_checkpoint_from_tinker_path(path).result()
    assert _status(url) == 404


def test_encrypted_export_decrypts_to_the_plain_files(server, client_a, base_model):
    tc = trained(client_a, base_model, seed=4)
    plain = tc.save_weights_external("clear").result().path
    identity = pyrage.x25519.Identity.generate()
    encrypted = tc.save_weights_external(
        "sealed", age_encryption_recipients=[str(identity.to_public())]
    ).result()
    rc = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    sealed_urls = rc.get_external_weights_urls(encrypted.path).result().urls
    assert sorted(sealed_urls) == ["adapter_config.json.age", "adapter_model.safetensors.age"]
    clear_urls = rc.get_external_weights_urls(plain).result().urls
    for name, url in clear_urls.items():
        ciphertext = _fetch(sealed_urls[name + ".age"])
        assert ciphertext != _fetch(url)
        assert pyrage.decrypt(ciphertext, [identity]) == _fetch(url)

    with pytest.raises(tinker.RequestFailedError, match=r"age_encryption_recipients\[1\]"):
        tc.save_weights_external(
            "bad", age_encryption_recipients=[str(identity.to_public()), "age1notakey"]
        ).result()
    assert [c.checkpoint_id for c in rc.list_checkpoints(tc.model_id).result().checkpoints] == [
        "external_weights/clear",
        "external_weights/sealed",
    ]


def test_cookbook_download_of_a_training_checkpoint_loads_in_peft(
    server, client_a, base_model, tmp_path, monkeypatch
):
    weights = pytest.importorskip("tinker_cookbook.weights")
    monkeypatch.setenv("TINKER_API_KEY", KEY_A)
    tc = trained(client_a, base_model, seed=5)
    state = tc.save_state("for-download").result().path

    out = weights.download(
        tinker_path=state, output_dir=str(tmp_path / "adapter"), base_url=server.base_url
    )
    files = sorted(p.name for p in Path(out).iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    tensors = load_file(Path(out) / "adapter_model.safetensors")
    assert tensors and all(k.startswith("base_model.model.") for k in tensors)
    for ours, theirs in zip(forward_logprobs(tc), _peft_logprobs(Path(out)), strict=True):
        np.testing.assert_allclose(theirs, ours, rtol=0, atol=2e-5)

    # the cookbook deleted its temporary export; the training checkpoint stays
    rc = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    ids = {c.checkpoint_id for c in rc.list_user_checkpoints(limit=1000).result().checkpoints}
    assert "weights/for-download" in ids and "external_weights/download" not in ids

    # an external path downloads as is (no decryption on the client)
    path = tc.save_weights_external("direct").result().path
    direct = weights.download(
        tinker_path=path, output_dir=str(tmp_path / "direct"), base_url=server.base_url
    )
    for name in files:
        assert (Path(direct) / name).read_bytes() == (Path(out) / name).read_bytes()


def test_cookbook_sampler_path_download_is_the_clients_limit(
    server, client_a, base_model, monkeypatch
):
    """The cookbook refuses to download sampler_weights/ on the client, before any request
    (0.6.1: "Sampler checkpoints cannot be downloaded"; 0.5.8 went through
    `get_checkpoint_archive_url...`, which SDK 0.38 no longer has). A sampler checkpoint's
    weights download as an export of a run resumed from the matching training state."""
    weights = pytest.importorskip("tinker_cookbook.weights")
    from tinker_cookbook.exceptions import WeightsDownloadError

    assert not hasattr(tinker.RestClient, "get_checkpoint_archive_url_from_tinker_path")
    monkeypatch.setenv("TINKER_API_KEY", KEY_A)
    tc = trained(client_a, base_model, seed=6)
    sampler = tc.save_weights_for_sampler("s").result().path
    refused = "Sampler checkpoints cannot be downloaded|Failed to get download URL"
    with pytest.raises(WeightsDownloadError, match=refused):
        weights.download(
            tinker_path=sampler, output_dir="/nonexistent/never-written", base_url=server.base_url
        )
