"""Security: keys on every route, tenant isolation with 404 (never 403, and the same message as
for an id that does not exist), body size limits, file modes, names that cannot leave the
data directory, and the loopback default with its warning.

Every check is a request whose expected answer is written next to it; the report counts the
answers that differ.
"""

from __future__ import annotations

import argparse
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import zstandard
from fastapi.routing import APIRoute

from lorafleet.server.app import PUBLIC_PATHS, SIGNED_GET_PREFIXES, create_app
from lorafleet.server.config import ServerConfig
from lorafleet.server.console.routes import CONSOLE
from lorafleet.server.main import ServerThread, warn_if_exposed
from tests.reliability.fuzz import NAMES, PROTOBUF, Raw, Tenancy, fwdbwd_body, set_up_tenant
from tests.reliability.harness import (
    files_outside,
    inprocess_server,
    permission_problems,
    tenant_keys,
)

API = "/api/v1"
LIMITS = {"max_json_bytes": 64 << 10, "max_body_bytes": 256 << 10}
WRONG_KEYS = [
    None,
    "",
    "tml-",
    "tml-not-a-tenant-0123456789",
    "TML-TENANT-A",
    "Bearer tml-x",
    "eyJhbGciOiJub25lIn0.e30.",
]


@dataclass
class SecurityReport:
    routes: int = 0
    auth_probes: int = 0
    auth_bypasses: int = 0
    isolation_probes: int = 0
    isolation_leaks: int = (
        0  # anything but a 404 (or a future failing as "unknown") on another tenant's id
    )
    forbidden_403: int = 0
    message_leaks: int = 0  # a 404 whose text differs from the one for an id that does not exist
    owner_denied: int = 0  # the owner's own requests refused (the 404s would then prove nothing)
    limit_checks: dict[str, Any] = field(default_factory=dict)
    limit_failures: int = 0
    permission_problems: list[str] = field(default_factory=list)
    escaped_files: list[str] = field(default_factory=list)
    loopback: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        if len(self.failures) < 30:
            self.failures.append(what[:400])

    def ok(self) -> bool:
        return not (
            self.auth_bypasses
            or self.isolation_leaks
            or self.forbidden_403
            or self.message_leaks
            or self.owner_denied
            or self.limit_failures
            or self.permission_problems
            or self.escaped_files
            or not self.loopback.get("ok")
        )


# ============================================================================ keys


def routes_of(server: ServerThread) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, path parameters filled with a dummy."""
    app = create_app(server.service)
    out = []
    for route in app.routes:
        if isinstance(route, APIRoute):
            path = re.sub(r"\{[^}]+\}", "x", route.path)
            out += [(method, path) for method in sorted(route.methods)]
    return sorted(set(out))


def _states_only(body: object) -> bool:
    """/healthz may say how the engine, the disk and the sampler are, and nothing else
    (lorafleet/server/ops/health.py)."""
    allowed = {
        "status": {"ok", "degraded"},
        "engine": {"ok"},
        "disk": {"ok", "full"},
        "rollout": {"ok", "degraded"},
    }
    return (
        isinstance(body, dict)
        and all(body.get(k) in v for k, v in allowed.items())
        and set(body) == set(allowed)
    )


def check_keys(server: ServerThread, report: SecurityReport) -> None:
    """Every route but the public liveness probe answers 401 to a missing or wrong key, before
    it validates anything (a junk query and body do not change that)."""
    routes = routes_of(server)
    report.routes = len(routes)
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for method, path in routes:
            for key in WRONG_KEYS:
                headers = {} if key is None else {"X-API-Key": key}
                response = client.request(
                    method, f"{path}?limit=oops", headers=headers, content=b"{not json"
                )
                report.auth_probes += 1
                public = path in PUBLIC_PATHS
                # signed download links: no key by design, the link's signature is the credential
                signed = method in ("GET", "HEAD") and path.startswith(SIGNED_GET_PREFIXES)
                # the console's page and assets hold no data; its API checks its own session
                # cookie (401 without one, like a missing key; tests/server/test_console_security.py)
                page = method == "GET" and (
                    path == CONSOLE or path.startswith(f"{CONSOLE}/static/")
                )
                if page:
                    if response.status_code not in (200, 404):
                        report.auth_bypasses += 1
                        report.fail(f"console {method} {path} answered {response.status_code}")
                    continue
                if public and (response.status_code != 200 or not _states_only(response.json())):
                    report.auth_bypasses += 1
                    report.fail(
                        f"public {method} {path} answered {response.status_code} {response.text[:100]}"
                    )
                elif signed and response.status_code != 403:
                    report.auth_bypasses += 1
                    report.fail(
                        f"signed {method} {path} without a signature answered {response.status_code}"
                    )
                elif not public and not signed and response.status_code != 401:
                    report.auth_bypasses += 1
                    report.fail(
                        f"{method} {path} with key {key!r} answered {response.status_code} {response.text[:200]}"
                    )


# ============================================================================ isolation


def _probes(owner: Tenancy, intruder: Tenancy) -> list[tuple[str, str, str, Any, str | None]]:
    """(label, method, path, body, the foreign id the error may name) as the intruder."""
    model, session = owner.own_models[0], owner.own_sessions[0]
    state, sampler_path = owner.own_checkpoints
    sampler, request = owner.own_samplers[0], owner.own_requests[-1]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    return [
        ("get_info", "POST", "get_info", {"model_id": model}, model),
        (
            "forward_backward",
            "POST",
            "forward_backward",
            fwdbwd_body(model, 99, [1, 2, 3, 4]),
            model,
        ),
        (
            "optim_step",
            "POST",
            "optim_step",
            {"model_id": model, "seq_id": 99, "adam_params": {"learning_rate": 1.0}},
            model,
        ),
        (
            "save_state",
            "POST",
            "save_weights",
            {"model_id": model, "seq_id": 99, "path": "stolen"},
            model,
        ),
        (
            "save_for_sampler",
            "POST",
            "save_weights_for_sampler",
            {"model_id": model, "seq_id": 99, "path": "stolen"},
            model,
        ),
        (
            "load_state_into_theirs",
            "POST",
            "load_weights",
            {"model_id": model, "seq_id": 99, "path": state},
            model,
        ),
        (
            "create_from_their_state",
            "POST",
            "load_weights",
            {
                "session_id": intruder.own_sessions[0],
                "model_seq_id": 50,
                "path": state,
                "optimizer": True,
            },
            state,
        ),
        (
            "sampling_session_on_their_weights",
            "POST",
            "create_sampling_session",
            {
                "session_id": intruder.own_sessions[0],
                "sampling_session_seq_id": 50,
                "model_path": sampler_path,
            },
            sampler_path,
        ),
        (
            "sampling_session_in_their_session",
            "POST",
            "create_sampling_session",
            {"session_id": session, "sampling_session_seq_id": 50, "base_model": owner.base_model},
            session,
        ),
        (
            "sample_their_sampler",
            "POST",
            "asample",
            {"sampling_session_id": sampler, "prompt": prompt},
            sampler,
        ),
        (
            "sample_their_weights",
            "POST",
            "asample",
            {"model_path": sampler_path, "prompt": prompt},
            sampler_path,
        ),
        ("sample_their_state", "POST", "asample", {"model_path": state, "prompt": prompt}, state),
        ("poll_their_future", "POST", "retrieve_future", {"request_id": request}, request),
        ("get_their_sampler", "GET", f"samplers/{sampler}", None, sampler),
        ("get_their_run", "GET", f"training_runs/{model}", None, model),
        ("list_their_checkpoints", "GET", f"training_runs/{model}/checkpoints", None, model),
        (
            "ttl_their_checkpoint",
            "PUT",
            f"training_runs/{model}/checkpoints/weights/fz-state/ttl",
            {"ttl_seconds": 1},
            state,
        ),
        (
            "delete_their_checkpoint",
            "DELETE",
            f"training_runs/{model}/checkpoints/weights/fz-state",
            None,
            state,
        ),
        ("weights_info_theirs", "POST", "weights_info", {"tinker_path": state}, state),
        ("heartbeat_their_session", "POST", "session_heartbeat", {"session_id": session}, session),
        (
            "finish_their_session",
            "POST",
            f"sessions/{session}/finish",
            {"reason": {"type": "success"}},
            session,
        ),
        (
            "create_model_in_their_session",
            "POST",
            "create_model",
            {
                "session_id": session,
                "model_seq_id": 50,
                "base_model": owner.base_model,
                "lora_config": {"rank": 2},
            },
            session,
        ),
    ]


def _ghost(named: str) -> str:
    """An id of the same shape that does not exist."""
    if named.startswith("tinker://"):
        return named.rsplit("/", 1)[0] + "/ghost-" + uuid.uuid4().hex[:8]
    return named[:-8] + uuid.uuid4().hex[:8]


def _swap(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, bytes):
        return value.replace(old.encode(), new.encode())
    if isinstance(value, dict):
        return {k: _swap(v, old, new) for k, v in value.items()}
    return value


def _send(raw: Raw, method: str, path: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return raw.client.request(method, path, content=body, headers=PROTOBUF)
    return raw.client.request(method, path, json=body)


def check_isolation(
    base_url: str, owner_key: str, intruder_key: str, base_model: str, report: SecurityReport
) -> None:
    owner, intruder = Raw(base_url, owner_key), Raw(base_url, intruder_key)
    try:
        theirs = set_up_tenant(owner, base_model, models=1)
        mine = set_up_tenant(intruder, base_model, models=1)
        ids = [
            *theirs.own_models,
            *theirs.own_sessions,
            *theirs.own_checkpoints,
            *theirs.own_samplers,
            *theirs.own_requests,
        ]
        for label, method, path, body, named in _probes(theirs, mine):
            response = _send(intruder, method, path, body)
            report.isolation_probes += 1
            if response.status_code == 403:
                report.forbidden_403 += 1
            if response.status_code != 404:
                report.isolation_leaks += 1
                report.fail(f"isolation {label}: {response.status_code} {response.text[:200]}")
                continue
            # the same request naming an id that never existed must read the same
            if named:
                ghost = _ghost(named)
                twin_path, twin_body = _swap(path, named, ghost), _swap(body, named, ghost)
                if named.startswith("tinker://"):  # REST paths carry only the checkpoint's name
                    twin_path = _swap(twin_path, named.rsplit("/", 1)[1], ghost.rsplit("/", 1)[1])
                twin = _send(intruder, method, twin_path, twin_body)
                same = twin.status_code == 404 and (
                    twin.json()["error"].replace(ghost, "<id>")
                    == response.json()["error"].replace(named, "<id>")
                )
                if not same:
                    report.message_leaks += 1
                    report.fail(
                        f"isolation {label}: 404 text differs from a missing id's: {response.text[:150]} vs {twin.text[:150]}"
                    )
        # a request on the intruder's own model that names their checkpoint takes its seq_id
        # place (200) and must fail as "unknown checkpoint", exactly like a missing one
        model = mine.own_models[0]
        for path, seq in (
            (theirs.own_checkpoints[0], mine.next_seq[model]),
            (theirs.own_checkpoints[0][:-3] + "xyz", mine.next_seq[model] + 1),
        ):
            promise = intruder.post(
                "load_weights", {"model_id": model, "seq_id": seq, "path": path}
            )
            answer = intruder.result(promise["request_id"])
            report.isolation_probes += 1
            text = "" if answer is None else answer.text
            if '"unknown checkpoint' not in text:
                report.isolation_leaks += 1
                report.fail(f"load_state naming their checkpoint: {text[:200]}")
        for path, key in (
            ("training_runs?limit=1000", "training_runs"),
            ("checkpoints?limit=1000", "checkpoints"),
        ):
            listing = intruder.client.get(path)
            report.isolation_probes += 1
            if listing.status_code != 200 or any(i in listing.text for i in ids):
                report.isolation_leaks += 1
                report.fail(
                    f"the intruder's {key} listing shows the owner's ids: {listing.text[:200]}"
                )
        stats = intruder.client.get("lorafleet/stats")
        report.isolation_probes += 1
        if any(i in stats.text for i in ids):
            report.isolation_leaks += 1
            report.fail("lorafleet/stats shows another tenant's ids")
        # the owner still has everything, and may use it (so the 404s above were not vacuous)
        for method, path, body in (
            ("POST", "get_info", {"model_id": theirs.own_models[0]}),
            ("GET", f"samplers/{theirs.own_samplers[0]}", None),
            ("GET", f"training_runs/{theirs.own_models[0]}", None),
            ("POST", "weights_info", {"tinker_path": theirs.own_checkpoints[0]}),
            ("POST", "session_heartbeat", {"session_id": theirs.own_sessions[0]}),
            ("POST", "retrieve_future", {"request_id": theirs.own_requests[-1]}),
        ):
            response = _send(owner, method, path, body)
            if response.status_code != 200:
                report.owner_denied += 1
                report.fail(
                    f"the owner's {method} {path}: {response.status_code} {response.text[:200]}"
                )
        listed = owner.client.get(f"training_runs/{theirs.own_models[0]}/checkpoints").json()
        if {c["tinker_path"] for c in listed.get("checkpoints", [])} != set(theirs.own_checkpoints):
            report.owner_denied += 1
            report.fail(f"the owner's checkpoints changed: {listed}")
    finally:
        owner.close()
        intruder.close()


# ============================================================================ limits and files


def check_limits(base_url: str, key: str, report: SecurityReport) -> None:
    headers = {"X-API-Key": key}
    json_over = b'{"tags": ["' + b"x" * LIMITS["max_json_bytes"] + b'"]}'
    proto_over = b"\x0a" * (LIMITS["max_body_bytes"] + 1)

    def chunks(data: bytes) -> Any:
        return iter([data[i : i + 8192] for i in range(0, len(data), 8192)])

    cases = {
        "json_over_limit": ("create_session", json_over, {"Content-Type": "application/json"}),
        "json_over_limit_chunked": (
            "create_session",
            chunks(json_over),
            {"Content-Type": "application/json"},
        ),
        "protobuf_over_limit": ("forward_backward", proto_over, PROTOBUF),
        "protobuf_over_limit_chunked": ("forward_backward", chunks(proto_over), PROTOBUF),
        "zstd_bomb": (
            "forward_backward",
            zstandard.ZstdCompressor().compress(b"\0" * (64 << 20)),
            {**PROTOBUF, "Content-Encoding": "zstd"},
        ),
    }
    with httpx.Client(base_url=base_url + API, timeout=60) as client:
        for name, (path, content, extra) in cases.items():
            try:
                response = client.post(path, content=content, headers={**headers, **extra})
                status, text = response.status_code, response.text
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                status, text = 0, f"{type(exc).__name__}: {exc}"
            report.limit_checks[name] = status
            if status != 413 or "limit" not in text:
                report.limit_failures += 1
                report.fail(f"{name}: {status} {text[:200]}")
        under = client.post("create_session", json={"tags": ["x" * 1000]}, headers=headers)
        report.limit_checks["json_under_limit"] = under.status_code
        if under.status_code != 200:
            report.limit_failures += 1
            report.fail(f"a small JSON body was refused: {under.status_code} {under.text[:200]}")


def check_names(base_url: str, key: str, base_model: str, report: SecurityReport) -> None:
    """Hostile names as checkpoint names, tinker paths and REST path segments; whatever they do,
    nothing may be created outside the data directory (check_files looks)."""
    raw = Raw(base_url, key)
    try:
        t = set_up_tenant(raw, base_model, models=1)
        model = t.own_models[0]
        seq = t.next_seq[model]
        for name in NAMES:
            for route in ("save_weights", "save_weights_for_sampler"):
                promise = raw.post(route, {"model_id": model, "seq_id": seq, "path": name})
                seq += 1
                raw.result(promise["request_id"])
            for field_name, route, body in (
                (
                    "path",
                    "load_weights",
                    {
                        "session_id": t.own_sessions[0],
                        "model_seq_id": 9,
                        "path": f"tinker://{model}/weights/{name}",
                    },
                ),
                (
                    "model_path",
                    "create_sampling_session",
                    {
                        "session_id": t.own_sessions[0],
                        "sampling_session_seq_id": 9,
                        "model_path": name,
                    },
                ),
                ("tinker_path", "weights_info", {"tinker_path": f"tinker://{name}/weights/{name}"}),
            ):
                response = raw.client.post(route, json=body)
                if response.status_code >= 500:
                    report.fail(f"{route} with {field_name}={name!r}: {response.status_code}")
            quoted = (
                httpx.URL(f"http://x/{name}").raw_path.decode().lstrip("/")
                if "\x00" not in name
                else "x"
            )
            raw.client.delete(f"training_runs/{model}/checkpoints/weights/{quoted}")
    finally:
        raw.close()


def check_files(data_dir: Path, box: Path, report: SecurityReport) -> None:
    report.permission_problems = permission_problems(data_dir)
    report.escaped_files = [p for p in files_outside(box, data_dir) if p != "sentinel"]
    for path in data_dir.rglob("*"):
        if data_dir.resolve() not in path.resolve().parents:
            report.escaped_files.append(f"{path} resolves outside the data dir")


# ============================================================================ bind address


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def check_loopback(report: SecurityReport) -> None:
    from lorafleet import cli

    capture = _Capture()
    logger = logging.getLogger("lorafleet.server.main")
    logger.addHandler(capture)
    try:
        exposed = {
            host: warn_if_exposed(host) for host in ("0.0.0.0", "::", "", "10.1.2.3", "example.com")
        }
        quiet = {
            host: warn_if_exposed(host) for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2")
        }
    finally:
        logger.removeHandler(capture)
    parser = argparse.ArgumentParser()
    cli._register_serve(parser.add_subparsers())
    serve_default = parser.parse_args(["serve", "--base-model", "m", "--data-dir", "d"]).host
    config_default = ServerConfig.__dataclass_fields__["host"].default
    warned = len(capture.messages) == len(exposed) and all("TLS" in m for m in capture.messages)
    report.loopback = {
        "cli_default_host": serve_default,
        "config_default_host": config_default,
        "warns_for": sorted(h or "<all>" for h, w in exposed.items() if w),
        "quiet_for": sorted(h for h, w in quiet.items() if not w),
        "warning_mentions_tls": warned,
    }
    report.loopback["ok"] = (
        serve_default == "127.0.0.1"
        and config_default == "127.0.0.1"
        and all(exposed.values())
        and not any(quiet.values())
        and warned
    )
    if not report.loopback["ok"]:
        report.fail(f"loopback: {report.loopback}")


# ============================================================================ the whole scenario


def run_security(workdir: Path) -> SecurityReport:
    report = SecurityReport()
    owner, intruder, names = tenant_keys(3, "sec")
    box = workdir / "security-box"
    box.mkdir(parents=True, exist_ok=True)
    (box / "sentinel").write_text("must stay alone next to the data dir\n")
    data_dir = box / "data"
    began = time.perf_counter()
    with inprocess_server(data_dir, [owner, intruder, names], **LIMITS) as server:
        base_model = str(server.service.executor.base_path)
        check_keys(server, report)
        check_isolation(server.base_url, owner, intruder, base_model, report)
        check_limits(server.base_url, owner, report)
        check_names(server.base_url, names, base_model, report)
        check_files(data_dir, box, report)
    check_loopback(report)
    report.limit_checks["wall_s"] = round(time.perf_counter() - began, 1)
    return report
