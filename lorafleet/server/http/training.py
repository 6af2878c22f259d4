"""The training operations: create a model (fresh or from a checkpoint), forward/backward,
optimizer steps, saves and loads. Each checks ownership, parses its payload (parse.py) and
hands it to intake; the engine work happens later, on the worker."""

from __future__ import annotations

from typing import Any

from lorafleet.server.errors import UserError
from lorafleet.server.http import parse, proto, schemas
from lorafleet.server.http.served import ServedBase
from lorafleet.server.ops.intake import Intake
from lorafleet.server.ops.payloads import (
    FromStateArgs,
    LoadArgs,
    SaveArgs,
    SaveExternalArgs,
    SaveSamplerArgs,
)
from lorafleet.server.state import external_weights, ids
from lorafleet.server.state.keys import Tenant
from lorafleet.server.state.ownership import Ownership
from lorafleet.server.state.paths import checkpoint_name, parse_tinker_path


class Training:
    def __init__(
        self, ownership: Ownership, intake: Intake, served: ServedBase, *, max_body_bytes: int
    ):
        self.ownership = ownership
        self.intake = intake
        self.served = served
        self.max_body_bytes = max_body_bytes

    def create_model(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.CreateModel, body)
        self.ownership.session(tenant, req.session_id)
        self.served.check(req.base_model)
        parse.check_optimizer_type(req.optimizer_config)
        args = parse.create_args(req, self.served)
        model_id = ids.model_id(req.session_id, req.model_seq_id)
        fingerprint = parse.fingerprint(body)
        self.intake.check_new_model(model_id)
        return self.intake.submit(
            tenant,
            "create_model",
            args,
            fingerprint=fingerprint,
            model_id=model_id,
            scope=model_id,
            seq_id=0,
            ordered=False,
        )

    def forward_backward(
        self, tenant: Tenant, raw: bytes, content_encoding: str | None
    ) -> dict[str, Any]:
        raw = parse.decode_body(raw, content_encoding, self.max_body_bytes)
        msg = proto.parse_forward_backward(raw)
        kind = "forward" if msg.forward_only else "forward_backward"
        return self.intake.submit_for_model(
            tenant,
            msg.model_id,
            msg.seq_id,
            kind,
            lambda: proto.decode_call(msg),
            parse.fingerprint(raw),
        )

    def optim_step(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.OptimStep, body)
        return self.intake.submit_for_model(
            tenant,
            req.model_id,
            req.seq_id,
            "optim_step",
            lambda: parse.optim_hparams(req.optim_params),
            parse.fingerprint(body),
        )

    def save_weights(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.SaveWeights, body)

        def build() -> SaveArgs:
            return parse.save_args(req)

        return self.intake.submit_for_model(
            tenant, req.model_id, req.seq_id, "save_weights", build, parse.fingerprint(body)
        )

    def save_for_sampler(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        req = schemas.parse(schemas.SaveWeightsForSampler, body)

        def build() -> SaveSamplerArgs:
            return parse.save_sampler_args(req)

        # The SDK draws a new sampling_session_seq_id on every attempt of the same request
        # (save_weights_and_get_sampling_client), so it is left out of the retry fingerprint: a
        # retry whose first attempt reached us gets that attempt's future (whose result names
        # the sampling session actually created), not a "different request" conflict.
        same_request = {k: v for k, v in body.items() if k != "sampling_session_seq_id"}
        return self.intake.submit_for_model(
            tenant,
            req.model_id,
            req.seq_id,
            "save_sampler",
            build,
            parse.fingerprint(same_request),
        )

    def save_weights_external(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        """A PEFT export for download (external_weights.py), in the model's seq_id order like
        any save; the recipients are checked here, before the engine writes anything."""
        req = schemas.parse(schemas.SaveWeightsExternal, body)

        def build() -> SaveExternalArgs:
            return SaveExternalArgs(
                checkpoint_name(req.path),
                external_weights.parse_recipients(req.age_encryption_recipients),
                parse.expires_at(req.ttl_seconds),
            )

        return self.intake.submit_for_model(
            tenant, req.model_id, req.seq_id, "save_external", build, parse.fingerprint(body)
        )

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
            args = FromStateArgs(
                req.session_id,
                req.base_model,
                checkpoint,
                req.optimizer,
                req.user_metadata,
                optimizer_family=None
                if req.optimizer_config is None
                else parse.optimizer_family(req.optimizer_config),
            )
            return self.intake.submit(
                tenant,
                "create_from_state",
                args,
                fingerprint=fingerprint,
                model_id=model_id,
                scope=model_id,
                seq_id=0,
                ordered=False,
            )
        if req.model_id is not None and req.seq_id is not None:

            def build() -> LoadArgs:
                checkpoint = self.ownership.readable_checkpoint(
                    tenant, parse_tinker_path(req.path), with_optimizer=req.optimizer
                )
                return LoadArgs(checkpoint, req.optimizer)

            return self.intake.submit_for_model(
                tenant, req.model_id, req.seq_id, "load_weights", build, fingerprint
            )
        raise UserError(
            "load_weights needs session_id + model_seq_id (create from state) or model_id + seq_id (load_state)"
        )
