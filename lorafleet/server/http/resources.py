"""The REST resources besides the futures: model info, training runs, their checkpoints (listed,
given a TTL, published, copied, deleted, downloaded through signed links), weights info,
samplers and checkpoint storage, all scoped to the caller's tenant (plus what other tenants
published, see public_checkpoints.py)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from datetime import UTC, datetime
from email.utils import formatdate
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote, urlencode

from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, RedirectResponse, StreamingResponse

from lorafleet.server.errors import Conflict, NotFound, UserError, exception_text
from lorafleet.server.http import API, parse, resource_json, schemas
from lorafleet.server.http.archives import tar_stream
from lorafleet.server.http.off_loop import OffLoop
from lorafleet.server.http.served import ServedBase
from lorafleet.server.http.signed_urls import UrlSigner
from lorafleet.server.ops.engine_calls import EngineCalls
from lorafleet.server.ops.quotas import Quotas
from lorafleet.server.state import ids, public_checkpoints
from lorafleet.server.state.external_weights import export_files
from lorafleet.server.state.keys import Tenant
from lorafleet.server.state.ownership import Ownership
from lorafleet.server.state.paths import TinkerPath, checkpoint_dir, dir_size, parse_tinker_path
from lorafleet.server.state.store import CheckpointRow, ModelRow, Store
from lorafleet.server.state.weight_copies import copy_tree

FILES_ROUTE = "/api/v1/lorafleet/files"
"""Where signed external-weights links point: `<FILES_ROUTE>/<run>/external_weights/<name>/<file>`."""
GIGABYTE = 10**9  # the storage billing unit (decimal)


def _checkpoint_path(run_id: str, checkpoint_id: str) -> TinkerPath:
    return parse_tinker_path(f"tinker://{run_id}/{checkpoint_id}", "checkpoint_id")


def _external_resource(run_id: str, name: str, file: str, version: str) -> str:
    """What a download link's signature covers: one file of one export, as saved at `version`."""
    return f"tinker://{run_id}/external_weights/{name}/{file}@{version}"


def _archive_resource(run_id: str, segment: str, name: str, version: str) -> str:
    """What an archive link's signature covers: one checkpoint, whole (never an export's file),
    as saved at `version`."""
    return f"archive:tinker://{run_id}/{segment}/{name}@{version}"


def checkpoint_version(row: CheckpointRow) -> str:
    """A checkpoint's identity beyond its name: its creation time in microseconds. A link
    carries it (and its signature covers it), so a checkpoint deleted and saved again under the
    same name, or overwritten, never answers a link made for the one before: its row is new
    and so is its creation time."""
    return str(round(row.created_at * 1e6))


def _same_version(row: CheckpointRow, version: str | None, path: TinkerPath) -> None:
    if version != checkpoint_version(row):
        raise NotFound(
            f"{path} was saved again since this link was made; the link named the earlier "
            "checkpoint, which no longer exists (ask for a new link)"
        )


class Rest:
    def __init__(
        self,
        store: Store,
        ownership: Ownership,
        engine: EngineCalls,
        served: ServedBase,
        signer: UrlSigner,
        data_dir: Path,
        quotas: Quotas | None = None,
        public_url: str = "http://127.0.0.1:8000",
    ):
        """`quotas`: a copy is a new checkpoint, so it counts against checkpoint storage.
        `public_url`: the base links and redirects name (public_url.py), never a request's Host."""
        self.public_url = public_url
        self.quotas = quotas
        self.store = store
        self.ownership = ownership
        self.engine = engine
        self.served = served
        self.signer = signer
        self.data_dir = data_dir

    def get_info(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.ModelRef, body)
        return resource_json.model_info(self.ownership.model(tenant, req.model_id), self.served)

    def get_sampler(self, tenant: Tenant, sampler_id: str) -> dict[str, Any]:
        return resource_json.sampler(self.ownership.sampling_session(tenant, sampler_id))

    def _run(self, row: ModelRow, tenant: Tenant) -> dict[str, Any]:
        """Another tenant's run (reached through a published checkpoint) shows its newest
        published checkpoints only: the private ones' names are the owner's business."""
        if row.tenant == tenant.id:
            last = self.store.checkpoints.latest(row.model_id, "training")
            last_sampler = self.store.checkpoints.latest(row.model_id, "sampler")
        else:
            last = self.store.checkpoints.latest_public(row.model_id, "training")
            last_sampler = self.store.checkpoints.latest_public(row.model_id, "sampler")
        return resource_json.training_run(row, last, last_sampler)

    def list_training_runs(
        self,
        tenant: Tenant,
        limit: int,
        offset: int,
        access_scope: str = "owned",
        project_id: str | None = None,
    ) -> dict[str, Any]:
        """`access_scope="accessible"` adds other tenants' runs that have a published checkpoint;
        `project_id` keeps the runs whose session is in that project."""
        limit, offset = resource_json.page(limit, offset)
        if access_scope not in ("owned", "accessible"):
            raise UserError(f"access_scope must be 'owned' or 'accessible', got {access_scope!r}")
        rows, total = self.store.models.page(
            tenant.id,
            limit,
            offset,
            accessible=access_scope == "accessible",
            project_id=project_id,
        )
        return {
            "training_runs": [self._run(r, tenant) for r in rows],
            "cursor": resource_json.cursor(offset, limit, total),
        }

    def get_training_run(
        self, tenant: Tenant, run_id: str, access_scope: str = "owned"
    ) -> dict[str, Any]:
        return self._run(self.ownership.readable_model(tenant, run_id, access_scope), tenant)

    def list_checkpoints(
        self, tenant: Tenant, run_id: str | None, limit: int = 1000, offset: int = 0
    ) -> dict[str, Any]:
        """Another tenant's run lists its published checkpoints only (404 if it has none)."""
        limit, offset = resource_json.page(limit, offset)
        if run_id is not None:
            run = self.ownership.readable_model(tenant, run_id, "accessible")
            if run.tenant != tenant.id:
                rows, total = self.store.checkpoints.public_page(run_id, limit, offset)
                return {
                    "checkpoints": [resource_json.checkpoint(r) for r in rows],
                    "cursor": resource_json.cursor(offset, limit, total),
                }
        rows, total = self.store.checkpoints.page(tenant.id, run_id, limit, offset)
        return {
            "checkpoints": [resource_json.checkpoint(r) for r in rows],
            "cursor": resource_json.cursor(offset, limit, total),
        }

    def delete_checkpoint(self, tenant: Tenant, run_id: str, checkpoint_id: str) -> Future[None]:
        path = _checkpoint_path(run_id, checkpoint_id)
        row = self.ownership.checkpoint(tenant, path, expired_ok=True)
        return self.engine.delete_checkpoint(row)

    def set_checkpoint_ttl(
        self, tenant: Tenant, run_id: str, checkpoint_id: str, body: Any
    ) -> dict[str, Any]:
        req = schemas.parse(schemas.SetTtl, body)
        row = self.ownership.checkpoint(tenant, _checkpoint_path(run_id, checkpoint_id))
        row.expires_at = parse.expires_at(req.ttl_seconds)
        self.store.checkpoints.put(row)
        return {}

    def weights_info(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.WeightsInfo, body)
        path = parse_tinker_path(req.tinker_path, "tinker_path")
        return resource_json.weights_info(self.ownership.readable_checkpoint(tenant, path))

    # ------------------------------------------------------------------ publication
    def set_public(
        self, tenant: Tenant, run_id: str, checkpoint_id: str, public: bool
    ) -> dict[str, Any]:
        """Owner only. Idempotent: publishing a public checkpoint again (a retry whose first
        attempt arrived, say) succeeds; the SDK documents a 409 there, but it retries 409s."""
        row = self.ownership.checkpoint(tenant, _checkpoint_path(run_id, checkpoint_id))
        public_checkpoints.with_public(row, public)
        if not self.store.checkpoints.set_info(row.tinker_path, row.info):
            raise NotFound(f"checkpoint {row.tinker_path} was deleted")
        return {}

    # ------------------------------------------------------------------ external weights
    def external_weights_urls(
        self, tenant: Tenant, run_id: str, checkpoint_id: str
    ) -> dict[str, Any]:
        """One signed link per file of an export (`save_weights_external`), served by
        `external_file`, bound to this save of the export (`checkpoint_version`)."""
        path = _checkpoint_path(run_id, checkpoint_id)
        if path.kind != "external":
            raise UserError(
                f"external_weights_urls needs an external weights checkpoint "
                f"(tinker://<run>/external_weights/<name>), got {path}"
            )
        row = self.ownership.checkpoint(tenant, path)
        now = time.time()
        urls: dict[str, str] = {}
        expires = int(now) + self.signer.ttl_s
        version = checkpoint_version(row)
        for file in export_files(Path(row.dir)):
            resource = _external_resource(run_id, path.name, file, version)
            link = self.signer.sign(tenant.id, resource, now)
            expires = link.expires
            where = f"{quote(run_id, safe=':')}/external_weights/{quote(path.name)}/{quote(file)}"
            query = urlencode({**link.query, "version": version})
            urls[file] = f"{self.public_url}{FILES_ROUTE}/{where}?{query}"
        return {"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()}

    def external_file(
        self,
        run_id: str,
        name: str,
        file: str,
        tenant: str | None,
        expires: str | None,
        sig: str | None,
        version: str | None = None,
    ) -> Path:
        """The file a signed link names; the signature is the only credential (the SDK fetches
        with a plain GET, no key). Bad or expired signature: 403; a deleted export or a name
        that is not one of its files: 404. Nothing outside the export's own files is served."""
        resource = _external_resource(run_id, name, file, str(version))
        owner = self.signer.verify(tenant, resource, expires, sig)
        path = parse_tinker_path(f"tinker://{run_id}/external_weights/{name}")
        row = self.store.checkpoints.get(str(path))
        if row is None or row.tenant != owner or row.expired():
            raise NotFound(f"external weights {path} do not exist any more")
        _same_version(row, version, path)
        directory = Path(row.dir)
        if file not in export_files(directory):
            raise NotFound(f"external weights {path} have no file {file!r}")
        return directory / file

    # ------------------------------------------------------------------ archives
    def checkpoint_archive_url(
        self, tenant: Tenant, run_id: str, checkpoint_id: str
    ) -> tuple[str, int]:
        """(signed link, expiry in unix seconds) to the checkpoint's files as one tar
        (archives.py), for its owner only: a training checkpoint holds the optimizer state,
        which publishing never shares. The link names this save of the checkpoint
        (`checkpoint_version`) and the configured public address."""
        path = _checkpoint_path(run_id, checkpoint_id)
        row = self.ownership.checkpoint(tenant, path)
        version = checkpoint_version(row)
        resource = _archive_resource(run_id, path.segment, path.name, version)
        link = self.signer.sign(tenant.id, resource)
        where = f"{quote(run_id, safe=':')}/archive/{path.segment}/{quote(path.name)}"
        query = urlencode({**link.query, "version": version})
        return f"{self.public_url}{FILES_ROUTE}/{where}?{query}", link.expires

    def archive_files(
        self,
        run_id: str,
        segment: str,
        name: str,
        tenant: str | None,
        expires: str | None,
        sig: str | None,
        version: str | None = None,
    ) -> list[Path]:
        """The files an archive link names (the signature is the only credential, as for
        `external_file`): 403 for a bad or expired signature (checked before anything else is
        parsed), 404 once the checkpoint is gone."""
        resource = _archive_resource(run_id, segment, name, str(version))
        owner = self.signer.verify(tenant, resource, expires, sig)
        path = parse_tinker_path(f"tinker://{run_id}/{segment}/{name}")
        row = self.store.checkpoints.get(str(path))
        if row is None or row.tenant != owner or row.expired():
            raise NotFound(f"checkpoint {path} does not exist any more")
        _same_version(row, version, path)
        directory = Path(row.dir)
        return [directory / file for file in export_files(directory)]

    # ------------------------------------------------------------------ copies
    def copy_weights(
        self, tenant: Tenant, body: Any, idempotency_key: str | None, access_token: str | None
    ) -> Future[dict[str, Any]] | dict[str, Any]:
        """Copies a checkpoint (the caller's, or a published sampler checkpoint) under a new
        training run in a project, or in the caller's session at `model_seq_id`. The SDK keeps
        one idempotency key across its retries: a retry gets the first attempt's copy."""
        req = schemas.parse(schemas.CopyWeights, body)
        if req.weights_access_token is not None or access_token is not None:
            raise UserError(
                "weights_access_token is not supported by this server: copy your own checkpoints "
                "or published ones"
            )
        if idempotency_key is not None:
            earlier = self.store.checkpoints.find_copy(tenant.id, idempotency_key)
            if earlier is not None:
                return {"tinker_path": earlier.tinker_path}
        source_path = parse_tinker_path(req.source_path, "source_path")
        if source_path.kind == "external":
            raise UserError(
                f"source_path {source_path} is an external weights export; copy the training or "
                "sampler checkpoint it came from"
            )
        source = self.ownership.readable_checkpoint(tenant, source_path)
        if source.tenant != tenant.id and source.kind == "training":
            raise UserError(
                f"{source_path} is another tenant's training checkpoint: a copy would hold its "
                "optimizer state, which publishing does not share; start a run from it with "
                "create_training_client_from_state and save your own",
                status=403,
            )
        expires_at = parse.expires_at(req.ttl_seconds)
        session_id, new_session = self._copy_session(tenant, req, source_path)
        model_id = ids.model_id(session_id, req.model_seq_id or 0)
        if (
            self.store.models.get(model_id) is not None
            or self.store.futures.find(model_id, 0) is not None
        ):
            raise Conflict(f"model {model_id!r} already exists; use another model_seq_id")
        dest_path = TinkerPath(model_id, source_path.segment, source_path.name)

        def copy() -> dict[str, Any]:
            # On the engine worker: serialised with deletions and overwrites of the source.
            current = self.store.checkpoints.get(str(source_path))
            if current is None or current.dir != source.dir:
                raise NotFound(f"checkpoint {source_path} was deleted or replaced; not copied")
            dest = checkpoint_dir(self.data_dir, tenant.id, dest_path)
            try:
                copy_tree(Path(source.dir), dest)
            except FileExistsError as exc:
                raise Conflict(f"copy_weights {dest_path}: {exception_text(exc)}") from None
            if new_session is not None:
                self.store.sessions.add(session_id, tenant.id, new_session)
                self.store.sessions.finish(session_id, "copy_weights")
            self._add_copy(tenant, source, dest_path, dest, session_id, expires_at, idempotency_key)
            return {"tinker_path": str(dest_path)}

        # reserved now, while it waits for the worker, and held until its row is written
        release = (
            self.quotas.reserve_storage(tenant.id, source.size_bytes or 0)
            if self.quotas is not None
            else None
        )
        try:
            future = self.engine.scheduler.call(copy)
        except BaseException:
            if release is not None:
                release()
            raise
        if release is not None:
            future.add_done_callback(lambda _done: release())
        return future

    def _copy_session(
        self, tenant: Tenant, req: schemas.CopyWeights, source: TinkerPath
    ) -> tuple[str, dict[str, Any] | None]:
        """The session that will own the copy's run, and the info of a new one to create once
        the copy exists (None: the caller's own session)."""
        if req.session_id is not None:
            if req.model_seq_id is None:
                raise UserError("copy_weights with session_id needs model_seq_id too")
            return self.ownership.session(tenant, req.session_id).session_id, None
        if not req.destination_project_id:
            raise UserError(
                "copy_weights needs destination_project_id, or session_id and model_seq_id"
            )
        # a session of its own in the destination project, finished at once: it owns the copy
        info = {
            "project_id": req.destination_project_id,
            "display_name": f"copy of {source}",
            "tags": ["copy_weights"],
            "user_metadata": None,
        }
        return ids.new_session_id(), info

    def _add_copy(
        self,
        tenant: Tenant,
        source: CheckpointRow,
        path: TinkerPath,
        dest: Path,
        session_id: str,
        expires_at: float | None,
        idempotency_key: str | None,
    ) -> None:
        now = time.time()
        lora = source.info["lora"]
        self.store.models.add(
            ModelRow(
                model_id=path.model_id,
                tenant=tenant.id,
                session_id=session_id,
                base_model=source.info["base_model"],
                lora_rank=int(lora["rank"]),
                lora=lora,
                user_metadata=None,
                created_at=now,
                last_request_time=now,
                status="copy",
            )
        )
        info = {k: v for k, v in source.info.items() if k != "public"}
        info["copied_from"] = source.tinker_path
        if idempotency_key is not None:
            info["copy_key"] = idempotency_key
        self.store.checkpoints.put(
            CheckpointRow(
                tinker_path=str(path),
                tenant=tenant.id,
                model_id=path.model_id,
                kind=source.kind,
                name=path.name,
                dir=str(dest),
                created_at=now,
                size_bytes=dir_size(dest),
                user_metadata=source.user_metadata,
                expires_at=expires_at,
                info=info,
            )
        )

    # ------------------------------------------------------------------ storage
    def checkpoint_storage_usage(self, tenant: Tenant, project_id: str | None) -> dict[str, Any]:
        """The tenant's live checkpoints per project (None: sessions without one). No prices:
        this server bills nothing."""
        data = [
            {
                "project_id": project,
                "org_user_urn": tenant.id,
                "user_email": None,
                "user_name": None,
                "checkpoint_count": count,
                "size_bytes": size,
                "size_gigabytes": size / GIGABYTE,
                "estimated_monthly_cost_usd": None,
            }
            for project, count, size in self.store.checkpoints.usage_by_project(
                tenant.id, project_id
            )
        ]
        return {"effective_rate_usd_per_gigabyte_month": None, "data": data}


# The resources a client reads and manages by id: a model's info, a sampler, training runs
# and their checkpoints (listing, TTL, deletion), and what a checkpoint's weights hold.


def add_routes(app: FastAPI, rest: Rest, off: OffLoop) -> None:

    @app.post(f"{API}/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        return await off.json(request, rest.get_info)

    @app.get(f"{API}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str, request: Request) -> dict[str, Any]:
        return await off.call(request, lambda who: rest.get_sampler(who, sampler_id))

    @app.get(f"{API}/training_runs")
    async def list_training_runs(
        request: Request,
        limit: int = 20,
        offset: int = 0,
        access_scope: str = "owned",
        project_id: str | None = None,
    ) -> dict[str, Any]:
        return await off.call(
            request,
            lambda who: rest.list_training_runs(who, limit, offset, access_scope, project_id),
        )

    @app.get(f"{API}/training_runs/{{run_id}}")
    async def get_training_run(
        run_id: str, request: Request, access_scope: str = "owned"
    ) -> dict[str, Any]:
        return await off.call(request, lambda who: rest.get_training_run(who, run_id, access_scope))

    @app.get(f"{API}/training_runs/{{run_id}}/checkpoints")
    async def list_run_checkpoints(run_id: str, request: Request) -> dict[str, Any]:
        return await off.call(request, lambda who: rest.list_checkpoints(who, run_id))

    @app.put(f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/ttl")
    async def set_ttl(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        return await off.json(
            request, lambda who, body: rest.set_checkpoint_ttl(who, run_id, checkpoint_id, body)
        )

    # before the DELETE of a checkpoint, whose {checkpoint_id:path} would swallow ".../publish"
    @app.post(f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/publish")
    async def publish(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        return await off.call(
            request, lambda who: rest.set_public(who, run_id, checkpoint_id, True)
        )

    @app.delete(f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/publish")
    async def unpublish(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        return await off.call(
            request, lambda who: rest.set_public(who, run_id, checkpoint_id, False)
        )

    @app.get(
        f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/external_weights_urls"
    )
    async def external_weights_urls(
        run_id: str, checkpoint_id: str, request: Request
    ) -> dict[str, Any]:
        return await off.call(
            request, lambda who: rest.external_weights_urls(who, run_id, checkpoint_id)
        )

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
        path = await off.public(
            f"files:{signed_for}",
            lambda: rest.external_file(run_id, name, file, signed_for, expires, sig, version),
        )
        return FileResponse(path, media_type="application/octet-stream")

    @app.get(f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/archive")
    async def checkpoint_archive(
        run_id: str, checkpoint_id: str, request: Request
    ) -> RedirectResponse:
        """A 302 to a signed tar link, with `Expires`: what SDKs before 0.38 read in
        `get_checkpoint_archive_url`; `lorafleet export` reads the same."""
        url, expires = await off.call(
            request, lambda who: rest.checkpoint_archive_url(who, run_id, checkpoint_id)
        )
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
        length, chunks = await off.public(
            f"files:{signed_for}",
            lambda: tar_stream(
                rest.archive_files(run_id, segment, name, signed_for, expires, sig, version)
            ),
        )
        return StreamingResponse(
            chunks, media_type="application/x-tar", headers={"Content-Length": str(length)}
        )

    @app.post(f"{API}/copy_weights")
    async def copy_weights(request: Request) -> dict[str, Any]:
        idempotency_key = request.headers.get("x-idempotency-key")
        token = request.headers.get("x-tinker-weights-access-token")
        result = await off.json(
            request, lambda who, body: rest.copy_weights(who, body, idempotency_key, token)
        )
        return result if isinstance(result, dict) else await asyncio.wrap_future(result)

    @app.get(f"{API}/billing/usage/checkpoints/current")
    async def checkpoint_storage_usage(
        request: Request, project_id: str | None = None
    ) -> dict[str, Any]:
        return await off.call(request, lambda who: rest.checkpoint_storage_usage(who, project_id))

    @app.delete(f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete_checkpoint(
        run_id: str, checkpoint_id: str, request: Request
    ) -> dict[str, Any]:
        deleting = await off.call(
            request, lambda who: rest.delete_checkpoint(who, run_id, checkpoint_id)
        )
        await asyncio.wrap_future(deleting)
        return {}

    @app.get(f"{API}/checkpoints")
    async def list_user_checkpoints(
        request: Request, limit: int = 100, offset: int = 0
    ) -> dict[str, Any]:
        return await off.call(request, lambda who: rest.list_checkpoints(who, None, limit, offset))

    @app.post(f"{API}/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        return await off.json(request, rest.weights_info)
