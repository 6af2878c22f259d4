"""A base model's tokenizer, placed in the Hugging Face hub cache under a hub-style name.

Tinker clients load tokenizers by name through transformers (`AutoTokenizer.from_pretrained`):
the SDK's `TrainingClient.get_tokenizer()` uses the `tokenizer_id` the server reports,
`SamplingClient.get_tokenizer()` and the cookbook's `get_tokenizer(name)` use the base model's
name. A preset name such as `tiny-qwen3` is no hub repository, so offline that lookup fails
unless the cache already holds a snapshot under the name. Writing one, in the cache's own
layout (`models--<org>--<name>/snapshots/<revision>/` plus `refs/main`), makes the plain name
load with `HF_HUB_OFFLINE=1`; it also keeps the server's directories out of what tenants see
(a `tokenizer_id` that is a server path means nothing on the client's machine).

The revision is a hash of the files, so writing the same tokenizer again is a no-op and a
changed one gets a new snapshot. A snapshot lorafleet did not write (a real download under the
same name) is never replaced.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from lorafleet.fsio import atomic_directory, atomic_write_bytes, ensure_private_dir

MARKER = "lorafleet-tokenizer.json"  # in every snapshot this module writes
PRESET_MARKER = "lorafleet.json"  # what a materialised preset directory carries (presets.py)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "config.json",  # AutoTokenizer reads the model type from it when the tokenizer config is silent
)
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def default_cache() -> Path:
    """The hub cache transformers reads in this process ($HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub), as huggingface_hub resolved it when first imported."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def check_repo_id(repo_id: str) -> str:
    """A hub-style name (`name` or `org/name`) that maps to exactly one cache folder."""
    if (
        not isinstance(repo_id, str)
        or not _REPO_ID.fullmatch(repo_id)
        or "--" in repo_id
        or ".." in repo_id
        or len(repo_id) > 96
    ):
        raise ValueError(
            f"tokenizer name {repo_id!r} must look like 'name' or 'org/name' (letters, digits, "
            "'.', '_', '-'; no '--' or '..'; at most 96 characters)"
        )
    return repo_id


def repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + check_repo_id(repo_id).replace("/", "--"))


def hub_name_of(model_dir: Path) -> str | None:
    """`org/name` when `model_dir` is a snapshot inside a hub cache (it already loads by that
    name wherever that cache is the client's), else None."""
    snapshots = model_dir.parent
    repo = snapshots.parent
    if snapshots.name != "snapshots" or not repo.name.startswith("models--"):
        return None
    name = repo.name.removeprefix("models--").replace("--", "/")
    try:
        return check_repo_id(name)
    except ValueError:
        return None


def tokenizer_name(model_dir: Path) -> str:
    """The name clients are told to load a base model's tokenizer by: the preset's name for a
    materialised preset, the hub name of a hub-cache snapshot, else the directory's own name."""
    marker = model_dir / PRESET_MARKER
    if marker.is_file():
        preset = json.loads(marker.read_text()).get("preset")
        if isinstance(preset, str):
            return check_repo_id(preset)
    hub = hub_name_of(model_dir)
    if hub is not None:
        return hub
    name = re.sub(r"-{2,}", "-", re.sub(r"[^A-Za-z0-9._-]+", "-", model_dir.name))
    name = re.sub(r"\.{2,}", ".", name).strip("-._")[:96]
    return check_repo_id(name or "base-model")


def publish_tokenizer(model_dir: Path, cache: Path | None = None) -> str:
    """Makes the base model in `model_dir` loadable by `tokenizer_name` from the hub cache and
    returns that name. A hub-cache snapshot is left where it is: it already loads by name."""
    name = tokenizer_name(model_dir)
    if hub_name_of(model_dir) is None:
        install_tokenizer(name, model_dir, cache)
    return name


def _revision(files: dict[str, bytes]) -> str:
    digest = hashlib.sha1(usedforsecurity=False)
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return digest.hexdigest()  # 40 hex digits, like a git commit: what refs/main holds


def install_tokenizer(repo_id: str, model_dir: Path, cache: Path | None = None) -> Path:
    """Places `model_dir`'s tokenizer files in the hub cache as `repo_id`'s `main` revision and
    returns the snapshot directory. Raises FileExistsError when `repo_id`'s `main` is a
    snapshot lorafleet did not write, FileNotFoundError when `model_dir` has no tokenizer."""
    cache = default_cache() if cache is None else cache
    files = {
        name: (model_dir / name).read_bytes()
        for name in TOKENIZER_FILES
        if (model_dir / name).is_file()
    }
    if not any(name.startswith("tokenizer") for name in files):
        raise FileNotFoundError(
            f"{model_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)"
        )
    files[MARKER] = (json.dumps({"written_by": "lorafleet", "name": repo_id}) + "\n").encode()
    revision = _revision(files)
    repo = repo_folder(cache, repo_id)
    ref = repo / "refs" / "main"
    if ref.is_file():
        current = ref.read_text().strip()
        held = repo / "snapshots" / current
        if current != revision and held.is_dir() and not (held / MARKER).is_file():
            raise FileExistsError(
                f"the hub cache {cache} already holds {repo_id!r} (revision {current}) from elsewhere; "
                "not replacing it"
            )
    snapshot = repo / "snapshots" / revision
    if not (snapshot / MARKER).is_file():
        ensure_private_dir(snapshot.parent)
        with atomic_directory(snapshot, overwrite=True) as tmp:
            for name, data in files.items():
                (tmp / name).write_bytes(data)
    ensure_private_dir(ref.parent)
    atomic_write_bytes(ref, revision.encode())
    return snapshot
