"""A `TrainingClient`'s operations; each answers with a future. forward_backward is the one
protobuf body (under the larger protobuf limit; a JSON body, Content-Type application/json,
is accepted too); the others are JSON."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from lorafleet.server.http import API
from lorafleet.server.http.off_loop import OffLoop
from lorafleet.server.http.training import Training


def add_routes(app: FastAPI, training: Training, off: OffLoop) -> None:

    @app.post(f"{API}/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        return await off.json(request, training.create_model)

    @app.post(f"{API}/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type == "application/json":  # JSON clients (json_fwdbwd.py)
            return await off.json(request, training.forward_backward_json)
        encoding = request.headers.get("content-encoding")
        return await off.protobuf(
            request, lambda who, raw: training.forward_backward(who, raw, encoding)
        )

    @app.post(f"{API}/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        return await off.json(request, training.optim_step)

    @app.post(f"{API}/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        return await off.json(request, training.save_weights)

    @app.post(f"{API}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
        return await off.json(request, training.save_for_sampler)

    @app.post(f"{API}/save_weights_external")
    async def save_weights_external(request: Request) -> dict[str, Any]:
        return await off.json(request, training.save_weights_external)

    @app.post(f"{API}/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        return await off.json(request, training.load_weights)
