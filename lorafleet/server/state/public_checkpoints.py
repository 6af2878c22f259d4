"""Published checkpoints: what `publish_checkpoint_from_tinker_path` shares with other tenants.

Publishing shares a checkpoint's weights, not the checkpoint: another tenant may start a
training run from it (`create_training_client_from_state`, a fresh optimizer), sample from it
and copy a published sampler checkpoint, but never load its optimizer state (the moments carry
information about the owner's training data the owner did not choose to share), never delete,
re-publish or change it, and never list it except through the run's listings. The flag lives
in the checkpoint row's `info`, so no schema change is needed for it.
"""

from __future__ import annotations

from lorafleet.server.errors import UserError
from lorafleet.server.state.store import CheckpointRow

PUBLISHABLE = ("training", "sampler")


def is_public(row: CheckpointRow) -> bool:
    return bool(row.info.get("public", False))


def with_public(row: CheckpointRow, public: bool) -> CheckpointRow:
    """`row` with the flag set; external exports are refused: their files are served only
    through links signed for their owner."""
    if row.kind not in PUBLISHABLE:
        raise UserError(
            f"{row.tinker_path} is a {row.kind} checkpoint; only training (weights/...) and "
            "sampler (sampler_weights/...) checkpoints can be published"
        )
    row.info = {**row.info, "public": public}
    return row


def optimizer_refused(path: str) -> UserError:
    return UserError(
        f"{path} is another tenant's published checkpoint: publishing shares its weights only, "
        "so load it without the optimizer state (create_training_client_from_state)",
        status=403,
    )
