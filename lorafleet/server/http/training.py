"""The training operations: create a model (fresh or from a checkpoint), forward/backward,
optimizer steps, saves and loads. Each reads its body once into an op (ops/types.py), checks
what the caller may name, and hands the op to intake; the engine work happens later, on the
worker.

A request for a model the caller owns always takes its seq_id's place: if its content does not
parse, its op is a `Refused` holding the error, which fails in the model's order."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from tinker.proto import tinker_public_pb2 as pb

from lorafleet.server.errors import ApiError, UserError
from lorafleet.server.http import API, json_fwdbwd, parse, proto, schemas
from lorafleet.server.http.off_loop import OffLoop
from lorafleet.server.http.served import ServedBase
from lorafleet.server.ops import stability
from lorafleet.server.ops.intake import Intake, Place
from lorafleet.server.ops.stability import StabilityPolicy
from lorafleet.server.ops.types import (
    CreateFromState,
    Forward,
    ForwardBackward,
    LoadWeights,
    Op,
    Refused,
    SaveExternal,
)
from lorafleet.server.state import external_weights, ids
from lorafleet.server.state.keys import Tenant
from lorafleet.server.state.ownership import Ownership
from lorafleet.server.state.paths import checkpoint_name, parse_tinker_path
from lorafleet.server.state.store import ModelRow
from lorafleet.train.loss_inputs import STABLE_REINFORCE


def op_or_refusal(kind: str, build: Callable[[], Op]) -> Op:
    """The op `build` parses, or a `Refused` op holding the error that stopped it."""
    try:
        return build()
    except ApiError as exc:
        return Refused(exc, kind)


class Training:
    def __init__(
        self,
        ownership: Ownership,
        intake: Intake,
        served: ServedBase,
        *,
        max_body_bytes: int,
        stability_policy: StabilityPolicy | None = None,
    ):
        self.ownership = ownership
        self.intake = intake
        self.served = served
        self.max_body_bytes = max_body_bytes
        self.stability_policy = stability_policy or StabilityPolicy()

    def _to_model(
        self, tenant: Tenant, model_id: str, seq_id: int, op: Op, fingerprint: str
    ) -> dict[str, Any]:
        row = self.ownership.model(tenant, model_id)
        return self.intake.submit_to_model(tenant, row, seq_id, op, fingerprint).json()

    def refuse_in_order(self, tenant: Tenant, body: Any, error: ApiError, fingerprint: str) -> None:
        """Records `error` as the result of the seq_id a body names, when the body names one of
        the caller's models: a request the server refuses before parsing it as an operation (an
        unknown route) has still been numbered by the SDK, and leaving its seq_id empty would
        hold up the model's later requests until the gap timeout. Raises what stops the
        recording (a foreign model: NotFound; the seq_id used by another request: Conflict)."""
        if not isinstance(body, dict):
            return
        model_id, seq_id = body.get("model_id"), body.get("seq_id")
        if not isinstance(model_id, str) or type(seq_id) is not int or seq_id < 1:
            return
        self._to_model(tenant, model_id, seq_id, Refused(error, "unknown_route"), fingerprint)

    def create_model(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.CreateModel, body)
        self.ownership.session(tenant, req.session_id)
        self.served.check(req.base_model)
        parse.check_optimizer_type(req.optimizer_config)
        op = parse.create_args(req, self.served)
        model_id = ids.model_id(req.session_id, req.model_seq_id)
        self.intake.check_new_model(model_id)
        place = Place(model_id, model_id, seq_id=0)
        return self.intake.submit(tenant, op, place, parse.fingerprint(body)).json()

    def forward_backward(
        self, tenant: Tenant, raw: bytes, content_encoding: str | None
    ) -> dict[str, Any]:
        """The body is decompressed, parsed, decoded into tensors and measured here, once."""
        raw = parse.decode_body(raw, content_encoding, self.max_body_bytes)
        msg = proto.parse_forward_backward(raw)
        row = self.ownership.model(tenant, msg.model_id)  # 404 before the data is decoded
        self.intake.check_room(tenant, row, msg.seq_id)  # 429 before it too
        kind = "forward" if msg.forward_only else "forward_backward"
        op = op_or_refusal(kind, lambda: self._with_provenance(tenant, row, msg))
        promise = self.intake.submit_to_model(tenant, row, msg.seq_id, op, parse.fingerprint(raw))
        return promise.json()

    def forward_backward_json(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        """The same call as a JSON body (json_fwdbwd.py): converted to the protobuf message
        once its envelope names a model of the caller's, then checked exactly as protobuf."""
        model_id, seq_id, forward_only = json_fwdbwd.envelope(body)
        row = self.ownership.model(tenant, model_id)
        self.intake.check_room(tenant, row, seq_id)
        kind = "forward" if forward_only else "forward_backward"
        op = op_or_refusal(
            kind, lambda: self._with_provenance(tenant, row, json_fwdbwd.to_proto(body))
        )
        promise = self.intake.submit_to_model(tenant, row, seq_id, op, parse.fingerprint(body))
        return promise.json()

    def _with_provenance(
        self, tenant: Tenant, row: ModelRow, msg: pb.ForwardBackwardRequest
    ) -> Forward | ForwardBackward:
        """The call decoded, its provenance spans checked against the stability records of the
        model's session (stability.attach: stable_reinforce then trains on the records)."""
        call = proto.decode_call(msg)
        spans = [stability.spans_from_proto(d) for d in msg.data]
        if call.loss_fn != STABLE_REINFORCE and all(
            s.model_input is None and s.loss_fn_inputs is None for s in spans
        ):
            return call
        data = stability.attach(
            self.ownership.store,
            self.stability_policy,
            tenant.id,
            row.session_id,
            call.loss_fn,
            call.data,
            spans,
        )
        return dataclasses.replace(call, data=data)

    def optim_step(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.OptimStep, body)
        op = op_or_refusal("optim_step", lambda: parse.optim_step(req.optim_params))
        return self._to_model(tenant, req.model_id, req.seq_id, op, parse.fingerprint(body))

    def save_weights(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.SaveWeights, body)
        op = op_or_refusal("save_weights", lambda: parse.save_args(req))
        return self._to_model(tenant, req.model_id, req.seq_id, op, parse.fingerprint(body))

    def save_for_sampler(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.SaveWeightsForSampler, body)
        op = op_or_refusal("save_sampler", lambda: parse.save_sampler_args(req))
        # The SDK draws a new sampling_session_seq_id on every attempt of the same request
        # (save_weights_and_get_sampling_client), so it is left out of the retry fingerprint: a
        # retry whose first attempt reached us gets that attempt's future (whose result names
        # the sampling session actually created), not a "different request" conflict.
        same_request = {k: v for k, v in body.items() if k != "sampling_session_seq_id"}
        return self._to_model(tenant, req.model_id, req.seq_id, op, parse.fingerprint(same_request))

    def save_weights_external(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        """A PEFT export for download (external_weights.py), in the model's seq_id order like
        any save; the recipients are checked here, before the engine writes anything."""
        req = schemas.parse(schemas.SaveWeightsExternal, body)

        def build() -> SaveExternal:
            return SaveExternal(
                checkpoint_name(req.path),
                external_weights.parse_recipients(req.age_encryption_recipients),
                parse.expires_at(req.ttl_seconds),
            )

        op = op_or_refusal("save_external", build)
        return self._to_model(tenant, req.model_id, req.seq_id, op, parse.fingerprint(body))

    def load_weights(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        """Two requests share this route: create-from-state (session_id + model_seq_id) and the
        deprecated in-place load_state (model_id + seq_id)."""
        req = schemas.parse(schemas.LoadWeights, body)
        fingerprint = parse.fingerprint(body)
        if req.session_id is not None and req.model_seq_id is not None:
            if req.weights_access_token is not None:
                # refused, not ignored (as copy_weights): a token would suggest it grants access
                raise UserError(
                    "weights_access_token is not supported by this server: load your own "
                    "checkpoints or published ones, without a token"
                )
            self.ownership.session(tenant, req.session_id)
            checkpoint = self.ownership.readable_checkpoint(
                tenant, parse_tinker_path(req.path), with_optimizer=req.optimizer
            )
            if req.base_model is not None:
                self.served.check(req.base_model)
            parse.check_optimizer_type(req.optimizer_config)
            model_id = ids.model_id(req.session_id, req.model_seq_id)
            self.intake.check_new_model(model_id)
            op = CreateFromState(
                req.session_id,
                req.base_model,
                checkpoint,
                req.optimizer,
                req.user_metadata,
                optimizer_family=None
                if req.optimizer_config is None
                else parse.optimizer_family(req.optimizer_config),
            )
            place = Place(model_id, model_id, seq_id=0)
            return self.intake.submit(tenant, op, place, fingerprint).json()
        if req.model_id is not None and req.seq_id is not None:
            row = self.ownership.model(tenant, req.model_id)

            def build() -> LoadWeights:
                checkpoint = self.ownership.readable_checkpoint(
                    tenant, parse_tinker_path(req.path), with_optimizer=req.optimizer
                )
                return LoadWeights(checkpoint, req.optimizer)

            load = op_or_refusal("load_weights", build)
            return self.intake.submit_to_model(tenant, row, req.seq_id, load, fingerprint).json()
        raise UserError(
            "load_weights needs session_id + model_seq_id (create from state) or model_id + seq_id (load_state)"
        )


# A `TrainingClient`'s operations; each answers with a future. forward_backward is the one
# protobuf body (under the larger protobuf limit; a JSON body, Content-Type application/json,
# is accepted too); the others are JSON.


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
