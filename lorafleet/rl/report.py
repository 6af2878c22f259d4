"""What the user sees: per-tenant progress bars, metrics JSONL, a reward-curve PNG and a summary
table. Kept apart from the loop so the loop stays testable without a terminal."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lorafleet.fsio import atomic_write_bytes


class MetricsLog:
    """One JSON object per step. The whole file is rewritten atomically each step (it is small),
    so a Ctrl-C mid-write never leaves a torn last line."""

    def __init__(self, path: Path, *, resume: bool):
        self.path = path
        self.rows: list[dict[str, Any]] = read_metrics(path) if resume and path.is_file() else []

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.rows).encode()
        atomic_write_bytes(self.path, data)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {number} is not JSON: {exc}") from None
    return rows


class Progress:
    """A rich progress bar per tenant; `enabled=False` (tests, pipes) prints nothing."""

    def __init__(self, enabled: bool):
        self._lock = threading.Lock()
        self._progress = None
        self._tasks: dict[str, Any] = {}
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._progress = RichProgress(
                TextColumn("[bold]{task.description:<12}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
            )

    def __enter__(self) -> Progress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def add(self, name: str, total: int, done: int) -> None:
        if self._progress is not None:
            with self._lock:
                self._tasks[name] = self._progress.add_task(
                    name, total=total, completed=done, stats=""
                )

    def update(self, name: str, done: int, stats: str) -> None:
        if self._progress is not None:
            with self._lock:
                self._progress.update(self._tasks[name], completed=done, stats=stats)


def plot_curves(
    path: Path, curves: Mapping[str, Sequence[dict[str, Any]]], key: str, ylabel: str
) -> Path:
    """One line per tenant of `key` against `step`, written atomically as a PNG."""
    return plot_panels(path, curves, [(key, ylabel)])


def plot_panels(
    path: Path,
    curves: Mapping[str, Sequence[dict[str, Any]]],
    panels: Sequence[tuple[str, str]],
) -> Path:
    """One panel per `(key, ylabel)` side by side, one line per tenant against `step` (rows
    without the key are skipped, so sparse series such as evaluations plot as their points),
    written atomically as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4), squeeze=False)
    for ax, (key, ylabel) in zip(axes[0], panels, strict=True):
        plotted = 0
        for name, rows in curves.items():
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", markersize=3, label=name)
                plotted += 1
        ax.set_xlabel("step (updates applied)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if plotted:
            ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(x) for x in row))
    Console().print(table)
