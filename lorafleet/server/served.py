"""What this server serves, as the HTTP side sees it: the base model's names and limits, read
once from the executor when it is built, so that request checks never reach into the engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lorafleet.server.errors import UserError


@dataclass(frozen=True)
class ServedBase:
    base_id: str  # preset name or absolute directory: what checkpoints record
    base_path: Path  # the directory, which is also the tokenizer id clients are given
    arch: str
    context_length: int | None
    max_lora_rank: int
    lora_alpha: float

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys([self.base_id, str(self.base_path)]))

    def check(self, name: str | None, field: str = "base_model") -> str:
        """The base is addressable by preset name and by its directory (cookbook code loads the
        tokenizer from the name, so offline it has to be a path)."""
        if isinstance(name, str) and name in self.names:
            return name
        if isinstance(name, str) and name and ("/" in name or name.startswith("~")):
            try:
                if Path(name).expanduser().resolve() == self.base_path.resolve():
                    return name
            except (OSError, RuntimeError, ValueError):  # ValueError: a NUL byte in the name
                pass
        raise UserError(
            f"{field} {name!r} is not served here; this server serves {' or '.join(map(repr, self.names))}"
        )
