"""`bench compare`: side-by-side markdown tables of serving and acceptance runs, ratios to a baseline.

Inputs are serving and acceptance run JSONs (read by `runs.load_runs`).
Runs of both kinds may be mixed; each kind gets its own section, and its baseline is the first run
of that kind on the command line. Every cell after the baseline's shows the ratio to it; the best
value of a row (highest throughput / accept length / speedup, lowest latency) is bold and named
in the last column ("tie" when several share it; no winner when fewer than two runs have a value).
Missing values print as "-". Acceptance tables end with the mean over the tasks all runs share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specserve.bench.runs import Run


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _stat(entry: dict[str, Any], key: str, stat: str = "p50") -> float | None:
    stats = entry.get(key)
    return _num(stats.get(stat)) if isinstance(stats, dict) else None


# (title, value of one entry, True = higher is better / False = lower / None = no winner)
Metric = tuple[str, Callable[[dict[str, Any]], float | None], bool | None]

SERVING_METRICS: tuple[Metric, ...] = (
    ("Output throughput (tok/s)", lambda e: _num(e.get("output_throughput")), True),
    ("TTFT p50 (ms)", lambda e: _stat(e, "ttft_ms"), False),
    ("TPOT p50 (ms)", lambda e: _stat(e, "tpot_ms"), False),
    ("Accept length", lambda e: _num(e.get("accept_length")), True),
)
ACCEPTANCE_METRICS: tuple[Metric, ...] = (
    ("Accept length", lambda e: _num(e.get("accept_length")), True),
    ("Speedup over plain decoding", lambda e: _num(e.get("speedup")), True),
    ("Speculative tokens/s", lambda e: _num(e.get("spec_tokens_per_s")), True),
    ("Plain tokens/s", lambda e: _num(e.get("plain_tokens_per_s")), None),
)


def _table(runs: Sequence[Run], keys: list[Any], entries: list[dict[Any, dict[str, Any]]], metric: Metric,
           key_title: str, extra_rows: Callable[[Metric], list[str]] | None = None) -> list[str]:
    title, get, higher = metric
    header = [key_title] + [f"{r.label} (baseline)" if i == 0 else r.label for i, r in enumerate(runs)] + ["best"]
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key in keys:
        values = [get(e[key]) if key in e else None for e in entries]
        lines.append(_render_row(str(key), values, higher, runs))
    if extra_rows is not None:
        lines.extend(extra_rows(metric))
    return [*lines, ""]


def _render_row(key: str, values: list[float | None], higher: bool | None, runs: Sequence[Run]) -> str:
    """One table row; the best value is bold (all of them on a tie), judged only when >= 2 runs have one."""
    known = [v for v in values if v is not None]
    best: set[int] = set()
    if higher is not None and len(known) >= 2:
        top = max(known) if higher else min(known)
        best = {i for i, v in enumerate(values) if v is not None and abs(v - top) <= 1e-9 * max(1.0, abs(top))}
    base = values[0]
    cells = []
    for i, v in enumerate(values):
        if v is None:
            cells.append("-")
            continue
        text = f"{v:.2f}" if abs(v) < 100 else f"{v:.1f}"
        if i > 0 and base:
            text += f" ({v / base:.2f}×)"
        cells.append(f"**{text}**" if i in best else text)
    winner = "-" if not best else runs[min(best)].label if len(best) == 1 else "tie"
    return f"| {key} | " + " | ".join(cells) + f" | {winner} |"


def serving_section(runs: Sequence[Run]) -> list[str]:
    entries = [{lv["concurrency"]: lv for lv in r.data["levels"]} for r in runs]
    levels = sorted({c for e in entries for c in e})
    lines = ["## Serving", "", "| run | file | model | endpoint | dataset | output len | temperature |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        cfg = r.data.get("config") or {}
        dataset = (r.data.get("dataset") or {}).get("name", "-")
        lines.append(f"| {r.label} | {r.path.name} | {cfg.get('model', '-')} | {cfg.get('endpoint', '-')} | "
                     f"{dataset} | {cfg.get('output_len', '-')} | {cfg.get('temperature', '-')} |")
    lines.append("")
    for metric in SERVING_METRICS:
        lines.extend(_table(runs, levels, entries, metric, "concurrency"))
    failures = [f"- {r.label}, concurrency {c}: {e[c]['errors']} of {e[c].get('num_requests', '?')} requests failed"
                for r, e in zip(runs, entries, strict=True) for c in levels if c in e and e[c].get("errors")]
    if failures:
        lines.extend(["Failed requests:", "", *failures, ""])
    return lines


def acceptance_section(runs: Sequence[Run]) -> list[str]:
    entries = [{t["name"]: t for t in r.data["tasks"]} for r in runs]
    tasks: list[str] = []
    for e in entries:
        tasks.extend(name for name in e if name not in tasks)

    def mean_row(metric: Metric) -> list[str]:
        """Means over the tasks every run has a value for, so the runs are compared on the same tasks."""
        _, get, higher = metric
        common = [t for t in tasks if all(t in e and get(e[t]) is not None for e in entries)]
        if not common:
            return [_render_row("**mean** (no task common to all runs)", [None] * len(runs), None, runs)]
        means: list[float | None] = [sum(get(e[t]) or 0.0 for t in common) / len(common) for e in entries]
        return [_render_row(f"**mean** ({len(common)} common tasks)", means, higher, runs)]

    lines = ["## Acceptance", ""]
    for metric in ACCEPTANCE_METRICS:
        lines.extend(_table(runs, tasks, entries, metric, "task", mean_row))
    return lines


def render_report(runs: Sequence[Run]) -> str:
    if not runs:
        raise ValueError("bench compare needs at least one run JSON")
    lines = ["# Benchmark comparison", "", "Baseline of each section: its first run. Ratios are to the baseline; "
             "**bold** marks the best value of a row.", ""]
    serving = [r for r in runs if r.kind == "serving"]
    acceptance = [r for r in runs if r.kind == "acceptance"]
    if serving:
        lines.extend(serving_section(serving))
    if acceptance:
        lines.extend(acceptance_section(acceptance))
    return "\n".join(lines).rstrip() + "\n"


def write_report(runs: Sequence[Run], out: Path, plot: Path | None = None) -> None:
    from specserve.bench.plots import plot_runs  # matplotlib: loaded only when a plot is asked for

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_report(runs), encoding="utf-8")
    if plot is not None:
        plot.parent.mkdir(parents=True, exist_ok=True)
        plot_runs(runs, plot)
