"""`lorafleet export`: a trained adapter out of lorafleet, as a PEFT directory or a merged model.

The source is a local checkpoint directory (a lorafleet training state, as `save_state`,
`lorafleet rl` and `sft` write it, or a PEFT adapter directory, as `save_weights_for_sampler`
writes it) or a `tinker://` path on a server, fetched through the checkpoint archive route
(`GET .../checkpoints/<id>/archive`: a 302 to a signed link serving an uncompressed tar) with
the caller's key, so another tenant's path is the server's 404 and a wrong key its 401.

The output is what the rest of the ecosystem loads without lorafleet:
- a PEFT directory (`PeftModel.from_pretrained`, vLLM `--lora-modules`);
- with `merged=True`, a full Hugging Face checkpoint (`AutoModelForCausalLM.from_pretrained`):
  W + scale * B @ A computed in fp32 from the pristine base (`sync.merged.PristineBase`, the
  merge the `merged` sync mode runs) and cast once, with the base's config and tokenizer.

Either is published atomically and owner-only (`fsio.atomic_directory`); an existing
destination is refused unless `overwrite`, and then swapped whole. A fetched archive is trusted
for nothing: only flat, regular files with safe names are extracted, and the archive's size is
bounded before and while it is read. Any failure leaves no output and no staging files.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lorafleet.adapters.checkpoint import CheckpointError, read_training_state
from lorafleet.adapters.peft_io import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    PeftFormatError,
    peft_config,
    read_peft,
)
from lorafleet.fsio import (
    atomic_directory,
    atomic_save_safetensors,
    atomic_write_json,
    ensure_private_dir,
    safe_name,
)
from lorafleet.model.banks import AdapterSpec
from lorafleet.sync.base import SyncError
from lorafleet.sync.merged import PristineBase

__all__ = [
    "DEFAULT_MAX_ARCHIVE_BYTES",
    "DTYPES",
    "ExportError",
    "ExportResult",
    "export_checkpoint",
]

log = logging.getLogger(__name__)

SCHEME = "tinker://"
SEGMENTS = ("weights", "sampler_weights", "external_weights")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_ARCHIVE_BYTES = 32 << 30
MAX_ARCHIVE_MEMBERS = 16  # a checkpoint is a handful of files
_CHUNK = 1 << 20
STATE_NAME = "state.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class ExportError(ValueError):
    """Bad input or a refused source: one line naming the value (the CLI prints it, exit 2)."""


@dataclass(frozen=True)
class ExportResult:
    dest: Path
    kind: str  # "peft" | "merged"
    source_format: str  # "training_state" | "peft"
    base_model: str | None  # what the adapter was recorded against (or --base-model)


@dataclass(frozen=True)
class _Adapter:
    """A checkpoint read and validated, in either source format."""

    source_format: str
    spec: AdapterSpec | None  # the training state's signature; None for a PEFT source
    config: dict[str, Any] | None  # the PEFT source's adapter_config.json
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # path -> fp32 (A, B), dense
    base_model: str | None
    directory: Path

    @property
    def scale(self) -> float:
        if self.spec is not None:
            return float(self.spec.scale)
        assert self.config is not None
        spec = AdapterSpec(
            rank=int(self.config["r"]),
            alpha=float(self.config["lora_alpha"]),
            use_rslora=bool(self.config.get("use_rslora", False)),
        )
        return float(spec.scale)


# ------------------------------------------------------------------------------ reading


def _refuse_run_record(directory: Path, what: str) -> None:
    """`lorafleet rl` / `sft` keep a `state.json` of their own in a run dir (what `--resume`
    continues from: tinker paths, not weights); point at what does hold the weights."""
    try:
        doc = json.loads((directory / STATE_NAME).read_text())
    except (OSError, ValueError):
        return  # read_training_state names the problem
    if isinstance(doc, dict) and "format" not in doc and "state_path" in doc:
        adapter = directory / "adapter"
        hint = f"{adapter} (its PEFT adapter) or " if adapter.is_dir() else ""
        raise ExportError(
            f"{what} is a lorafleet rl/sft run record, not a checkpoint: export {hint}its "
            f"checkpoint {doc['state_path']} (with --base-url and --api-key)"
        )


def _read_local(directory: Path, what: str) -> _Adapter:
    if not directory.exists():
        raise ExportError(f"{what}: no such checkpoint directory")
    if not directory.is_dir():
        raise ExportError(f"{what} is not a directory")
    if (directory / STATE_NAME).is_file():
        _refuse_run_record(directory, what)
        try:
            state = read_training_state(directory)
        except CheckpointError as exc:
            raise ExportError(f"{what}: not a readable lorafleet checkpoint: {exc}") from None
        return _Adapter(
            "training_state",
            state.spec,
            None,
            dict(state.weights),
            state.base_model_id,
            directory,
        )
    if (directory / CONFIG_NAME).is_file():
        try:
            config, weights = read_peft(directory)
        except PeftFormatError as exc:
            raise ExportError(f"{what}: not a readable PEFT adapter: {exc}") from None
        base = config.get("base_model_name_or_path")
        return _Adapter(
            "peft",
            None,
            config,
            weights,
            base if isinstance(base, str) and base else None,
            directory,
        )
    encrypted = sorted(p.name for p in directory.glob("*.age"))
    if encrypted:
        raise ExportError(
            f"{what} holds age-encrypted files {encrypted}: decrypt them with `age -d` first"
        )
    raise ExportError(
        f"{what} is not a checkpoint directory: expected {STATE_NAME} (a lorafleet training "
        f"checkpoint) or {CONFIG_NAME} (a PEFT adapter)"
    )


# ------------------------------------------------------------------------------ remote


@dataclass(frozen=True)
class _RemotePath:
    run_id: str
    segment: str
    name: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.run_id}/{self.segment}/{self.name}"


def _parse_tinker_path(value: str) -> _RemotePath:
    parts = value[len(SCHEME) :].split("/")
    if len(parts) != 3 or not parts[0] or parts[1] not in SEGMENTS:
        raise ExportError(
            f"source {value!r} must look like tinker://<run>/<{'|'.join(SEGMENTS)}>/<name>"
        )
    try:
        safe_name(parts[2], "checkpoint name")
        if any(c in parts[0] for c in "?#%\\ ") or parts[0] in (".", ".."):
            raise ValueError(f"run id {parts[0]!r} has characters a run id never has")
    except ValueError as exc:
        raise ExportError(f"source {value!r}: {exc}") from None
    return _RemotePath(parts[0], parts[1], parts[2])


def _error_text(response: Any) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200].strip() or response.reason_phrase
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return body["error"]
    return json.dumps(body)[:200]


def _check(response: Any, source: str, what: str) -> None:
    if response.status_code >= 400:
        raise ExportError(
            f"{source}: {what} failed: the server answered {response.status_code}: "
            f"{_error_text(response)}"
        )


def _fetch_archive(
    path: _RemotePath,
    *,
    base_url: str,
    api_key: str,
    archive: Path,
    max_bytes: int,
) -> str | None:
    """Downloads the checkpoint's tar to `archive`; returns the base model the server records."""
    import httpx

    source = str(path)
    headers = {"X-API-Key": api_key}
    checkpoint_id = f"{path.segment}/{quote(path.name)}"
    run = quote(path.run_id, safe=":")
    try:
        with httpx.Client(base_url=base_url, timeout=60, follow_redirects=False) as client:
            info = client.post(
                "/api/v1/weights_info", headers=headers, json={"tinker_path": source}
            )
            _check(info, source, "weights_info")
            base_model = info.json().get("base_model")
            answer = client.get(
                f"/api/v1/training_runs/{run}/checkpoints/{checkpoint_id}/archive",
                headers=headers,
            )
            _check(answer, source, "the archive request")
            link = answer.headers.get("location")
            if answer.status_code != 302 or not link:
                raise ExportError(
                    f"{source}: the archive request answered {answer.status_code} without a "
                    "download link (is this a lorafleet server?)"
                )
            # The signed link is the credential: the key is not sent to wherever it points.
            with client.stream("GET", link) as download:
                _check(download, source, "the archive download")
                declared = int(download.headers.get("content-length") or 0)
                if declared > max_bytes:
                    raise ExportError(
                        f"{source}: the archive is {declared} bytes, over the limit of {max_bytes} "
                        "(--max-archive-bytes)"
                    )
                received = 0
                with archive.open("xb") as out:
                    for chunk in download.iter_bytes(_CHUNK):
                        received += len(chunk)
                        if received > max_bytes:
                            raise ExportError(
                                f"{source}: the archive exceeds the limit of {max_bytes} bytes "
                                "(--max-archive-bytes)"
                            )
                        out.write(chunk)
    except httpx.HTTPError as exc:
        raise ExportError(f"{source}: cannot fetch from {base_url}: {exc}") from None
    return base_model if isinstance(base_model, str) and base_model else None


def _extract(archive: Path, into: Path, source: str, max_bytes: int) -> None:
    """Extracts only flat regular files with safe names, within `max_bytes` in all."""
    try:
        with tarfile.open(archive, "r:") as tar:
            members: list[tarfile.TarInfo] = []
            total = 0
            for member in tar:
                if len(members) >= MAX_ARCHIVE_MEMBERS:
                    raise ExportError(
                        f"{source}: the archive has more than {MAX_ARCHIVE_MEMBERS} files"
                    )
                if not member.isfile():
                    raise ExportError(
                        f"{source}: the archive holds {member.name!r}, which is not a regular "
                        "file (links, directories and devices are refused)"
                    )
                try:
                    safe_name(member.name, "archive member")
                except ValueError as exc:
                    raise ExportError(f"{source}: unsafe archive member: {exc}") from None
                if any(m.name == member.name for m in members):
                    raise ExportError(f"{source}: the archive holds {member.name!r} twice")
                total += member.size
                if total > max_bytes:
                    raise ExportError(
                        f"{source}: the archive's files exceed {max_bytes} bytes "
                        "(--max-archive-bytes)"
                    )
                members.append(member)
            for member in members:
                data = tar.extractfile(member)
                if data is None:
                    raise ExportError(f"{source}: cannot read {member.name!r} from the archive")
                fd = os.open(into / member.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as out:
                    shutil.copyfileobj(data, out, _CHUNK)
    except tarfile.TarError as exc:
        raise ExportError(f"{source}: not a readable (uncompressed) tar archive: {exc}") from None


# ------------------------------------------------------------------------------ writing


def _base_dir(base: str | None, source: str) -> Path:
    from lorafleet.model.loader import resolve_base

    if base is None:
        raise ExportError(
            f"{source}: the checkpoint records no base model; pass --base-model (a preset or "
            "a local HF directory)"
        )
    try:
        return resolve_base(base)[1]
    except (OSError, ValueError, RuntimeError) as exc:
        raise ExportError(
            f"{source}: base model {base!r} is not available here ({exc}); pass --base-model "
            "with a preset name or a local copy of it"
        ) from None


def _dense_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the base checkpoint, read from the safetensors headers only."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def _check_dense(adapter: _Adapter, model_dir: Path, source: str) -> None:
    """A training state stores every layer as dense A/B; fused MoE expert layers need the
    base model's expert layout to become PEFT, which this path does not write."""
    shapes = _dense_shapes(model_dir)
    tied = _tied_output_shape(model_dir, shapes)
    for path, (A, B) in adapter.weights.items():
        shape = shapes.get(f"{path}.weight")
        if shape is None and path == "lm_head":
            # a base with tied embeddings stores no lm_head.weight: its output layer is the
            # input embedding (trained by default, as Tinker does; PEFT adapts it as a Linear)
            shape = tied
        if shape != (B.shape[0], A.shape[1]):
            raise ExportError(
                f"{source}: layer {path} is not a linear layer of {model_dir} with shape "
                f"{(B.shape[0], A.shape[1])} (base: {shape}); fused MoE expert adapters export "
                "from a server as sampler checkpoints (save_weights_for_sampler) instead"
            )


def _tied_output_shape(
    model_dir: Path, shapes: dict[str, tuple[int, ...]]
) -> tuple[int, ...] | None:
    """The shape of `lm_head` when the base ties it to its input embedding (config.json's
    `tie_word_embeddings`, Hugging Face's default when absent), else None."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not config.get("tie_word_embeddings", True):
        return None
    return shapes.get("model.embed_tokens.weight")


def _write_peft(adapter: _Adapter, tmp: Path, base_model: str, dtype: torch.dtype | None) -> None:
    if adapter.source_format == "peft":
        assert adapter.config is not None
        config = dict(adapter.config)
        config["base_model_name_or_path"] = base_model
        tensors = load_file(adapter.directory / WEIGHTS_NAME)
        if dtype is not None:
            tensors = {k: t.to(dtype) for k, t in tensors.items()}
        atomic_write_json(tmp / CONFIG_NAME, config)
        atomic_save_safetensors(tmp / WEIGHTS_NAME, tensors, metadata={"format": "pt"})
        return
    assert adapter.spec is not None
    cast = torch.float32 if dtype is None else dtype
    targets = list(adapter.weights)
    tensors = {
        f"base_model.model.{path}.lora_{which}.weight": t.to(cast)
        for path, (A, B) in adapter.weights.items()
        for which, t in (("A", A), ("B", B))
    }
    atomic_write_json(tmp / CONFIG_NAME, peft_config(adapter.spec, targets, base_model))
    atomic_save_safetensors(tmp / WEIGHTS_NAME, tensors, metadata={"format": "pt"})


def _copy_model_files(model_dir: Path, tmp: Path, dtype: torch.dtype) -> None:
    """config.json (its dtype set to the one written) and every non-weight file beside it:
    tokenizer, chat template, generation config."""
    for item in sorted(model_dir.iterdir()):
        if item.name.startswith(".") or not item.is_file() or item.is_symlink():
            continue
        if item.name.endswith(_WEIGHT_SUFFIXES) or item.name in _WEIGHT_INDEXES:
            continue
        if item.name == "config.json":
            config = json.loads(item.read_text())
            name = str(dtype).removeprefix("torch.")
            config["dtype"] = name
            if "torch_dtype" in config:
                config["torch_dtype"] = name
            atomic_write_json(tmp / "config.json", config)
            continue
        shutil.copyfile(item, tmp / item.name)


def _write_merged(
    adapter: _Adapter, tmp: Path, model_dir: Path, dtype: torch.dtype, source: str
) -> None:
    try:
        base = PristineBase(model_dir, dtype)
        tensors = base.merge_weights(adapter.weights, adapter.scale)
    except SyncError as exc:
        raise ExportError(f"{source}: cannot merge into {model_dir}: {exc}") from None
    atomic_save_safetensors(tmp / "model.safetensors", tensors, metadata={"format": "pt"})
    _copy_model_files(model_dir, tmp, dtype)


# ------------------------------------------------------------------------------ entry


@contextlib.contextmanager
def _staging(parent: Path, name: str) -> Iterator[Path]:
    """A private scratch dir next to the destination, removed whatever happens."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.fetch-", dir=parent))
    try:
        yield tmp
    finally:
        # The outcome (an export or its error) is what matters; a leftover is said, not raised.
        shutil.rmtree(
            tmp, onerror=lambda _f, path, exc: log.warning("could not remove %s: %s", path, exc[1])
        )


def _missing_parents(dest: Path) -> list[Path]:
    missing = []
    current = dest.parent
    while not current.exists() and current.parent != current:
        missing.append(current)
        current = current.parent
    return missing


def export_checkpoint(
    source: str,
    dest: str | os.PathLike[str],
    *,
    merged: bool = False,
    dtype: str | None = None,
    base_model: str | None = None,
    overwrite: bool = False,
    base_url: str | None = None,
    api_key: str | None = None,
    max_archive_bytes: int | None = None,
) -> ExportResult:
    """Writes `source` (a local checkpoint dir or a `tinker://` path) to `dest`.

    `dtype`: the merged model's dtype (default float32), or a cast of the PEFT tensors (default:
    as stored). `base_model`: the base for `merged` and for the PEFT config's
    `base_model_name_or_path`, instead of the one the checkpoint records.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    torch_dtype = DTYPES[dtype] if dtype is not None else None
    if max_archive_bytes is None:
        max_archive_bytes = DEFAULT_MAX_ARCHIVE_BYTES
    if max_archive_bytes < 1:
        raise ExportError(f"max_archive_bytes must be >= 1, got {max_archive_bytes}")
    dest = Path(dest)
    if dest.name in ("", ".", ".."):
        raise ExportError(f"destination {str(dest)!r} must name a new directory")
    if os.path.lexists(dest) and not overwrite:
        raise ExportError(f"destination {dest} already exists (pass --overwrite to replace it)")
    remote = source.startswith(SCHEME)
    path = _parse_tinker_path(source) if remote else None
    if remote:
        base_url = base_url or os.environ.get("TINKER_BASE_URL")
        api_key = api_key or os.environ.get("TINKER_API_KEY")
        if not base_url:
            raise ExportError(
                f"{source}: a tinker:// source needs --base-url (or $TINKER_BASE_URL)"
            )
        if not api_key:
            raise ExportError(f"{source}: a tinker:// source needs --api-key (or $TINKER_API_KEY)")
    created = _missing_parents(dest)
    try:
        ensure_private_dir(dest.parent)
        with _staging(dest.parent, dest.name) as staging:
            if path is not None:
                assert base_url is not None and api_key is not None
                fetched = staging / "checkpoint"
                fetched.mkdir(mode=0o700)
                archive = staging / "archive.tar"
                recorded = _fetch_archive(
                    path,
                    base_url=base_url.rstrip("/"),
                    api_key=api_key,
                    archive=archive,
                    max_bytes=max_archive_bytes,
                )
                _extract(archive, fetched, source, max_archive_bytes)
                archive.unlink()
                adapter = _read_local(fetched, source)
                # The server's record names the base as its client asked for it; the files'
                # own field may be a path on the server's machine.
                if recorded is not None:
                    adapter = _replace_base(adapter, recorded)
            else:
                adapter = _read_local(Path(source), source)
            base = base_model or adapter.base_model
            if merged:
                model_dir = _base_dir(base, source)
                with atomic_directory(dest, overwrite=overwrite) as tmp:
                    _write_merged(adapter, tmp, model_dir, torch_dtype or torch.float32, source)
                kind = "merged"
            else:
                if base is None:
                    raise ExportError(
                        f"{source}: the checkpoint records no base model; pass --base-model"
                    )
                if adapter.source_format == "training_state":
                    _check_dense(adapter, _base_dir(base, source), source)
                with atomic_directory(dest, overwrite=overwrite) as tmp:
                    _write_peft(adapter, tmp, base, torch_dtype)
                kind = "peft"
    except FileExistsError as exc:
        _remove_created(created)
        raise ExportError(str(exc)) from None
    except BaseException:
        _remove_created(created)
        raise
    return ExportResult(dest, kind, adapter.source_format, base)


def _replace_base(adapter: _Adapter, base: str) -> _Adapter:
    return _Adapter(
        adapter.source_format,
        adapter.spec,
        adapter.config,
        adapter.weights,
        base,
        adapter.directory,
    )


def _remove_created(created: list[Path]) -> None:
    """The parent directories this export made, removed again (innermost first) when empty."""
    for directory in created:
        with contextlib.suppress(OSError):
            directory.rmdir()
