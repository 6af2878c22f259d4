"""The reliability and security battery at full size: what was tried, and what held.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.reliability --json bench/results/reliability.json

Seven parts, the same code as tests/reliability (which runs them smaller in CI):
- load: N official-SDK clients (16 here, 4 in CI), one tenant each, looping create ->
  forward_backward -> optim_step -> sample -> save_state, then each tenant's requests replayed
  alone on a fresh server; lost/duplicated requests, cross-tenant differences, p50/p99 latency;
- crash: kill -9 of a subprocess server during forward_backward, optim_step, save_state,
  save_weights_for_sampler and the ephemeral export (20 cycles, 4 per operation; 5 in CI), with
  every reported save re-verified bit for bit after each restart;
- fuzz: >= 1000 hostile requests (hypothesis) plus slow clients while a victim tenant trains;
- security: bad keys on every route, cross-tenant probes, body limits, file modes, hostile
  names, the bind-address default;
- disk_full: the data dir on an 8 MiB filesystem (a tmpfs in a private mount namespace where
  the machine permits one, else the server's injected-ENOSPC hook), filled with saves, then
  freed: the engine lives on and saves work again without a restart;
- moved_dir: checkpoints of several tenants, the data dir moved, a restart there: every
  checkpoint lists, loads and samples (also from a schema-1 database with absolute paths);
- big_request: the server's peak RSS growth for the largest sample request its caps allow,
  and requests over the caps refused before any work;
- prefix_probe, stream_cost (bench/reliability_channels.py): the side channels between
  tenants (the prefix cache's counters and timing; console streams' cost to another tenant);
- poison_row, quota_race, hangup (bench/reliability_isolation.py): one tenant's hostile
  sampling parameters in the same engine steps as other tenants' samples
  (`poison_row_failed_others`), concurrent copies and samples against one tenant's quotas
  (`quota_overshoot`), and dropped streams / abandoned SDK calls (`hangup_busy_s`).

Everything runs on the tiny-qwen3 preset: the battery measures what the server survives, not
its speed (bench/server.py measures speed). Nothing here asserts anything; the tests do.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import reliability_channels, reliability_isolation
from bench.common import environment, fixed_dtype

REQUIRED = (
    "lost_requests",
    "cross_tenant_diffs",
    "torn_files_seen",
    "server_5xx",
    "crash_restarts_survived",
    "auth_bypasses",
    "disk_full_recovered",
    "checkpoints_lost_on_move",
    "peak_rss_growth_mb",
    *reliability_isolation.SUMMARY,
)


PART_OF = {
    "lost_requests": "load",
    "cross_tenant_diffs": "load",
    "torn_files_seen": "crash",
    "server_5xx": "fuzz",
    "crash_restarts_survived": "crash",
    "auth_bypasses": "security",
    "disk_full_recovered": "disk_full",
    "checkpoints_lost_on_move": "moved_dir",
    "peak_rss_growth_mb": "big_request",
    **reliability_channels.FIGURES,
    **reliability_isolation.SUMMARY,
}  # the part whose run a summary figure comes from (only those that ran are printed)


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument(
        "--tenants", type=int, default=16, help="concurrent SDK clients in the load part"
    )
    parser.add_argument("--steps", type=int, default=4, help="loop iterations per load tenant")
    parser.add_argument("--crash-cycles", type=int, default=20)
    parser.add_argument(
        "--fuzz-requests", type=int, default=2000, help="generated hostile requests (>= 1000)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--only",
        default=",".join(
            [
                "load",
                "crash",
                "fuzz",
                "security",
                "disk_full",
                "moved_dir",
                "big_request",
                *list(reliability_channels.PHASES),
                *reliability_isolation.PARTS,
            ]
        ),
        help="comma-separated parts to run",
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="keep data dirs and server logs here"
    )
    return parser.parse_args()


def _log(message: str) -> None:
    print(message, flush=True)


def _environment() -> dict[str, Any]:
    """The battery picks no dtype of its own: its in-process servers take EngineConfig's
    default and the crash part's `lorafleet serve` its `--dtype` default. Both are recorded,
    so the JSON says where it ran like every other bench's."""
    import dataclasses

    from lorafleet.hardware import resolve_dtype
    from lorafleet.server.engine.executor import EngineConfig

    engine = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "dtype")
    served = resolve_dtype("auto")
    in_process = resolve_dtype(str(engine))
    return environment(
        fixed_dtype(
            in_process.dtype,
            f"not a speed benchmark: in-process servers use EngineConfig's default {engine!r}; "
            f"the crash part's `lorafleet serve` --dtype auto runs {served.dtype} ({served.reason})",
        )
    )


def main() -> int:
    args = _args()
    # a SIGTERM unwinds like an exception, so the crash part stops its server subprocess
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(143))
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lorafleet-reliability-"))
    workdir.mkdir(parents=True, exist_ok=True)
    _log(f"workdir: {workdir} (tiny-qwen3 preset)")
    out: dict[str, Any] = {
        "benchmark": "reliability",
        "model": "tiny-qwen3",
        "environment": _environment(),
    }
    rows: list[tuple[str, str, str]] = []
    began = time.perf_counter()

    if "load" in parts:
        from dataclasses import asdict

        from tests.reliability.load import run_load

        _log(f"load: {args.tenants} tenants x {args.steps} steps ...")
        load = run_load(workdir, args.tenants, args.steps, args.seed)
        out["load"] = asdict(load)
        rows.append(
            (
                "load",
                f"{load.tenants} SDK tenants at once x {load.steps} loops (create, fwd_bwd, optim, sample, save_state); "
                f"{sum(load.sent.values())} operations; each tenant replayed alone",
                f"lost {load.lost_requests}, duplicated {load.duplicated_requests}, failed {len(load.failed_requests)}, "
                f"cross-tenant diffs {load.cross_tenant_diffs} (bit-exact tenants {load.bit_exact_tenants}/{load.tenants}, "
                f"max rel diff: weights {load.max_rel_weight_diff:.1e}, metrics {load.max_metric_rel_diff:.1e}, "
                f"logprobs {load.max_logprob_diff:.1e} abs; another tenant (control): weights "
                f"{load.control_rel_weight_diff or 0:.1e}, metrics {load.control_metric_rel_diff or 0:.1e}; "
                f"later-step sample flips {load.sample_flips}); mixed batches {load.mixed_batches}",
            )
        )

    if "crash" in parts:
        from tests.reliability.crash import run_crash

        _log(f"crash: {args.crash_cycles} kill -9 cycles ...")
        crash = run_crash(workdir / "crash", args.crash_cycles, args.seed, log=_log).summary()
        out["crash"] = crash
        modes: dict[str, int] = {}
        for cycle in crash["per_cycle"]:
            modes[cycle["mode"]] = modes.get(cycle["mode"], 0) + 1
        rows.append(
            (
                "crash",
                f"{crash['cycles']} x kill -9 during fwd_bwd/optim/save_state/save_for_sampler/export "
                f"({', '.join(f'{k} {v}' for k, v in sorted(modes.items()))}); {crash['server_starts']} server starts",
                f"survived {crash['crash_restarts_survived']}/{crash['cycles']}, torn files {crash['torn_files_seen']}, "
                f"hung futures {crash['hung_futures']}, kills mid-write {crash['mid_write_kills']}, "
                f"saves re-verified {crash['saves_verified']}, bit-exact loads {crash['loads_verified_bit_exact']}",
            )
        )

    if "fuzz" in parts:
        from tests.reliability.fuzz import run_fuzz

        _log(f"fuzz: {args.fuzz_requests} hostile requests ...")
        fuzz = run_fuzz(
            workdir / "fuzz", args.fuzz_requests, args.seed, victim_max_steps=40, log=_log
        )
        out["fuzz"] = fuzz.as_dict()
        slow = fuzz.slow_clients
        rows.append(
            (
                "fuzz",
                f"{fuzz.requests} hostile requests ({len(fuzz.by_kind)} kinds, incl. {slow['requests']} slow clients); "
                f"{fuzz.futures_checked} resulting futures polled; a victim tenant trained {fuzz.victim['steps']} steps meanwhile",
                f"5xx {fuzz.server_5xx}, unclear 4xx {fuzz.unclear_errors}, 403 {fuzz.forbidden_403}, "
                f"foreign 2xx {fuzz.foreign_2xx}, unresolved {fuzz.futures_unresolved}, server down {fuzz.server_down}, "
                f"trickled body -> {slow['trickled_body_status']} in {slow['trickled_body_answered_s']} s, "
                f"victim diffs {fuzz.victim['cross_tenant_diffs']}",
            )
        )

    if "security" in parts:
        from dataclasses import asdict

        from tests.reliability.security import run_security

        _log("security ...")
        security = run_security(workdir / "security")
        out["security"] = asdict(security)
        rows.append(
            (
                "security",
                f"{security.routes} routes x 7 missing/wrong keys; {security.isolation_probes} cross-tenant probes; "
                f"{len(security.limit_checks) - 1} body-limit cases; hostile names; file modes; bind address",
                f"bypasses {security.auth_bypasses}, isolation leaks {security.isolation_leaks}, 403s {security.forbidden_403}, "
                f"404-text leaks {security.message_leaks}, limit failures {security.limit_failures}, "
                f"bad modes {len(security.permission_problems)}, escaped files {len(security.escaped_files)}, "
                f"loopback ok {security.loopback.get('ok')}",
            )
        )

    if "disk_full" in parts:
        from tests.reliability.disk_full import run_disk_full

        _log("disk_full: 8 MiB data disk ...")
        disk = run_disk_full(workdir / "disk_full", size_mb=8)
        out["disk_full"] = disk
        rows.append(
            (
                "disk_full",
                f"data dir on an 8 MiB disk ({disk['mode']}); {disk.get('saves_until_full')} saves until full, "
                "one more, another tenant trains, checkpoints deleted, save again",
                f"recovered {disk['disk_full_recovered']}, save while full -> {disk.get('save_while_full')}, "
                f"other tenant {disk.get('other_tenant_training')}, healthz {disk.get('healthz_while_full')}, "
                f"problems {len(disk['problems'])}",
            )
        )

    if "moved_dir" in parts:
        from tests.reliability.moved_dir import run_moved_dir

        _log("moved_dir ...")
        moved = run_moved_dir(workdir / "moved_dir", tenants=4, saves=2)
        moved_old = run_moved_dir(workdir / "moved_dir_schema1", tenants=2, saves=1, schema_1=True)
        out["moved_dir"] = {"relative": moved, "from_schema_1": moved_old}
        rows.append(
            (
                "moved_dir",
                f"{moved['checkpoints_saved']} + {moved_old['checkpoints_saved']} checkpoints (the second set "
                "from a schema-1 database with absolute paths), data dir moved, restarted there",
                f"lost {moved['checkpoints_lost_on_move'] + moved_old['checkpoints_lost_on_move']}, "
                f"identical {moved['checkpoints_identical'] + moved_old['checkpoints_identical']}, "
                f"problems {len(moved['problems']) + len(moved_old['problems'])}",
            )
        )

    if "big_request" in parts:
        from tests.reliability.big_request import run_big_request

        _log("big_request: a sample request at the caps ...")
        big = run_big_request(workdir / "big_request", max_tokens=64)
        out["big_request"] = big
        shape = big["shape"]
        rows.append(
            (
                "big_request",
                f"{shape['num_samples']} samples x {shape['max_tokens']} tokens x top-{shape['topk']} "
                f"(~{big['estimated_response_bytes'] / 2**20:.1f} MiB, the caps' largest); then requests over each cap",
                f"peak RSS +{big['peak_rss_growth_mb']} MB in {big['seconds']} s, refused over caps "
                f"{big['over_cap_refused']} (+{big['refused_growth_mb']} MB)",
            )
        )

    reliability_channels.run_phases(parts, workdir, args.seed, out, rows, _log)
    reliability_isolation.run(parts, workdir, out, rows, _log)

    load_out, crash_out, fuzz_out, sec_out = (
        out.get(k, {}) for k in ("load", "crash", "fuzz", "security")
    )
    out["lost_requests"] = load_out.get("lost_requests", 0) + fuzz_out.get("futures_unresolved", 0)
    out["duplicated_requests"] = load_out.get("duplicated_requests", 0)
    out["cross_tenant_diffs"] = load_out.get("cross_tenant_diffs", 0) + fuzz_out.get(
        "victim", {}
    ).get("cross_tenant_diffs", 0)
    out["torn_files_seen"] = crash_out.get("torn_files_seen", 0)
    out["server_5xx"] = fuzz_out.get("server_5xx", 0)
    out["crash_restarts_survived"] = crash_out.get("crash_restarts_survived", 0)
    out["crash_cycles"] = crash_out.get("cycles", 0)
    out["auth_bypasses"] = sec_out.get("auth_bypasses", 0)
    out["isolation_leaks"] = sec_out.get("isolation_leaks", 0) + fuzz_out.get("foreign_2xx", 0)
    out["hostile_requests"] = fuzz_out.get("requests", 0)
    if "disk_full" in out:
        out["disk_full_recovered"] = out["disk_full"]["disk_full_recovered"]
    if "moved_dir" in out:
        out["checkpoints_lost_on_move"] = sum(
            r["checkpoints_lost_on_move"] for r in out["moved_dir"].values()
        )
    if "big_request" in out:
        out["peak_rss_growth_mb"] = out["big_request"]["peak_rss_growth_mb"]
    out["wall_s"] = time.perf_counter() - began

    print("\nreliability battery (tiny-qwen3)")
    print(f"{'part':<10} | {'what was tried':<70} | what held")
    for part, tried, held in rows:
        print(f"{part:<10} | {tried:<70} | {held}")
    if "load" in out:
        print("\nload latency per call (ms, all tenants, concurrent run)")
        print(f"{'call':<26}{'n':>6}{'p50':>10}{'p99':>10}{'max':>10}")
        for call, stats in out["load"]["latency_ms"].items():
            print(
                f"{call:<26}{stats['n']:>6}{stats['p50']:>10.1f}{stats['p99']:>10.1f}{stats['max']:>10.1f}"
            )
    print(
        "\n"
        + ", ".join(
            f"{k}={out[k]}"
            for k in (*REQUIRED, *reliability_channels.FIGURES)
            if PART_OF[k] in parts
        )
        + (f" (of {out['crash_cycles']} crash cycles)" if "crash" in parts else "")
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
