"""The SGLang client against SGLang's documented request/response shapes (a fake server backed
by our sampler: SGLang itself is CUDA-only), through the full sync + canary protocol."""

from __future__ import annotations

import base64
import pickle

import pytest
import torch

from lorafleet.sync.base import (
    BASE,
    AdapterVersion,
    EngineHTTPError,
    RolloutEngineError,
    RolloutParams,
    RolloutRequest,
    SyncError,
    SyncVerificationError,
)
from lorafleet.sync.files import LocalStaging, RemoteStaging
from lorafleet.sync.merged import PristineBase
from lorafleet.sync.sglang import SglangEngine, serialize_lora_tensors
from lorafleet.sync.staging_server import serve_in_thread
from lorafleet.sync.syncer import AdapterSyncer
from tests.sync._fake_sglang import FakeSglang, serve
from tests.sync._helpers import new_adapter, randomize, tiny_stack

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOKEN = "staging-token-0123456789"


@pytest.fixture
def fake():
    return FakeSglang(api_key="sk-test-key")


@pytest.fixture
def url(fake):
    with serve(fake) as base_url:
        yield base_url


@pytest.fixture
def base_dir(tmp_path):
    path = tmp_path / "base"
    tiny_stack().adapted.model  # noqa: B018 - same seed as the fake's model
    from tests._models import tiny_qwen3

    tiny_qwen3().save_pretrained(path)
    return path


def engine_for(
    url, tmp_path, *, staging=None, pristine=None, base_path=None, api_key="sk-test-key"
):
    return SglangEngine(
        url,
        dtype=torch.float32,
        model_name="base",
        api_key=api_key,
        staging=staging or LocalStaging(tmp_path / "staging"),
        pristine=pristine,
        base_path=base_path,
    )


def bodies(fake, path):
    return [body for p, body in fake.calls if p == path]


def test_files_sync_sends_the_documented_shapes_and_hot_swaps(fake, url, tmp_path):
    stack = tiny_stack()
    engine = engine_for(url, tmp_path)
    syncer = AdapterSyncer(engine, stack.trainer, mode="files")
    slot = new_adapter(stack.trainer, 1)
    syncer.sync("a", slot)
    randomize(stack.trainer, slot, 3)
    report = syncer.sync("a", slot)
    assert report.canary.differs_check == "passed" and report.canary.max_abs_diff <= 1e-3
    loads = bodies(fake, "/load_lora_adapter")
    assert loads == [
        {"lora_name": "a@0", "lora_path": str(tmp_path / "staging" / "a@0"), "pinned": False},
        {"lora_name": "a@1", "lora_path": str(tmp_path / "staging" / "a@1"), "pinned": False},
    ]
    assert bodies(fake, "/unload_lora_adapter") == [{"lora_name": "a@0"}]
    # Load new -> canary on the new name -> switch -> unload old: never a moment without one.
    order = fake.paths()
    assert order.index("/unload_lora_adapter") > max(
        i for i, p in enumerate(order) if p == "/load_lora_adapter"
    )
    canary = next(b for b in bodies(fake, "/generate") if b.get("lora_path") == "a@1")
    assert (
        canary["input_ids"] == syncer.tokens
        and canary["return_logprob"] is True
        and canary["logprob_start_len"] == 0
    )
    assert canary["sampling_params"] == {
        "max_new_tokens": 1,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
    }
    base_canary = [b for b in bodies(fake, "/generate") if "lora_path" not in b]
    assert base_canary, "the base model was asked for explicitly, without lora_path"
    out = engine.generate(
        [
            RolloutRequest(
                [5, 6, 7],
                AdapterVersion("a", 1),
                RolloutParams(max_tokens=4, temperature=0.0, stop_token_ids=()),
            )
        ]
    )
    assert len(out[0].tokens) == 4 and out[0].served_by is None  # SGLang's LoRA reply does not say
    assert fake.calls[-1][1]["sampling_params"]["ignore_eos"] is True


def test_tensor_sync_uses_load_from_tensors(fake, url, tmp_path):
    stack = tiny_stack()
    engine = engine_for(url, tmp_path)
    syncer = AdapterSyncer(engine, stack.trainer, mode="tensor")
    slot = new_adapter(stack.trainer, 2)
    report = syncer.sync("t", slot)
    assert report.canary.differs_check == "passed"
    (body,) = bodies(fake, "/load_lora_adapter_from_tensors")
    assert body["lora_name"] == "t@0" and body["load_format"] is None and body["pinned"] is False
    assert body["config_dict"]["r"] == 4 and body["config_dict"]["peft_type"] == "LORA"
    assert not (tmp_path / "staging").exists() or not any(
        (tmp_path / "staging").iterdir()
    )  # no files


def test_tensor_payload_is_peft_keyed_and_by_value():
    stack = tiny_stack()
    slot = new_adapter(stack.trainer, 2)
    from lorafleet.sync.base import AdapterUpdate

    update = AdapterUpdate(AdapterVersion("t", 0), stack.trainer.bank, slot, "tiny")
    tensors = pickle.loads(base64.b64decode(serialize_lora_tensors(update)))
    path = next(iter(update.weights()))
    A, B = update.weights()[path]
    assert torch.equal(tensors[f"base_model.model.{path}.lora_A.weight"], A)
    assert torch.equal(tensors[f"base_model.model.{path}.lora_B.weight"], B)


def test_merged_sync_reply_shows_the_weight_version(fake, url, tmp_path, base_dir):
    stack = tiny_stack()
    pristine = PristineBase(base_dir, torch.float32)
    before = {
        n: pristine.base_tensor(n).clone() for n in ("model.layers.0.self_attn.q_proj.weight",)
    }
    engine = engine_for(url, tmp_path, pristine=pristine, base_path=str(base_dir))
    syncer = AdapterSyncer(engine, stack.trainer, mode="merged")
    slot = new_adapter(stack.trainer, 4)
    for seed in (5, 6):
        randomize(stack.trainer, slot, seed)
        report = syncer.sync("m", slot)
        assert (
            report.canary.served_by == report.version.name
            and report.canary.differs_check == "passed"
        )
    assert [b["weight_version"] for b in bodies(fake, "/update_weights_from_disk")] == [
        "m@0",
        "m@1",
    ]
    assert fake.paths().count("/flush_cache") == 2
    for name, tensor in before.items():
        assert torch.equal(
            pristine.base_tensor(name), tensor
        )  # merges never touch the pristine copy
    assert sorted(p.name for p in (tmp_path / "staging").iterdir()) == ["m@1.merged"]
    with pytest.raises(RolloutEngineError, match="holds merged weights"):
        engine.generate([RolloutRequest([1, 2], BASE)])


def test_remote_staging_uploads_then_loads_from_the_receiver(fake, url, tmp_path):
    stack = tiny_stack()
    with serve_in_thread(tmp_path / "engine-host", TOKEN) as receiver:
        staging = RemoteStaging(receiver.url, TOKEN, scratch=tmp_path / "scratch")
        engine = engine_for(url, tmp_path, staging=staging)
        syncer = AdapterSyncer(engine, stack.trainer, mode="files")
        slot = new_adapter(stack.trainer, 1)
        syncer.sync("r", slot)
        randomize(stack.trainer, slot, 7)
        syncer.sync("r", slot)
        paths = [b["lora_path"] for b in bodies(fake, "/load_lora_adapter")]
        assert paths == [str((tmp_path / "engine-host" / n).resolve()) for n in ("r@0", "r@1")]
        assert sorted(p.name for p in (tmp_path / "engine-host").iterdir()) == [
            "r@1"
        ]  # r@0 removed remotely
        assert not any((tmp_path / "scratch").iterdir())


def test_wrong_api_key_is_a_clear_error(url, tmp_path):
    stack = tiny_stack()
    engine = engine_for(url, tmp_path, api_key="sk-wrong-key")
    with pytest.raises(SyncVerificationError, match="HTTP 401"):
        AdapterSyncer(engine, stack.trainer, mode="files")


@pytest.mark.parametrize(
    ("scale", "match"), [(0.3, "canary mismatch"), (1e-7, "equal its base model")]
)
def test_module_name_mismatch_is_caught(fake, url, tmp_path, monkeypatch, scale, match):
    """The engine accepts the adapter and ignores every module. A large adapter fails the
    match; one whose effect is below the tolerance fails the exact differs-from-base check."""
    stack = tiny_stack()
    engine = engine_for(url, tmp_path)
    syncer = AdapterSyncer(engine, stack.trainer, mode="tensor")
    import lorafleet.sync.sglang as sglang_module

    monkeypatch.setattr(
        sglang_module, "PEFT_PREFIX", "base_model.model.transformer."
    )  # names SGLang does not know
    slot = new_adapter(stack.trainer, 1, randomized=False)
    randomize(stack.trainer, slot, 1, scale=scale)
    with pytest.raises(SyncVerificationError, match=match):
        syncer.sync("x", slot)
    assert bodies(fake, "/unload_lora_adapter") == [{"lora_name": "x@0"}]  # withdrawn
    assert engine.current("x") is None


def test_skipped_load_is_caught(fake, url, tmp_path, monkeypatch):
    stack = tiny_stack()
    engine = engine_for(url, tmp_path)
    syncer = AdapterSyncer(engine, stack.trainer, mode="files")
    monkeypatch.setattr(engine, "_load_lora_path", lambda name, path: None)
    with pytest.raises(SyncVerificationError, match="could not run 'x@0'.*not loaded"):
        syncer.sync("x", new_adapter(stack.trainer, 1))


@pytest.mark.parametrize("level", [1, 2])
def test_offload_levels(fake, url, tmp_path, base_dir, level):
    stack = tiny_stack()
    engine = engine_for(url, tmp_path, base_path=str(base_dir))
    syncer = AdapterSyncer(engine, stack.trainer, mode="files")
    syncer.sync("o", new_adapter(stack.trainer, 1))
    fake.calls.clear()
    syncer.release(level)
    reports = syncer.resume()
    assert [r.differs_check for r in reports] == ["passed"]
    tags = ["kv_cache"] if level == 1 else ["kv_cache", "weights"]
    assert bodies(fake, "/release_memory_occupation") == [{"tags": tags}]
    assert bodies(fake, "/resume_memory_occupation") == [{"tags": tags}]
    pushes = bodies(fake, "/update_weights_from_disk")
    # With LoRA at level <= 1 only the adapter moves; at level 2 the base is re-sent on wake.
    assert pushes == (
        []
        if level == 1
        else [{"model_path": str(base_dir), "abort_all_requests": False, "weight_version": "base"}]
    )


def test_level_two_without_a_base_to_resend_fails_loudly(fake, url, tmp_path):
    stack = tiny_stack()
    engine = engine_for(url, tmp_path)  # no base_path
    syncer = AdapterSyncer(engine, stack.trainer, mode="files")
    syncer.sync("o", new_adapter(stack.trainer, 1))
    syncer.release(2)
    with pytest.raises(SyncError, match="no weights to re-send"):
        syncer.resume()


def test_failed_merged_sync_restores_the_base(fake, url, tmp_path, base_dir, monkeypatch):
    stack = tiny_stack()
    pristine = PristineBase(base_dir, torch.float32)
    engine = engine_for(url, tmp_path, pristine=pristine, base_path=str(base_dir))
    syncer = AdapterSyncer(engine, stack.trainer, mode="merged")
    slot = new_adapter(stack.trainer, 4)
    real_write = pristine.write
    monkeypatch.setattr(
        pristine,
        "write",
        lambda update, dest: real_write(
            type(update)(
                update.version, update.bank, new_adapter(stack.trainer, 99), update.base_model_id
            ),
            dest,
        ),
    )
    with pytest.raises(SyncVerificationError, match="canary mismatch"):
        syncer.sync("m", slot)
    assert engine.weights == "base" and bodies(fake, "/update_weights_from_disk")[-1][
        "model_path"
    ] == str(base_dir)
    engine.generate([RolloutRequest([1, 2], BASE)])  # the base is served again


def test_http_errors_name_the_url_and_status(url, tmp_path):
    engine = engine_for(url, tmp_path)
    with pytest.raises(EngineHTTPError, match=r"/generate answered HTTP 400") as info:
        engine.generate([RolloutRequest([1, 2], AdapterVersion("never", 0))])
    assert info.value.status == 400


def test_merged_sync_to_a_remote_engine_uploads_the_checkpoint(fake, url, tmp_path, base_dir):
    stack = tiny_stack()
    with serve_in_thread(tmp_path / "engine-host", TOKEN) as receiver:
        staging = RemoteStaging(receiver.url, TOKEN)
        engine = engine_for(
            url,
            tmp_path,
            staging=staging,
            pristine=PristineBase(base_dir, torch.float32),
            base_path=str(base_dir),
        )
        syncer = AdapterSyncer(engine, stack.trainer, mode="merged")
        slot = new_adapter(stack.trainer, 4)
        syncer.sync("m", slot)
        randomize(stack.trainer, slot, 8)
        report = syncer.sync("m", slot)
        assert report.canary.served_by == "m@1"
        remote = (tmp_path / "engine-host").resolve()
        assert [b["model_path"] for b in bodies(fake, "/update_weights_from_disk")] == [
            str(remote / "m@0.merged"),
            str(remote / "m@1.merged"),
        ]
        assert sorted(p.name for p in remote.iterdir()) == ["m@1.merged"]
        assert sorted(p.name for p in (remote / "m@1.merged").iterdir()) == [
            "config.json",
            "generation_config.json",
            "model.safetensors",
        ]
        staging.close()
