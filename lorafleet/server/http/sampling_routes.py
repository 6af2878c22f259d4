"""A `SamplingClient`'s operations: open a sampling session, sample (answered with a future)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from lorafleet.server.http import API
from lorafleet.server.http.off_loop import OffLoop
from lorafleet.server.http.sampling import Sampling


def add_routes(app: FastAPI, sampling: Sampling, off: OffLoop) -> None:

    @app.post(f"{API}/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        return await off.json(request, sampling.create_session)

    @app.post(f"{API}/asample")
    async def asample(request: Request) -> dict[str, Any]:
        return await off.json(request, sampling.sample)
