"""SGLang's native HTTP server as a RolloutEngine.

Verified only against the request/response shapes of SGLang's documented endpoints (a fake
server in tests/sync/test_sglang.py); SGLang is CUDA-only on PyPI and cannot run on CPUs.
Shapes follow SGLang's `io_struct.py` / `http_server.py` (0.5 series):

- `POST /generate {"input_ids", "sampling_params", "return_logprob", "logprob_start_len",
  "lora_path": <versioned name>}` -> `{"output_ids", "meta_info": {"input_token_logprobs":
  [[logprob, token_id, text], ...], "output_token_logprobs": [...], "finish_reason": {"type"},
  "weight_version"}}`. A LoRA reply does not say which adapter served it; a merged one does
  (`weight_version`, which the merged push sets to the versioned name, and which must match);
- `POST /load_lora_adapter {"lora_name", "lora_path", "pinned"}`, `POST /unload_lora_adapter
  {"lora_name"}` -> `{"success", "error_message", "loaded_adapters"}`: `files` sync;
- `POST /load_lora_adapter_from_tensors {"lora_name", "config_dict", "serialized_tensors",
  "load_format", "pinned"}`: `tensor` sync. The tensors (PEFT key -> CPU tensor) travel as a
  base64 pickle *by value*, which works across hosts. SGLang unpickles this payload: only
  ever point this at an engine you run, on a trusted network, with its API key set;
- `POST /update_weights_from_disk {"model_path", "weight_version", "abort_all_requests"}` ->
  `{"success", "message"}`, then `POST /flush_cache`: `merged` sync;
- `POST /release_memory_occupation {"tags"}` / `POST /resume_memory_occupation {"tags"}`:
  offload level 1 (`kv_cache`) and 2 (`kv_cache`, `weights`; the weights are re-sent after).
"""

from __future__ import annotations

import base64
import pickle
from typing import Any

from lorafleet.sync.base import (
    AdapterUpdate,
    AdapterVersion,
    OffloadLevel,
    RolloutEngineError,
    RolloutRequest,
    RolloutResult,
    SyncError,
    SyncMode,
)
from lorafleet.sync.remote import HttpEngine, RequestPlan

__all__ = ["SglangEngine", "serialize_lora_tensors"]

PEFT_PREFIX = "base_model.model."
_TAGS = {OffloadLevel.KV_CACHE: ["kv_cache"], OffloadLevel.WEIGHTS: ["kv_cache", "weights"]}


def serialize_lora_tensors(update: AdapterUpdate) -> str:
    """PEFT-keyed fp32 tensors, pickled by value and base64-encoded (SGLang's string form)."""
    tensors = {}
    for path, (A, B) in update.weights().items():
        tensors[f"{PEFT_PREFIX}{path}.lora_A.weight"] = A.contiguous()
        tensors[f"{PEFT_PREFIX}{path}.lora_B.weight"] = B.contiguous()
    return base64.b64encode(pickle.dumps(tensors, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


class SglangEngine(HttpEngine):
    """An SGLang server (`python -m sglang.launch_server --enable-lora ...`)."""

    kind = "sglang"
    modes = frozenset({SyncMode.TENSOR, SyncMode.FILES, SyncMode.MERGED})

    # ------------------------------------------------------------------ requests
    def _send(self, request: RolloutRequest, plan: RequestPlan) -> RolloutResult:
        params = request.params
        sampling: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
        }
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        if params.stop_token_ids is not None:
            sampling["stop_token_ids"] = list(params.stop_token_ids)
            sampling["ignore_eos"] = True
        body: dict[str, Any] = {
            "input_ids": list(request.prompt),
            "sampling_params": sampling,
            "return_logprob": True,
            "logprob_start_len": 0 if request.prompt_logprobs else -1,
        }
        if plan.kind == "lora":
            body["lora_path"] = plan.name
        reply = self.client.post("/generate", body)
        return self._parse(request, plan, reply)

    def _parse(self, request: RolloutRequest, plan: RequestPlan, reply: Any) -> RolloutResult:
        where = f"sglang engine at {self.base_url}"
        meta = reply.get("meta_info") if isinstance(reply, dict) else None
        if not isinstance(meta, dict):
            raise RolloutEngineError(f"{where}: unexpected /generate reply: {str(reply)[:300]}")
        output = meta.get("output_token_logprobs")
        tokens = reply.get("output_ids")
        if (
            not isinstance(output, list)
            or not isinstance(tokens, list)
            or len(output) != len(tokens)
        ):
            raise RolloutEngineError(f"{where}: reply lacks output_ids/output_token_logprobs")
        logprobs = [float(entry[0]) for entry in output]
        if [int(entry[1]) for entry in output] != [int(t) for t in tokens]:
            raise RolloutEngineError(f"{where}: output_token_logprobs do not match output_ids")
        served = None
        if plan.kind == "merged":
            served = meta.get("weight_version")
            if served != plan.name:
                raise RolloutEngineError(
                    f"{where}: expected weights {plan.name!r}, the reply says {served!r}"
                )
        prompt_lp = None
        if request.prompt_logprobs:
            entries = meta.get("input_token_logprobs")
            prompt = list(request.prompt)
            if not isinstance(entries, list) or len(entries) != len(prompt):
                raise RolloutEngineError(
                    f"{where}: input_token_logprobs missing or of the wrong length"
                )
            if [int(e[1]) for e in entries] != prompt:
                raise RolloutEngineError(
                    f"{where}: input_token_logprobs are for other tokens than the prompt"
                )
            prompt_lp = [None] + [None if e[0] is None else float(e[0]) for e in entries[1:]]
        finish = (meta.get("finish_reason") or {}).get("type")
        return RolloutResult(
            tokens=[int(t) for t in tokens],
            logprobs=logprobs,
            finish_reason="length" if finish == "length" else "stop",
            adapter=request.adapter,
            served_by=served,
            prompt_logprobs=prompt_lp,
        )

    # ------------------------------------------------------------------ LoRA
    def _checked(self, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        try:
            reply = self.client.post(path, body, ok_statuses=(200, 400))
        except RolloutEngineError as exc:
            raise SyncError(f"sglang engine: {what} failed: {exc}") from exc
        if not isinstance(reply, dict) or reply.get("success") is not True:
            message = (
                (reply.get("error_message") or reply.get("message"))
                if isinstance(reply, dict)
                else reply
            )
            raise SyncError(f"sglang engine: {what} failed: {message}")
        return reply

    def _load_lora_path(self, name: str, path: str) -> None:
        reply = self._checked(
            "/load_lora_adapter",
            {"lora_name": name, "lora_path": path, "pinned": False},
            f"loading {name} from {path}",
        )
        self._check_listed(reply, name)

    def _load_lora_tensors(self, update: AdapterUpdate) -> None:
        name = update.version.name
        body = {
            "lora_name": name,
            "config_dict": update.peft_config(),
            "serialized_tensors": serialize_lora_tensors(update),
            "load_format": None,
            "pinned": False,
        }
        reply = self._checked(
            "/load_lora_adapter_from_tensors", body, f"loading {name} from tensors"
        )
        self._check_listed(reply, name)

    @staticmethod
    def _check_listed(reply: dict[str, Any], name: str) -> None:
        loaded = reply.get("loaded_adapters")
        if isinstance(loaded, dict) and name not in loaded:
            raise SyncError(
                f"sglang engine: load of {name} reported success but it is not among {sorted(loaded)}"
            )

    def _unload_lora(self, name: str) -> None:
        self.client.post("/unload_lora_adapter", {"lora_name": name})

    # ------------------------------------------------------------------ weights
    def _push_weights(self, path: str, version: AdapterVersion | None) -> None:
        body = {
            "model_path": path,
            "abort_all_requests": False,
            "weight_version": version.name if version else "base",
        }
        self._checked("/update_weights_from_disk", body, f"updating weights from {path}")
        self.client.post("/flush_cache", expect_json=False)

    # ------------------------------------------------------------------ offload
    def _sleep(self, level: OffloadLevel) -> None:
        self._checked_plain("/release_memory_occupation", {"tags": _TAGS[level]})

    def _wake(self, level: OffloadLevel) -> None:
        self._checked_plain("/resume_memory_occupation", {"tags": _TAGS[level]})

    def _checked_plain(self, path: str, body: dict[str, Any]) -> None:
        self.client.post(path, body, expect_json=False)
