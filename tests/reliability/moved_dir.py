"""A moved data directory: stop the server, `mv data data2`, start on `data2`, and every checkpoint
must still list, load and sample exactly as before (found by an outside tester: the rows held
absolute paths, so start-up recovery deleted every checkpoint directory as an orphan).

Each tenant trains a model a little through the official SDK and saves training states and
sampler weights; before the move each one is probed (forward log-probs of a fixed datum from
the resumed training state, greedy tokens and log-probs from the sampler path). After the move
the same probes must give the same bytes, through a new server on the new directory.

`schema_1`: before the move the database is rewritten as the old server left it (schema 1,
absolute paths under the old directory), so the start on the new directory also migrates it:
the tester's case exactly.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import tinker
from tinker import types

from tests.reliability.crash import PROBE, probe_forward, probe_sample
from tests.reliability.harness import (
    inprocess_server,
    permission_problems,
    sqlite_problems,
    tenant_keys,
)

TIMEOUT_S = 120.0


def _train(tc: Any, tenant: int, step: int) -> None:
    tokens = [(tenant * 37 + step * 11 + i * 7) % 500 + 1 for i in range(12)]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 11},
    )
    tc.forward_backward([datum, PROBE], "cross_entropy").result(timeout=TIMEOUT_S)
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=TIMEOUT_S)


def _probe(client: tinker.ServiceClient, path: str, kind: str) -> bytes:
    if kind == "training":
        resumed = client.create_training_client_from_state_with_optimizer(path).result(
            timeout=TIMEOUT_S
        )
        return probe_forward(resumed)
    return probe_sample(client.create_sampling_client(model_path=path).result(timeout=TIMEOUT_S))


def as_schema_1(db_path: Path, data_dir: Path) -> int:
    """Rewrites the database as a schema-1 server left it: absolute checkpoint dirs under
    `data_dir`. Returns the rows rewritten."""
    db = sqlite3.connect(db_path, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        rows = db.execute("SELECT tinker_path, dir FROM checkpoints").fetchall()
        for tinker_path, stored in rows:
            db.execute(
                "UPDATE checkpoints SET dir=? WHERE tinker_path=?",
                (str(data_dir.resolve() / stored), tinker_path),
            )
        db.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
        db.execute("COMMIT")
        return len(rows)
    finally:
        db.close()


def run_moved_dir(
    root: Path, *, tenants: int = 2, saves: int = 2, schema_1: bool = False
) -> dict[str, Any]:
    """Saves `saves` training states and `saves` sampler checkpoints per tenant, moves the data
    dir to a new name and checks every one of them after a restart there."""
    keys = tenant_keys(tenants, "moved")
    old, new = root / "data", root / "data-moved"
    expected: dict[tuple[str, str], tuple[str, bytes]] = {}  # (key, path) -> (kind, probe)
    with inprocess_server(old, keys) as server:
        base_model = str(server.service.executor.base_path)
        for t, key in enumerate(keys):
            client = tinker.ServiceClient(base_url=server.base_url, api_key=key)
            tc = client.create_lora_training_client(base_model=base_model, rank=8, seed=t)
            tc = tc.result(timeout=TIMEOUT_S)
            for s in range(saves):
                _train(tc, t, s)
                state = tc.save_state(f"state-{s}").result(timeout=TIMEOUT_S).path
                sampler = tc.save_weights_for_sampler(f"sampler-{s}").result(timeout=TIMEOUT_S)
                for path, kind in ((state, "training"), (sampler.path, "sampler")):
                    expected[(key, path)] = (kind, _probe(client, path, kind))
            client.close("success").result(timeout=TIMEOUT_S)
    rewritten = as_schema_1(old / "lorafleet.db", old) if schema_1 else 0
    began = time.monotonic()
    os.rename(old, new)
    report: dict[str, Any] = {
        "tenants": tenants,
        "checkpoints_saved": len(expected),
        "rows_rewritten_as_schema_1": rewritten,
    }
    with inprocess_server(new, keys) as server:
        report["restart_s"] = round(time.monotonic() - began, 2)
        report["recovered"] = dict(server.service.recovered)
        listed: set[tuple[str, str]] = set()
        same = 0
        for key in keys:
            client = tinker.ServiceClient(base_url=server.base_url, api_key=key)
            rest = tinker.RestClient(base_url=server.base_url, api_key=key)
            page = rest.list_user_checkpoints(limit=1000).result(timeout=TIMEOUT_S)
            listed |= {(key, c.tinker_path) for c in page.checkpoints}
            for (owner, path), (kind, probe) in expected.items():
                if owner == key and _probe(client, path, kind) == probe:
                    same += 1
            client.close("success").result(timeout=TIMEOUT_S)
    report["checkpoints_listed"] = len(listed & expected.keys())
    report["checkpoints_identical"] = same
    report["checkpoints_lost_on_move"] = len(expected) - min(same, len(listed & expected.keys()))
    report["problems"] = sqlite_problems(new) + permission_problems(new)
    report["old_dir_left"] = old.exists()
    return report
