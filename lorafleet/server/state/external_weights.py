"""`save_weights_external`: a model's adapter as a Hugging Face PEFT directory
(`adapter_config.json` + `adapter_model.safetensors`) that clients download file by file through
signed links (`external_weights_urls`), encrypted with age to the recipients the client names.

The cookbook's `weights.download` of a training checkpoint generates a fresh age key, asks for an
export encrypted to it, downloads and decrypts. Encryption is pyrage (the Rust `age` crate),
never a cipher of our own; each file `f` is stored as `f.age`, as the SDK documents.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pyrage

from lorafleet.adapters.peft_io import ExportableBank, export_peft
from lorafleet.fsio import atomic_directory
from lorafleet.server.errors import UserError

MAX_RECIPIENTS = 10  # the SDK's documented limit
AGE_SUFFIX = ".age"
_SSH_PREFIXES = ("ssh-ed25519 ", "ssh-rsa ")


def _recipient(value: str) -> Any:
    if value.startswith(_SSH_PREFIXES):
        return pyrage.ssh.Recipient.from_str(value)
    return pyrage.x25519.Recipient.from_str(value)


def parse_recipients(values: list[str] | None) -> tuple[str, ...]:
    """Checks every recipient before anything is written, so a typo in the third key is a
    clear error rather than an export encrypted to two of three intended readers."""
    if values is None:
        return ()
    if not values:
        raise UserError(
            "age_encryption_recipients is an empty list; pass null for an unencrypted export "
            "or at least one recipient"
        )
    if len(values) > MAX_RECIPIENTS:
        raise UserError(
            f"age_encryption_recipients has {len(values)} entries, at most {MAX_RECIPIENTS} allowed"
        )
    for i, value in enumerate(values):
        try:
            _recipient(value)
        except pyrage.RecipientError as exc:
            raise UserError(
                f"age_encryption_recipients[{i}] {value[:80]!r} is not an age recipient "
                f"(age1... or an ssh-ed25519 / ssh-rsa public key): {exc}"
            ) from None
    return tuple(values)


def write_export(
    bank: ExportableBank,
    slot: int,
    dest: Path,
    *,
    base_model_name_or_path: str,
    recipients: tuple[str, ...],
) -> Path:
    """Writes the adapter in `slot` to `dest` (published atomically, owner-only): the PEFT
    files as they are, or each encrypted to `recipients` as `<file>.age`."""
    with atomic_directory(dest) as tmp:
        plain = tmp / "peft"  # inside the temp dir: a crash leaves nothing that looks published
        export_peft(bank, slot, plain, base_model_name_or_path=base_model_name_or_path)
        parsed = [_recipient(r) for r in recipients]
        for source in sorted(plain.iterdir()):
            if parsed:
                pyrage.encrypt_file(str(source), str(tmp / (source.name + AGE_SUFFIX)), parsed)
            else:
                os.rename(source, tmp / source.name)
        shutil.rmtree(plain)
    return dest


def export_files(directory: Path) -> list[str]:
    """The files a download may serve from an export: its regular, visible top-level files.
    Anything else (a symlink, a directory, a hidden name) is never served."""
    names = []
    for entry in sorted(directory.iterdir()):
        st = os.lstat(entry)
        if entry.name.startswith(".") or not stat.S_ISREG(st.st_mode):
            continue
        names.append(entry.name)
    return names
