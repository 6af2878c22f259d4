"""A `TrainingClient`'s operations; each answers with a future. forward_backward is the one
protobuf body (under the larger protobuf limit; a JSON body, Content-Type application/json,
is accepted too); the others are JSON."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from lorafleet.server.http import API
from lorafleet.server.http.bodies import BodyReader, tenant
from lorafleet.server.http.training import Training


def add_routes(app: FastAPI, training: Training, bodies: BodyReader) -> None:

    @app.post(f"{API}/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        return training.create_model(tenant(request), await bodies.json(request))

    @app.post(f"{API}/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        who = tenant(request)
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type == "application/json":  # JSON clients (json_fwdbwd.py)
            return training.forward_backward_json(who, await bodies.json(request))
        raw = await bodies.protobuf(request)
        return training.forward_backward(who, raw, request.headers.get("content-encoding"))

    @app.post(f"{API}/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        return training.optim_step(tenant(request), await bodies.json(request))

    @app.post(f"{API}/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        return training.save_weights(tenant(request), await bodies.json(request))

    @app.post(f"{API}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
        return training.save_for_sampler(tenant(request), await bodies.json(request))

    @app.post(f"{API}/save_weights_external")
    async def save_weights_external(request: Request) -> dict[str, Any]:
        return training.save_weights_external(tenant(request), await bodies.json(request))

    @app.post(f"{API}/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        return training.load_weights(tenant(request), await bodies.json(request))
