"""The reliability battery's isolation parts (issue 34): `poison_row` (one tenant's hostile
sampling parameters in the same engine steps as other tenants' samples) and `quota_race`
(concurrent copies and samples against one tenant's storage and token quotas). The scenarios
live in tests/reliability (poison_row.py, quota_race.py), which runs them smaller in CI;
`hangup` (dropped OpenAI streams and abandoned SDK samples: how long the sampler keeps
working for nobody) too. bench/reliability.py calls `run` for the parts `--only` names."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

PARTS = ("poison_row", "quota_race", "hangup")
SUMMARY = {
    "poison_row_failed_others": "poison_row",
    "quota_overshoot": "quota_race",
    "hangup_busy_s": "hangup",
}
"""The summary figure each part gives (bench/reliability.py prints those of the parts run)."""


def run(
    parts: set[str],
    workdir: Path,
    out: dict[str, Any],
    rows: list[tuple[str, str, str]],
    log: Callable[[str], None],
) -> None:
    """Runs the parts of PARTS named in `parts`, adding each one's JSON to `out` (with its
    summary figure at the top level) and its table row to `rows`."""
    if "poison_row" in parts:
        from tests.reliability.poison_row import HOSTILE_PARAMS, run_poison_row

        log("poison_row: hostile sampling parameters in shared steps ...")
        poison = run_poison_row(workdir / "poison_row", victims=4, requests_per_victim=6, log=log)
        out["poison_row"] = poison
        out["poison_row_failed_others"] = poison["poison_row_failed_others"]
        rows.append(
            (
                "poison_row",
                f"{poison['victim_requests']} victim samples (SDK + /v1/completions, "
                f"{poison['victims']} tenants) and {2 * len(HOSTILE_PARAMS)} hostile ones "
                "(temperature 1e-300/1e-45/5e-324, top_p 1e-300, ...) started in the same steps",
                f"victims failed {poison['poison_row_failed_others']}, differing from solo "
                f"{poison['poison_row_solo_diffs']}, attacker 5xx {poison['poison_row_attacker_5xx']}",
            )
        )
    if "quota_race" in parts:
        from tests.reliability.quota_race import run_quota_race

        log("quota_race: concurrent copies and samples against quotas ...")
        race = run_quota_race(workdir / "quota_race", copies=20, samples=20, room=2, log=log)
        out["quota_race"] = race
        out["quota_overshoot"] = race["quota_overshoot"]
        rows.append(
            (
                "quota_race",
                f"{race['copies']} concurrent copy_weights vs storage_bytes={race['storage_bytes_limit']}, "
                f"{race['samples']} concurrent samples vs sampled_tokens_per_day="
                f"{race['sampled_tokens_per_day_limit']} (queued while the engine was held)",
                f"copies {race['copies_ok']} ok / {race['copies_refused']} refused, stored "
                f"{race['stored_bytes']} B (over by {race['quota_overshoot_bytes']}); samples "
                f"{race['samples_ok']} ok / {race['samples_refused']} refused, "
                f"{race['sampled_tokens']:.0f} tokens (over by {race['quota_overshoot_tokens']:.0f}); "
                f"unexpected answers {len(race['unexpected'])}",
            )
        )
    if "hangup" in parts:
        from tests.reliability.hangup import run_hangup

        log("hangup: dropped streams and abandoned SDK samples ...")
        hang = run_hangup(workdir / "hangup", log=log)
        out["hangup"] = hang
        out["hangup_busy_s"] = hang["hangup_busy_s"]
        rows.append(
            (
                "hangup",
                f"{hang['streams']} OpenAI streams of n={hang['n']} x {hang['max_tokens']} tokens "
                "dropped after their first chunk; 4 SDK samples abandoned by a 1 s asyncio timeout",
                f"sampler busy {hang['hangup_busy_s']} s after the last stream dropped, "
                f"{hang['hangup_metered_tokens']:.0f} of {hang['hangup_max_tokens']} tokens "
                f"drawn and metered; SDK: busy {hang['sdk_busy_s']} s (grace "
                f"{hang['abandon_grace_s']} s), {hang['sdk_metered_tokens']:.0f} of "
                f"{hang['sdk_max_tokens']} tokens",
            )
        )
