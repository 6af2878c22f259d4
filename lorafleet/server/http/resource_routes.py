"""The resources a client reads and manages by id: a model's info, a sampler, training runs
and their checkpoints (listing, TTL, deletion), and what a checkpoint's weights hold."""

from __future__ import annotations

import asyncio
from email.utils import formatdate
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, RedirectResponse, StreamingResponse

from lorafleet.server.http import API
from lorafleet.server.http.archives import tar_stream
from lorafleet.server.http.bodies import BodyReader, tenant
from lorafleet.server.http.resources import FILES_ROUTE, Rest


def add_routes(app: FastAPI, rest: Rest, bodies: BodyReader) -> None:

    @app.post(f"{API}/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        return rest.get_info(tenant(request), await bodies.json(request))

    @app.get(f"{API}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str, request: Request) -> dict[str, Any]:
        return rest.get_sampler(tenant(request), sampler_id)

    @app.get(f"{API}/training_runs")
    async def list_training_runs(
        request: Request,
        limit: int = 20,
        offset: int = 0,
        access_scope: str = "owned",
        project_id: str | None = None,
    ) -> dict[str, Any]:
        return rest.list_training_runs(tenant(request), limit, offset, access_scope, project_id)

    @app.get(f"{API}/training_runs/{{run_id}}")
    async def get_training_run(
        run_id: str, request: Request, access_scope: str = "owned"
    ) -> dict[str, Any]:
        return rest.get_training_run(tenant(request), run_id, access_scope)

    @app.get(f"{API}/training_runs/{{run_id}}/checkpoints")
    async def list_run_checkpoints(run_id: str, request: Request) -> dict[str, Any]:
        return rest.list_checkpoints(tenant(request), run_id)

    @app.put(f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/ttl")
    async def set_ttl(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        return rest.set_checkpoint_ttl(
            tenant(request), run_id, checkpoint_id, await bodies.json(request)
        )

    # before the DELETE of a checkpoint, whose {checkpoint_id:path} would swallow ".../publish"
    @app.post(f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/publish")
    async def publish(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        return rest.set_public(tenant(request), run_id, checkpoint_id, True)

    @app.delete(f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/publish")
    async def unpublish(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        return rest.set_public(tenant(request), run_id, checkpoint_id, False)

    @app.get(
        f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/external_weights_urls"
    )
    async def external_weights_urls(
        run_id: str, checkpoint_id: str, request: Request
    ) -> dict[str, Any]:
        return rest.external_weights_urls(tenant(request), run_id, checkpoint_id)

    @app.get(f"{FILES_ROUTE}/{{run_id}}/external_weights/{{name}}/{{file}}")
    async def external_file(
        run_id: str,
        name: str,
        file: str,
        signed_for: Annotated[str | None, Query(alias="tenant")] = None,
        expires: str | None = None,
        sig: str | None = None,
        version: str | None = None,
    ) -> FileResponse:
        """No API key (app.KeyGate lets FILES_ROUTE through): the signature is the credential."""
        path = rest.external_file(run_id, name, file, signed_for, expires, sig, version)
        return FileResponse(path, media_type="application/octet-stream")

    @app.get(f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/archive")
    async def checkpoint_archive(
        run_id: str, checkpoint_id: str, request: Request
    ) -> RedirectResponse:
        """A 302 to a signed tar link, with `Expires`: what SDKs before 0.38 read in
        `get_checkpoint_archive_url`; `lorafleet export` reads the same."""
        url, expires = rest.checkpoint_archive_url(tenant(request), run_id, checkpoint_id)
        return RedirectResponse(
            url, status_code=302, headers={"Expires": formatdate(expires, usegmt=True)}
        )

    @app.get(f"{FILES_ROUTE}/{{run_id}}/archive/{{segment}}/{{name}}")
    async def archive_file(
        run_id: str,
        segment: str,
        name: str,
        signed_for: Annotated[str | None, Query(alias="tenant")] = None,
        expires: str | None = None,
        sig: str | None = None,
        version: str | None = None,
    ) -> StreamingResponse:
        """No API key (app.KeyGate lets FILES_ROUTE through): the signature is the credential."""
        files = rest.archive_files(run_id, segment, name, signed_for, expires, sig, version)
        length, chunks = tar_stream(files)
        return StreamingResponse(
            chunks, media_type="application/x-tar", headers={"Content-Length": str(length)}
        )

    @app.post(f"{API}/copy_weights")
    async def copy_weights(request: Request) -> dict[str, Any]:
        result = rest.copy_weights(
            tenant(request),
            await bodies.json(request),
            request.headers.get("x-idempotency-key"),
            request.headers.get("x-tinker-weights-access-token"),
        )
        return result if isinstance(result, dict) else await asyncio.wrap_future(result)

    @app.get(f"{API}/billing/usage/checkpoints/current")
    async def checkpoint_storage_usage(
        request: Request, project_id: str | None = None
    ) -> dict[str, Any]:
        return rest.checkpoint_storage_usage(tenant(request), project_id)

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
