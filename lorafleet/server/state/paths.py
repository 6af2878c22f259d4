"""`tinker://` paths and where their files live under the data directory.

`tinker://<model_id>/weights/<name>` (training state: weights + optimizer) and
`tinker://<model_id>/sampler_weights/<name>` (a PEFT adapter) and
`tinker://<model_id>/external_weights/<name>` (a PEFT export for download, age-encrypted on
request) map to
`<data>/tenants/<tenant>/runs/<model_id with ':' as '.'>/<segment>/<name>`. Every component is
checked with `safe_name` before it reaches the filesystem; the SQLite checkpoint table, not the
filesystem, decides what exists and who owns it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lorafleet.fsio import safe_name
from lorafleet.server.errors import UserError

SCHEME = "tinker://"
TENANTS_DIR = "tenants"  # under the data dir
SEGMENTS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
"""Path segment -> checkpoint_type as the SDK names it."""


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    segment: str  # "weights" | "sampler_weights" | "external_weights"
    name: str

    @property
    def kind(self) -> str:
        return SEGMENTS[self.segment]

    @property
    def checkpoint_id(self) -> str:
        return f"{self.segment}/{self.name}"

    def __str__(self) -> str:
        return f"{SCHEME}{self.model_id}/{self.segment}/{self.name}"


def checkpoint_name(name: object, field: str = "path") -> str:
    try:
        return safe_name(name, field)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def parse_tinker_path(value: object, field: str = "path") -> TinkerPath:
    if not isinstance(value, str) or not value.startswith(SCHEME):
        raise UserError(
            f"{field} must look like tinker://<model_id>/weights/<name> or .../sampler_weights/<name>, got {value!r}"
        )
    parts = value[len(SCHEME) :].split("/")
    if len(parts) != 3 or not parts[0]:
        raise UserError(
            f"{field} {value!r} must have exactly three parts: tinker://<model_id>/<kind>/<name>"
        )
    model_id, segment, name = parts
    if segment not in SEGMENTS:
        raise UserError(f"{field} {value!r}: kind {segment!r} is not one of {', '.join(SEGMENTS)}")
    return TinkerPath(model_id=model_id, segment=segment, name=checkpoint_name(name, field))


def run_dir_name(model_id: str) -> str:
    """Model ids are `<uuid>:train:<n>`, issued by this server; ':' is not filename-safe."""
    return checkpoint_name(model_id.replace(":", "."), "model_id")


def checkpoint_dir(data_dir: Path, tenant: str, path: TinkerPath) -> Path:
    return (
        data_dir
        / TENANTS_DIR
        / checkpoint_name(tenant, "tenant")
        / "runs"
        / run_dir_name(path.model_id)
        / path.segment
        / checkpoint_name(path.name)
    )


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
