"""`lorafleet export` from local checkpoint dirs: the PEFT output loaded by `peft` and the merged
output loaded by `transformers` compute our adapted model's logits; outputs are owner-only and
atomic; bad input is refused by name and leaves nothing behind; a fetched archive is extracted
only as flat regular files within its size bound. Exports from `tinker://` paths on a live
server: tests/server/test_checkpoint_archive.py."""

from __future__ import annotations

import io
import json
import os
import stat
import tarfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lorafleet import cli
from lorafleet.adapters.checkpoint import write_training_state
from lorafleet.export import ExportError, _extract, export_checkpoint
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.loader import load_base, resolve_base
from lorafleet.model.targets import resolve_tinker_targets

os.environ["HF_HUB_OFFLINE"] = "1"
BASE = "tiny-qwen3"
SPEC = AdapterSpec(rank=4, alpha=8.0, seed=1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A random adapter on tiny-qwen3, written as a lorafleet training state, with our own
    adapted model's logits and the base's on fixed ids."""
    base = load_base(BASE)
    adapted = AdaptedModel(base.model, resolve_tinker_targets(base.model))
    bank = adapted.add_bank("train", num_slots=2, r_max=8)
    slot = bank.allocate(SPEC)
    gen = torch.Generator().manual_seed(3)
    weights = {
        path: (torch.randn(A.shape, generator=gen) * 0.2, torch.randn(B.shape, generator=gen) * 0.2)
        for path, (A, B) in bank.slot_weights(slot).items()
    }
    bank.load_slot_weights(slot, weights)
    ids = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with adapted.routing("train", bank.slot_ids_for_rows([slot, slot], ids.shape[1])):
            ours = adapted.model(ids).logits
        with adapted.routing("train", bank.slot_ids_for_rows([0, 0], ids.shape[1])):
            plain = adapted.model(ids).logits
    ckpt = tmp_path_factory.mktemp("export") / "ckpt"
    write_training_state(
        ckpt,
        spec=AdapterSpec(rank=SPEC.rank, alpha=SPEC.alpha, seed=SPEC.seed, targets=tuple(weights)),
        base_model_id=BASE,
        weights=bank.slot_weights(slot),
        moments=None,
        step=None,
        hparams=None,
    )
    return {"ckpt": ckpt, "ids": ids, "ours": ours, "base": plain}


def _assert_same(theirs: torch.Tensor, trained: dict) -> None:
    effect = float((trained["ours"] - trained["base"]).abs().max())
    assert effect > 0.05, "the adapter has no effect; the comparison would prove nothing"
    torch.testing.assert_close(theirs, trained["ours"], atol=2e-5 * max(1.0, effect), rtol=1e-5)


def _peft_logits(adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(resolve_base(BASE)[1], dtype=torch.float32)
    with torch.no_grad():
        return PeftModel.from_pretrained(model, str(adapter)).eval()(ids).logits


def _assert_private(tree: Path) -> None:
    assert stat.S_IMODE(tree.stat().st_mode) == 0o700
    for item in tree.iterdir():
        assert item.is_file() and not item.is_symlink()
        assert stat.S_IMODE(item.stat().st_mode) == 0o600, item


def test_peft_from_a_training_state_loads_in_peft(trained, tmp_path):
    out = tmp_path / "nested" / "adapter"
    result = export_checkpoint(str(trained["ckpt"]), out)
    assert (result.kind, result.source_format, result.base_model) == (
        "peft",
        "training_state",
        BASE,
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == BASE
    _assert_private(out)
    _assert_same(_peft_logits(out, trained["ids"]), trained)


def test_training_state_with_a_tied_lm_head_exports_and_loads_in_peft(tmp_path):
    """tiny-llama (like SmolLM2) ties lm_head to its input embedding, so the base checkpoint
    has no lm_head.weight; Tinker's targets include lm_head, and the export must still check
    it against the embedding's shape instead of refusing the whole state."""
    base = load_base("tiny-llama")
    adapted = AdaptedModel(base.model, resolve_tinker_targets(base.model))
    bank = adapted.add_bank("train", num_slots=2, r_max=4)
    slot = bank.allocate(SPEC)
    gen = torch.Generator().manual_seed(5)
    weights = {
        path: (torch.randn(A.shape, generator=gen) * 0.2, torch.randn(B.shape, generator=gen) * 0.2)
        for path, (A, B) in bank.slot_weights(slot).items()
    }
    assert "lm_head" in weights
    bank.load_slot_weights(slot, weights)
    ids = torch.randint(0, 500, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), adapted.routing("train", bank.slot_ids_for_rows([slot], ids.shape[1])):
        ours = adapted.model(ids).logits
    ckpt = tmp_path / "ckpt"
    write_training_state(
        ckpt,
        spec=AdapterSpec(rank=SPEC.rank, alpha=SPEC.alpha, seed=SPEC.seed, targets=tuple(weights)),
        base_model_id="tiny-llama",
        weights=bank.slot_weights(slot),
        moments=None,
        step=None,
        hparams=None,
    )
    out = tmp_path / "adapter"
    export_checkpoint(str(ckpt), out)
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(resolve_base("tiny-llama")[1], dtype=torch.float32)
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(model, str(out)).eval()(ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("source", ["training_state", "peft"])
def test_merged_loads_in_transformers_with_the_adapted_logits(trained, tmp_path, source):
    src = trained["ckpt"]
    if source == "peft":
        src = export_checkpoint(str(src), tmp_path / "peft").dest
    out = tmp_path / "merged"
    result = export_checkpoint(str(src), out, merged=True)
    assert (result.kind, result.source_format) == ("merged", source)
    _assert_private(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        _assert_same(model(trained["ids"]).logits, trained)
    base_dir = resolve_base(BASE)[1]
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert (
        tokenizer("guess 512").input_ids
        == AutoTokenizer.from_pretrained(base_dir)("guess 512").input_ids
    )


def test_merged_bf16_is_cast_once_from_the_fp32_merge(trained, tmp_path):
    fp32 = export_checkpoint(str(trained["ckpt"]), tmp_path / "fp32", merged=True).dest
    bf16 = export_checkpoint(
        str(trained["ckpt"]), tmp_path / "bf16", merged=True, dtype="bfloat16"
    ).dest
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    from safetensors.torch import load_file

    full, half = load_file(fp32 / "model.safetensors"), load_file(bf16 / "model.safetensors")
    assert full.keys() == half.keys()
    for name, t in full.items():
        assert half[name].dtype == torch.bfloat16
        assert torch.equal(half[name], t.to(torch.bfloat16)), name


def test_existing_destination_is_refused_unless_overwrite(trained, tmp_path):
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "keep").write_text("mine")
    with pytest.raises(ExportError, match="already exists"):
        export_checkpoint(str(trained["ckpt"]), out)
    assert [p.name for p in out.iterdir()] == ["keep"]
    export_checkpoint(str(trained["ckpt"]), out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no temp dirs left


def test_bad_sources_are_refused_by_name_and_leave_nothing(trained, tmp_path):
    not_ckpt = tmp_path / "plain"
    not_ckpt.mkdir()
    (not_ckpt / "notes.txt").write_text("hello")
    out = tmp_path / "made" / "deeper" / "out"
    cases = {
        str(tmp_path / "missing"): "no such checkpoint directory",
        str(not_ckpt): "is not a checkpoint directory",
        "tinker://run/unknown_kind/x": "must look like tinker://",
        "tinker://run/weights/../x": "must look like tinker://",
        "tinker://run/weights/x y": "may only contain",
    }
    for source, message in cases.items():
        with pytest.raises(ExportError, match=message) as info:
            export_checkpoint(source, out)
        assert source in str(info.value)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "state.json").write_text("{not json")
    with pytest.raises(ExportError, match="not a readable lorafleet checkpoint"):
        export_checkpoint(str(broken), out)
    run = tmp_path / "run"  # what `lorafleet rl` / `sft` leave in a tenant's run dir
    (run / "adapter").mkdir(parents=True)
    (run / "state.json").write_text(
        json.dumps({"step": 3, "state_path": "tinker://r:train:0/weights/s3", "sampler_path": "x"})
    )
    with pytest.raises(ExportError, match=r"run record.*adapter \(its PEFT adapter\).*weights/s3"):
        export_checkpoint(str(run), out)
    with pytest.raises(ExportError, match="dtype must be one of"):
        export_checkpoint(str(trained["ckpt"]), out, dtype="int8")
    with pytest.raises(ExportError, match="needs --api-key"):
        export_checkpoint("tinker://run/weights/x", out, base_url="http://127.0.0.1:9")
    with pytest.raises(ExportError, match="is not available here"):
        export_checkpoint(str(trained["ckpt"]), out, merged=True, base_model=str(not_ckpt))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "plain", "run"]


def test_cli_prints_one_line_and_exits_2(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    code = cli.main(["export", str(tmp_path / "nope"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USER_ERROR
    assert err.count("\n") == 1 and str(tmp_path / "nope") in err
    assert cli.main(["export", str(trained["ckpt"]), str(tmp_path / "out")]) == 0
    assert "wrote PEFT adapter" in capsys.readouterr().out


# ------------------------------------------------------------------ archive extraction


def _tar(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            info.size = len(data) if info.isfile() else 0
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return buf.getvalue()


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def _link(name: str, target: str, kind: bytes) -> tuple[tarfile.TarInfo, bytes]:
    """A member of another type than a regular file (link, directory, device)."""
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, b""


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ([_file("../escape")], "may only contain"),
        ([_file("/etc/passwd")], "may only contain"),
        ([_file("sub/file")], "may only contain"),
        ([_file(".hidden")], "must not start with"),
        ([_link("state.json", "/etc/passwd", tarfile.SYMTYPE)], "not a regular file"),
        ([_file("a"), _link("b", "a", tarfile.LNKTYPE)], "not a regular file"),
        ([_link("d", "", tarfile.DIRTYPE)], "not a regular file"),
        ([_link("dev", "", tarfile.CHRTYPE)], "not a regular file"),
        ([_file("a"), _file("a")], "twice"),
        ([_file(f"f{i}") for i in range(17)], "more than 16 files"),
        ([_file("big", b"y" * 600)], "exceed 512 bytes"),
    ],
)
def test_extraction_refuses_unsafe_archives(tmp_path, members, message):
    archive = tmp_path / "a.tar"
    archive.write_bytes(_tar(members))
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(ExportError, match=message):
        _extract(archive, into, "tinker://r/weights/x", max_bytes=512)
    assert list(into.iterdir()) == []
    assert not (tmp_path / "escape").exists()


def test_extraction_takes_flat_files_owner_only(tmp_path):
    archive = tmp_path / "a.tar"
    archive.write_bytes(_tar([_file("state.json", b"{}"), _file("weights.safetensors", b"w")]))
    into = tmp_path / "into"
    into.mkdir()
    _extract(archive, into, "src", max_bytes=512)
    assert sorted(p.name for p in into.iterdir()) == ["state.json", "weights.safetensors"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in into.iterdir())
    archive.write_bytes(b"\x1f\x8b not a tar")
    with pytest.raises(ExportError, match="not a readable"):
        _extract(archive, tmp_path, "src", max_bytes=512)
