"""PNG plots for `bench compare`: output tok/s vs concurrency (serving), accept length per task (acceptance).

Drawn on a bare `Figure` with the Agg canvas: no pyplot, no global backend switch, no display needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from specserve.bench.runs import Run


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _serving_axes(ax: Any, runs: Sequence[Run]) -> None:
    ticks: set[int] = set()
    for run in runs:
        points = sorted((lv["concurrency"], y) for lv in run.data["levels"]
                        if (y := _num(lv.get("output_throughput"))) is not None)
        if points:
            ticks.update(c for c, _ in points)
            ax.plot([c for c, _ in points], [y for _, y in points], marker="o", label=run.label)
    ax.set_xscale("log", base=2)
    if ticks:
        ax.set_xticks(sorted(ticks))
        ax.set_xticklabels([str(t) for t in sorted(ticks)])
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no successful level", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("concurrency (log scale)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Serving throughput")
    ax.grid(True, alpha=0.3)


def _acceptance_axes(ax: Any, runs: Sequence[Run]) -> None:
    tasks: list[str] = []
    for run in runs:
        tasks.extend(t["name"] for t in run.data["tasks"] if t["name"] not in tasks)
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        by_name = {t["name"]: _num(t.get("accept_length")) for t in run.data["tasks"]}
        heights = [by_name.get(name) or 0.0 for name in tasks]  # a missing value draws no bar
        positions = [j - 0.4 + width * (i + 0.5) for j in range(len(tasks))]
        ax.bar(positions, heights, width=width, label=run.label)
    ax.set_xticks(list(range(len(tasks))))
    ax.set_xticklabels(tasks, rotation=30, ha="right")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")  # plain decoding
    ax.set_ylabel("mean accept length")
    ax.set_title("Accept length per task")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)


def plot_runs(runs: Sequence[Run], path: Path) -> None:
    """One panel per run kind present, written as PNG to `path`."""
    serving = [r for r in runs if r.kind == "serving"]
    acceptance = [r for r in runs if r.kind == "acceptance"]
    panels = [p for p in ((serving, _serving_axes), (acceptance, _acceptance_axes)) if p[0]]
    if not panels:
        raise ValueError("nothing to plot: no serving or acceptance run given")
    fig = Figure(figsize=(7.0 * len(panels), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    for k, (group, draw) in enumerate(panels):
        draw(fig.add_subplot(1, len(panels), k + 1), group)
    fig.savefig(path, format="png", dpi=110)
