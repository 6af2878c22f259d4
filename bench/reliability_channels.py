"""The battery's side-channel phases (issue 34), kept apart from bench/reliability.py's own
parts so each can grow without the other: `prefix_probe` (can a tenant tell another's prompts
from its prefix-cache counters or its latency: `prefix_probe_auc`, 0.5 is chance) and
`stream_cost` (another tenant's training step with 64 console streams open over without:
`stream_cost_step_ratio`). The code is tests/reliability/channels.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

PHASES = ("prefix_probe", "stream_cost")
FIGURES = {"prefix_probe_auc": "prefix_probe", "stream_cost_step_ratio": "stream_cost"}


def run_phases(
    parts: set[str],
    workdir: Path,
    seed: int,
    out: dict[str, Any],
    rows: list[tuple[str, str, str]],
    log: Callable[[str], None],
) -> None:
    """Runs the phases named in `parts`, adding their results to `out` and table rows."""
    if "prefix_probe" in parts:
        from tests.reliability.channels import run_prefix_probe

        log("prefix_probe: a tenant guessing another's prompts ...")
        probe = run_prefix_probe(workdir / "prefix_probe", seed=seed)
        out["prefix_probe"] = probe
        out["prefix_probe_auc"] = probe["prefix_probe_auc"]
        rows.append(
            (
                "prefix_probe",
                f"{probe['trials']} guesses ({probe['prompt_tokens']} tokens) at a prompt another "
                "tenant just sent, half right, by the guesser's own counters and latency",
                f"AUC counters {probe['counters_auc']:.3f}, timing {probe['timing_auc']:.3f} "
                f"(hit tokens right {probe['right_guess_hit_tokens_mean']:.0f} / wrong "
                f"{probe['wrong_guess_hit_tokens_mean']:.0f}; median ms right "
                f"{probe['right_guess_ms_median']:.1f} / wrong {probe['wrong_guess_ms_median']:.1f})",
            )
        )
    if "stream_cost" in parts:
        from tests.reliability.channels import run_stream_cost

        log("stream_cost: 64 console streams while another tenant trains ...")
        cost = run_stream_cost(workdir / "stream_cost", seed=seed)
        out["stream_cost"] = cost
        out["stream_cost_step_ratio"] = cost["stream_cost_step_ratio"]
        rows.append(
            (
                "stream_cost",
                f"{cost['streams']} console streams on a run of {cost['curves']} curves x "
                f"{cost['points_per_curve']} points (growing) vs none, {cost['rounds']} rounds of "
                f"{cost['phase_s']:g} s each ({cost['steps_without']} / {cost['steps_with']} steps)",
                f"other tenant's step median {cost['step_ms_median_without']:.1f} -> "
                f"{cost['step_ms_median_with']:.1f} ms (max {cost['step_ms_max_with']:.1f}), "
                f"ratio {cost['stream_cost_step_ratio']:.2f}; {cost['snapshot_builds']} snapshot "
                f"builds in {cost['snapshot_build_s']:.1f} s "
                f"({cost['snapshot_builds_while_measured']} while measured)",
            )
        )
