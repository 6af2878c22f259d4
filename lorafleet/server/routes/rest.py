"""The resources a client reads and manages by id: a model's info, a sampler, training runs
and their checkpoints (listing, TTL, deletion), and what a checkpoint's weights hold."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from lorafleet.server.rest import Rest
from lorafleet.server.routes import API
from lorafleet.server.routes.bodies import BodyReader, tenant


def add_routes(app: FastAPI, rest: Rest, bodies: BodyReader) -> None:

    @app.post(f"{API}/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        return rest.get_info(tenant(request), await bodies.json(request))

    @app.get(f"{API}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str, request: Request) -> dict[str, Any]:
        return rest.get_sampler(tenant(request), sampler_id)

    @app.get(f"{API}/training_runs")
    async def list_training_runs(
        request: Request, limit: int = 20, offset: int = 0
    ) -> dict[str, Any]:
        return rest.list_training_runs(tenant(request), limit, offset)

    @app.get(f"{API}/training_runs/{{run_id}}")
    async def get_training_run(run_id: str, request: Request) -> dict[str, Any]:
        return rest.get_training_run(tenant(request), run_id)

    @app.get(f"{API}/training_runs/{{run_id}}/checkpoints")
    async def list_run_checkpoints(run_id: str, request: Request) -> dict[str, Any]:
        return rest.list_checkpoints(tenant(request), run_id)

    @app.put(f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/ttl")
    async def set_ttl(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        return rest.set_checkpoint_ttl(
            tenant(request), run_id, checkpoint_id, await bodies.json(request)
        )

    @app.delete(f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete_checkpoint(
        run_id: str, checkpoint_id: str, request: Request
    ) -> dict[str, Any]:
        await asyncio.wrap_future(rest.delete_checkpoint(tenant(request), run_id, checkpoint_id))
        return {}

    @app.get(f"{API}/checkpoints")
    async def list_user_checkpoints(
        request: Request, limit: int = 100, offset: int = 0
    ) -> dict[str, Any]:
        return rest.list_checkpoints(tenant(request), None, limit, offset)

    @app.post(f"{API}/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        return rest.weights_info(tenant(request), await bodies.json(request))
