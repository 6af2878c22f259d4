"""A stand-in SGLang server for tests: SGLang's documented request/response shapes, computed
by our own sampler over a separate copy of the base model (SGLang itself needs CUDA).

It records every request body so tests can assert the exact shapes the client sends, and it
reproduces the failure that matters: like vLLM (measured), it accepts a LoRA whose module
names it does not know and then serves the base model under the adapter's name.
"""

from __future__ import annotations

import base64
import contextlib
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from safetensors.torch import load_file

from lorafleet.adapters.peft_io import read_peft
from lorafleet.model.adapted import AdaptedModel
from lorafleet.model.banks import AdapterSpec
from lorafleet.model.targets import resolve_tinker_targets
from lorafleet.sample.engine import SampleEngine
from lorafleet.sample.types import SampleRequest, SamplingParams
from lorafleet.sample.versions import VersionStore
from lorafleet.sync.vllm_server import free_port
from tests._models import tiny_qwen3

PEFT_PREFIX = "base_model.model."


class FakeSglang:
    def __init__(self, api_key: str | None = None):
        model = tiny_qwen3()
        self.model = model
        self.adapted = AdaptedModel(model, resolve_tinker_targets(model))
        self.incoming = self.adapted.add_bank("incoming", num_slots=2, r_max=8, trainable=False)
        bank = self.adapted.add_bank("sample", num_slots=6, r_max=8, trainable=False)
        self.versions = VersionStore(bank, base_model_id="tiny")
        self.sampler = SampleEngine(self.adapted, self.versions)
        self.api_key = api_key
        self.calls: list[tuple[str, Any]] = []
        self.weight_version = "default"
        self.weights_released = False
        self._params = {k.replace(".base_layer.", "."): p for k, p in model.named_parameters()}
        self.app = self._build()

    # ------------------------------------------------------------------ model ops
    def _install(
        self,
        name: str,
        config: dict[str, Any],
        weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        known = {p: w for p, w in weights.items() if p in self.incoming.layers}
        spec = AdapterSpec(
            rank=int(config["r"]),
            alpha=float(config["lora_alpha"]),
            use_rslora=bool(config.get("use_rslora", False)),
        )
        # Unknown module names are skipped silently, as vLLM does: the adapter loads "fine"
        # and computes nothing where its weights were meant to go.
        slot = self.incoming.allocate(spec, initialize=False)
        try:
            if known:
                full = {
                    p: known.get(
                        p,
                        (
                            torch.zeros(spec.rank, layer.in_features),
                            torch.zeros(layer.out_features, spec.rank),
                        ),
                    )
                    for p, layer in self.incoming.layers.items()
                }
                self.incoming.load_slot_weights(slot, full)
            self.versions.publish(name, self.incoming, slot, version=0)
        finally:
            self.incoming.free(slot)

    def _generate(self, body: dict[str, Any]) -> dict[str, Any]:
        sp = body.get("sampling_params") or {}
        stop = sp.get("stop_token_ids") if sp.get("ignore_eos") else None
        params = SamplingParams(
            max_tokens=sp.get("max_new_tokens", 16),
            temperature=sp.get("temperature", 1.0),
            top_k=sp.get("top_k", -1),
            top_p=sp.get("top_p", 1.0),
            stop=stop,
            seed=sp.get("sampling_seed"),
        )
        name = body.get("lora_path")
        if name is not None and (name, 0) not in self.versions.resident():
            raise KeyError(name)
        prompt_lp = body.get("logprob_start_len", -1) == 0
        (result,) = self.sampler.generate(
            [
                SampleRequest(
                    body["input_ids"],
                    params,
                    adapter=None if name is None else (name, 0),
                    prompt_logprobs=prompt_lp,
                )
            ]
        )
        seq = result.sequences[0]
        meta: dict[str, Any] = {
            "id": "fake",
            "finish_reason": {"type": "length" if seq.stop_reason == "length" else "stop"},
            "prompt_tokens": len(body["input_ids"]),
            "weight_version": self.weight_version,
            "output_token_logprobs": [
                [lp, tok, None] for lp, tok in zip(seq.logprobs, seq.tokens, strict=True)
            ],
        }
        if prompt_lp:
            meta["input_token_logprobs"] = [
                [lp, tok, None]
                for lp, tok in zip(result.prompt_logprobs, body["input_ids"], strict=True)
            ]
        return {"text": "", "output_ids": seq.tokens, "meta_info": meta}

    @torch.no_grad()
    def _update_weights(self, model_path: str) -> None:
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(Path(model_path).glob("*.safetensors")):
            tensors.update(load_file(file))
        missing = sorted(set(self._params) - set(tensors))
        if missing:
            raise ValueError(f"checkpoint lacks {missing[:3]}")
        for name, param in self._params.items():
            param.copy_(tensors[name])
        self.weights_released = False

    # ------------------------------------------------------------------ HTTP
    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def auth(request: Request, call_next):
            if (
                self.api_key is not None
                and request.headers.get("Authorization") != f"Bearer {self.api_key}"
            ):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return await call_next(request)

        def ok(data: dict[str, Any] | None = None) -> JSONResponse:
            return JSONResponse({"success": True, **(data or {})})

        def fail(message: str) -> JSONResponse:
            return JSONResponse(
                {"success": False, "error_message": message, "message": message}, status_code=400
            )

        def loaded() -> dict[str, Any]:
            return {"loaded_adapters": {a: {"lora_name": a} for a, _ in self.versions.resident()}}

        @app.post("/generate")
        async def generate(request: Request):
            body = await request.json()
            self.calls.append(("/generate", body))
            try:
                return JSONResponse(self._generate(body))
            except KeyError as exc:
                return JSONResponse(
                    {"error": {"message": f"LoRA adapter {exc} is not loaded"}}, status_code=400
                )

        @app.post("/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            body = await request.json()
            self.calls.append(("/load_lora_adapter", body))
            try:
                config, weights = read_peft(body["lora_path"])
                self._install(body["lora_name"], config, weights)
            except (ValueError, OSError) as exc:
                return fail(str(exc))
            return ok(loaded())

        @app.post("/load_lora_adapter_from_tensors")
        async def load_from_tensors(request: Request):
            body = await request.json()
            self.calls.append(
                (
                    "/load_lora_adapter_from_tensors",
                    {k: v for k, v in body.items() if k != "serialized_tensors"},
                )
            )
            tensors = pickle.loads(
                base64.b64decode(body["serialized_tensors"])
            )  # test-only: trusted bytes
            weights: dict[str, dict[str, torch.Tensor]] = {}
            for key, t in tensors.items():
                path, which = key[len(PEFT_PREFIX) :].rsplit(".lora_", 1)
                weights.setdefault(path, {})[which.split(".")[0]] = t
            self._install(
                body["lora_name"],
                body["config_dict"],
                {p: (w["A"], w["B"]) for p, w in weights.items()},
            )
            return ok(loaded())

        @app.post("/unload_lora_adapter")
        async def unload(request: Request):
            body = await request.json()
            self.calls.append(("/unload_lora_adapter", body))
            try:
                self.versions.drop((body["lora_name"], 0))
            except LookupError:
                return fail(f"{body['lora_name']} is not loaded")
            return ok(loaded())

        @app.post("/update_weights_from_disk")
        async def update_weights(request: Request):
            body = await request.json()
            self.calls.append(("/update_weights_from_disk", body))
            try:
                self._update_weights(body["model_path"])
            except (ValueError, OSError) as exc:
                return fail(str(exc))
            self.weight_version = body.get("weight_version") or self.weight_version
            return ok({"message": "Succeeded to update model weights."})

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache():
            self.calls.append(("/flush_cache", None))
            return PlainTextResponse("Cache flushed.")

        @app.post("/release_memory_occupation")
        async def release(request: Request):
            body = await request.json()
            self.calls.append(("/release_memory_occupation", body))
            if "weights" in (body.get("tags") or []):
                with torch.no_grad():  # the weights really are gone until someone re-sends them
                    for param in self._params.values():
                        param.zero_()
                self.weights_released = True
            self.sampler.release_cache()
            return PlainTextResponse("")

        @app.post("/resume_memory_occupation")
        async def resume(request: Request):
            body = await request.json()
            self.calls.append(("/resume_memory_occupation", body))
            return PlainTextResponse("")

        return app

    def paths(self) -> list[str]:
        return [path for path, _ in self.calls]


@contextlib.contextmanager
def serve(fake: FakeSglang) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(fake.app, host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("fake SGLang server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
