"""docs/tinker_api.md lists every public method of the SDK's four clients (a new SDK method
without a row, or a row for a method the SDK lacks, fails here), and the rows no other test
drives are driven here through the real SDK: the refused calls fail at once with an error
that says why, and the REST reads by path work."""

from __future__ import annotations

import base64
import inspect
import json
import re
from pathlib import Path

import pytest
import tinker

from lorafleet.server.main import ServerThread
from tests.server.conftest import KEY_A

TABLE = Path(__file__).resolve().parents[2] / "docs" / "tinker_api.md"
CLIENTS = (tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient)
STATUSES = ("supported", "client-side", "refused")


def sdk_methods(cls: type) -> set[str]:
    """Public callables and properties, an `_async` variant folded into its sync method."""
    names = {
        name
        for name in dir(cls)
        if not name.startswith("_")
        and (
            callable(getattr(cls, name)) or isinstance(inspect.getattr_static(cls, name), property)
        )
    }
    return {n.removesuffix("_async") if n.removesuffix("_async") in names else n for n in names}


def table_rows() -> dict[str, dict[str, str]]:
    """class -> {method: status}, read from the doc's per-class tables."""
    rows: dict[str, dict[str, str]] = {}
    current: str | None = None
    for line in TABLE.read_text().splitlines():
        heading = re.fullmatch(r"## (\w+)", line)
        if heading:
            current = heading.group(1)
            continue
        if current is None or not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        methods = re.findall(r"`(\w+)`", cells[0])
        status = cells[2]
        for method in methods:
            rows.setdefault(current, {})[method.removesuffix("_async")] = status
    return rows


def test_every_sdk_method_has_a_row_and_every_row_an_sdk_method() -> None:
    rows = table_rows()
    assert [c.__name__ for c in CLIENTS] == [c for c in rows if c in {x.__name__ for x in CLIENTS}]
    for cls in CLIENTS:
        documented = set(rows[cls.__name__])
        methods = sdk_methods(cls)
        assert methods - documented == set(), f"{cls.__name__}: no row in {TABLE.name}"
        assert documented - methods == set(), f"{cls.__name__}: rows for methods the SDK lacks"
        for method, status in rows[cls.__name__].items():
            assert status.startswith(STATUSES), f"{cls.__name__}.{method}: status {status!r}"


@pytest.mark.filterwarnings("ignore:DEPRECATED:FutureWarning")
def test_refused_calls_fail_at_once_and_say_why(server: ServerThread) -> None:
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    with pytest.raises(tinker.NotFoundError, match="does not implement GET /api/v1/audit"):
        rest.get_audit_log().result(timeout=30)
    with pytest.raises(tinker.NotFoundError, match="does not implement GET /api/v1/billing/usage"):
        rest.get_billing_usage("2026-01-01", "2026-02-01").result(timeout=30)
    with pytest.raises(Exception, match="JWT|jwt") as raised:
        rest.whoami().result(timeout=30)
    assert not isinstance(raised.value, TimeoutError)


def test_rest_reads_by_path(
    server: ServerThread, client_a: tinker.ServiceClient, base_model: str
) -> None:
    """get_sampler, get_training_run_by_tinker_path and set_checkpoint_ttl_from_tinker_path."""
    tc = client_a.create_lora_training_client(base_model=base_model, rank=4).result(timeout=60)
    path = tc.save_weights_for_sampler("coverage").result(timeout=60).path
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    run = rest.get_training_run_by_tinker_path(path).result(timeout=30)
    assert run.training_run_id == tc.get_info().model_id
    sampler = client_a.create_sampling_client(model_path=path).result(timeout=60)
    handle = json.loads(base64.urlsafe_b64decode(sampler.get_sampler_handle()))
    info = rest.get_sampler(handle["sampling_session_id"]).result(timeout=30)
    assert info.model_path == path and info.base_model == base_model
    rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result(timeout=30)
    (checkpoint,) = [
        c
        for c in rest.list_checkpoints(run.training_run_id).result(timeout=30).checkpoints
        if c.tinker_path == path
    ]
    assert checkpoint.expires_at is not None
