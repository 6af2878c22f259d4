"""Seed-mean reward curves with their seed bands, one PNG (bench/parity.py, bench/lora_vs_full.py)."""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lorafleet.fsio import atomic_write_bytes


def plot_reward_curves(
    path: Path, curves: Mapping[str, Mapping[str, Any]], title: str, band_label: str
) -> Path:
    """One line per label (`reward_mean` of a bench/reward_stats.side_summary block) over a
    shaded band (`reward_min`..`reward_max`, drawn only with more than one seed), written
    atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, side in curves.items():
        mean = side["reward_mean"]
        steps = list(range(len(mean)))
        (line,) = ax.plot(steps, mean, marker="o", markersize=3, label=label)
        if len(side["seeds"]) > 1:
            ax.fill_between(
                steps, side["reward_min"], side["reward_max"], color=line.get_color(), alpha=0.2
            )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step (updates applied before its rollouts)")
    ax.set_ylabel(f"mean training reward ({band_label})")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())
