"""The checkpoint archive route (`GET .../checkpoints/<id>/archive`: a 302 to a signed tar link,
as SDKs before 0.38 read it) and `lorafleet export` from `tinker://` paths through it: training
and sampler checkpoints come out as PEFT dirs that `peft` loads, and merged models that
`transformers` loads, with the trainer's own log-probs; other tenants, wrong keys and unknown
paths are refused with the server's status and leave nothing behind."""

from __future__ import annotations

import io
import stat
import tarfile
import time
from email.utils import parsedate_to_datetime
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import httpx
import numpy as np
import pytest
import tinker
import torch
from transformers import AutoModelForCausalLM

from lorafleet import cli
from lorafleet.export import ExportError, export_checkpoint
from lorafleet.model.loader import load_base
from tests.server.conftest import KEY_A, KEY_B, TRAIN_DATA, forward_logprobs, trained


def _logprobs(model: torch.nn.Module) -> list[np.ndarray]:
    result = []
    with torch.no_grad():
        for datum in TRAIN_DATA:
            ids = torch.tensor([datum.model_input.to_ints()])
            targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].to_numpy())
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            result.append(logp.gather(-1, targets[:, None])[:, 0].numpy())
    return result


def _peft_logprobs(adapter: Path, base_model: str) -> list[np.ndarray]:
    from peft import PeftModel

    return _logprobs(PeftModel.from_pretrained(load_base(base_model).model, str(adapter)))


def _assert_close(theirs: list[np.ndarray], ours: list[np.ndarray]) -> None:
    for a, b in zip(theirs, ours, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)


def _archive_url(server, path: str) -> str:
    run, segment, name = path.removeprefix("tinker://").split("/")
    return f"{server.base_url}/api/v1/training_runs/{run}/checkpoints/{segment}/{name}/archive"


def _resign(url: str, **changes: str) -> str:
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()} | changes
    return urlunsplit(parts._replace(query=urlencode(query)))


def test_archive_route_redirects_to_a_signed_tar_of_the_checkpoint(server, client_a, base_model):
    tc = trained(client_a, base_model, seed=21)
    paths = {
        "training": tc.save_state("arch").result().path,
        "sampler": tc.save_weights_for_sampler("arch-s").result().path,
    }
    for kind, path in paths.items():
        answer = httpx.get(_archive_url(server, path), headers={"X-API-Key": KEY_A})
        assert answer.status_code == 302, answer.text
        expires = parsedate_to_datetime(answer.headers["expires"]).timestamp()
        assert time.time() + 600 < expires < time.time() + 2 * 3600
        link = answer.headers["location"]
        assert link.startswith(server.base_url) and "sig=" in link
        body = httpx.get(link)  # no key: the signature is the credential
        assert body.status_code == 200 and body.headers["content-type"] == "application/x-tar"
        assert int(body.headers["content-length"]) == len(body.content)
        on_disk = Path(server.service.store.checkpoints.get(path).dir)
        with tarfile.open(fileobj=io.BytesIO(body.content), mode="r:") as tar:
            members = tar.getmembers()
            assert sorted(m.name for m in members) == sorted(p.name for p in on_disk.iterdir())
            for member in members:
                assert member.isfile() and member.mode == 0o600
                data = tar.extractfile(member)
                assert data is not None and data.read() == (on_disk / member.name).read_bytes()
        names = {m.name for m in members}
        expected = {"state.json", "weights.safetensors", "optimizer.safetensors"}
        assert names == (
            expected if kind == "training" else {"adapter_config.json", "adapter_model.safetensors"}
        )

        sig = parse_qs(urlsplit(link).query)["sig"][0]
        assert (
            httpx.get(_resign(link, sig=sig[:-1] + ("0" if sig[-1] != "0" else "1"))).status_code
            == 403
        )
        assert httpx.get(link.split("?")[0]).status_code == 403
        # the signature covers this one checkpoint: re-aimed at another, it opens nothing
        other = paths["training" if kind == "sampler" else "sampler"].split("/", 3)[3]
        here = path.split("/", 3)[3]
        assert httpx.get(link.replace(f"/archive/{here}", f"/archive/{other}")).status_code == 403
        # another tenant: the checkpoint does not exist for it; no key: 401
        assert (
            httpx.get(_archive_url(server, path), headers={"X-API-Key": KEY_B}).status_code == 404
        )
        assert httpx.get(_archive_url(server, path)).status_code == 401
    # a deleted checkpoint's link serves nothing
    rc_path = paths["sampler"]
    link = httpx.get(_archive_url(server, rc_path), headers={"X-API-Key": KEY_A}).headers[
        "location"
    ]
    tinker.RestClient(base_url=server.base_url, api_key=KEY_A).delete_checkpoint_from_tinker_path(
        rc_path
    ).result()
    assert httpx.get(link).status_code == 404


def test_export_from_tinker_paths_loads_with_the_trainers_logprobs(
    server, client_a, base_model, tmp_path, monkeypatch
):
    tc = trained(client_a, base_model, seed=22)
    ours = forward_logprobs(tc)
    state = tc.save_state("exp").result().path
    sampler = tc.save_weights_for_sampler("exp-s").result().path
    for name, path in (("state", state), ("sampler", sampler)):
        out = tmp_path / name
        result = export_checkpoint(path, out, base_url=server.base_url, api_key=KEY_A)
        assert result.kind == "peft" and result.base_model == base_model
        assert stat.S_IMODE(out.stat().st_mode) == 0o700
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in out.iterdir())
        _assert_close(_peft_logprobs(out, base_model), ours)

    # the CLI with the SDK's environment variables, --merged: transformers loads it as is
    monkeypatch.setenv("TINKER_BASE_URL", server.base_url)
    monkeypatch.setenv("TINKER_API_KEY", KEY_A)
    assert cli.main(["export", sampler, str(tmp_path / "merged"), "--merged"]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    _assert_close(_logprobs(model), ours)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "sampler", "state"]


def test_export_refusals_name_the_servers_answer_and_leave_nothing(
    server, client_a, base_model, tmp_path
):
    tc = trained(client_a, base_model, seed=23)
    state = tc.save_state("private").result().path
    out = tmp_path / "out"
    cases = [
        (state, KEY_B, "answered 404"),  # another tenant's path
        (state, "tml-not-a-key-0123456789abcdef", "answered 401"),
        (state.replace("/private", "/missing"), KEY_A, "answered 404"),
    ]
    for path, key, message in cases:
        with pytest.raises(ExportError, match=message) as info:
            export_checkpoint(path, out, base_url=server.base_url, api_key=key)
        assert path in str(info.value)
    with pytest.raises(ExportError, match="over the limit|exceeds the limit"):
        export_checkpoint(
            state, out, base_url=server.base_url, api_key=KEY_A, max_archive_bytes=1000
        )
    with pytest.raises(ExportError, match="cannot fetch"):
        export_checkpoint(state, out, base_url="http://127.0.0.1:9", api_key=KEY_A)
    assert list(tmp_path.iterdir()) == []
