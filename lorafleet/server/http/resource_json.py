"""The JSON shapes the SDK reads back: server configuration, model info, training runs,
checkpoints, samplers. Pure functions of rows, so every route that shows a run or a checkpoint
shows it the same way."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from lorafleet.server.errors import UserError
from lorafleet.server.http import schemas
from lorafleet.server.http.served import ServedBase
from lorafleet.server.state.paths import parse_tinker_path
from lorafleet.server.state.public_checkpoints import is_public
from lorafleet.server.state.store import CheckpointRow, ModelRow, SamplingSessionRow, SessionRow

MAX_PAGE = 1000


def client_config() -> dict[str, Any]:
    return {
        "pjwt_auth_enabled": False,
        "parallel_fwdbwd_chunks": True,
        "proto_compress_fwdbwd": False,
        "sample_use_retrieve_futures": False,
        "sample_join_sampling_session": False,
        "custom_loss_server_side": False,
    }


def dynamic_config() -> dict[str, Any]:
    return {
        "refresh_interval_sec": 300,
        "sample_cancel_enabled": False,
        "sample_cancel_max_batch_size": 64,
    }


def capabilities(served: ServedBase) -> dict[str, Any]:
    """`lorafleet_limits` is ours: the SDK ignores keys it does not know, and a client that
    reads it can size its requests to what this server accepts."""
    return {
        "supported_models": [
            {
                "model_name": name,
                "max_context_length": served.context_length,
                "trainable": True,
                "sampleable": True,
            }
            for name in served.names
        ],
        "lorafleet_limits": served.limits.as_dict(),
    }


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat()


def _str_dict(value: dict[str, Any] | None) -> dict[str, str] | None:
    return None if value is None else {str(k): str(v) for k, v in value.items()}


def optimizer_config(lora: dict[str, Any]) -> dict[str, Any]:
    """The SDK's `OptimizerConfig` of a run's optimizer family (rows from before the family was
    recorded are AdamW, the only family there was)."""
    family = lora.get("optimizer", "adamw")
    return {"type": "dimuon", "version": 1} if family == "dimuon" else {"type": family}


def model_info(row: ModelRow, served: ServedBase) -> dict[str, Any]:
    return {
        "model_id": row.model_id,
        "model_data": {
            "arch": served.arch,
            "model_name": row.base_model,
            "tokenizer_id": served.tokenizer_id,
        },
        "is_lora": True,
        "lora_rank": row.lora_rank,
        "model_name": row.base_model,
        "optimizer_config": optimizer_config(row.lora),
        "type": "get_info",
    }


def checkpoint(row: CheckpointRow) -> dict[str, Any]:
    path = parse_tinker_path(row.tinker_path)
    return {
        "checkpoint_id": path.checkpoint_id,
        "checkpoint_type": row.kind,
        "time": _iso(row.created_at),
        "tinker_path": row.tinker_path,
        "size_bytes": row.size_bytes,
        "public": is_public(row),
        "user_metadata": row.user_metadata,
        "expires_at": _iso(row.expires_at),
    }


def training_run(
    row: ModelRow, last: CheckpointRow | None, last_sampler: CheckpointRow | None
) -> dict[str, Any]:
    """`last` / `last_sampler`: the run's newest training and sampler checkpoints."""
    return {
        "training_run_id": row.model_id,
        "base_model": row.base_model,
        "model_owner": row.tenant,
        "is_lora": True,
        "corrupted": False,
        "lora_rank": row.lora_rank,
        "last_request_time": _iso(row.last_request_time),
        "last_checkpoint": None if last is None else checkpoint(last),
        "last_sampler_checkpoint": None if last_sampler is None else checkpoint(last_sampler),
        "user_metadata": _str_dict(row.user_metadata),
    }


def weights_info(row: CheckpointRow) -> dict[str, Any]:
    lora = row.info["lora"]
    return {
        "base_model": row.info["base_model"],
        "is_lora": True,
        "lora_rank": lora["rank"],
        "train_unembed": lora["train_unembed"],
        "train_mlp": lora["train_mlp"],
        "train_attn": lora["train_attn"],
        "optimizer_config": optimizer_config(lora),
    }


def sampler(row: SamplingSessionRow) -> dict[str, Any]:
    return {
        "sampler_id": row.sampling_session_id,
        "base_model": row.base_model,
        "model_path": row.model_path,
    }


def page(limit: int, offset: int) -> tuple[int, int]:
    if not 1 <= limit <= MAX_PAGE or not 0 <= offset <= schemas.INT64_MAX:
        raise UserError(
            f"limit must be in [1, {MAX_PAGE}] and offset >= 0, got limit={limit}, offset={offset}"
        )
    return limit, offset


def cursor(offset: int, limit: int, total: int) -> dict[str, int]:
    return {"offset": offset, "limit": limit, "total_count": total}


# ------------------------------------------------------------------ sessions (RestClient)
CLIENT_FINISH_REASONS = ("success", "errored", "interrupted")


def session_status(row: SessionRow) -> dict[str, Any] | None:
    """The SDK's SessionStatus; None (its "neither finished nor known to be running") for a
    session the server finished because its heartbeats stopped."""
    if row.finished_at is None:
        return {"type": "active"}
    if row.finish_reason in CLIENT_FINISH_REASONS:
        return {"type": "client_finished", "reason": {"type": row.finish_reason}, "detail": None}
    return None


def session(row: SessionRow, training_run_ids: list[str], sampler_ids: list[str]) -> dict[str, Any]:
    return {
        "training_run_ids": training_run_ids,
        "sampler_ids": sampler_ids,
        "user_metadata": _str_dict(row.info.get("user_metadata")),
        "display_name": row.info.get("display_name"),
    }


def session_summary(row: SessionRow, checkpoints: int, checkpoint_bytes: int) -> dict[str, Any]:
    """A session without a project reports project_id "" (the SDK's field is a required string)."""
    return {
        "session_id": row.session_id,
        "created_at": _iso(row.created_at),
        "owner": row.tenant,
        "project_id": row.info.get("project_id") or "",
        "status": session_status(row),
        "checkpoints_count": checkpoints,
        "display_name": row.info.get("display_name"),
        "user_metadata": _str_dict(row.info.get("user_metadata")),
        "checkpoint_storage_bytes": checkpoint_bytes,
    }
