"""`specserve bench trace`: what a server's `--speculative-adaptive-trace` log says, level by level.

A served benchmark runs each level on each server in turn, so a server's log is a series of busy stretches
separated by idle ones: each stretch (split where no pass came for --gap seconds) is one level (or a warm-up).
Within a stretch the machine's state is about the same for both kinds of pass, so this says whether the policy's
choices paid at the time they were made. Only passes with at least 3/4 of the stretch's peak batch count;
catch-up passes (a joining request's drafter taking in its prompt) are left out of the speculating ones.

Per log, per stretch: its peak batch, passes, share speculating, tok/s of speculating and of plain passes and their
ratio (null where one kind is missing), and where the stretch's wall time went (decode passes, prefill passes, of
which drafters taking in prompts, and the rest: `outside_s`). `--after-speculation B`: plain passes by their
distance from the last speculating one; `--widths-at B`: decode passes of exactly B requests by draft width, and
the ceiling (speculating passes' tok/s over plain passes').
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from specserve.engine.pass_log import read_pass_log


def stretches(passes: list[dict[str, float]], gap: float) -> list[list[dict[str, float]]]:
    out: list[list[dict[str, float]]] = []
    last_end = None
    for p in passes:
        if last_end is None or p["t"] - p["seconds"] - last_end > gap:  # "t" is the pass's end
            out.append([])
        out[-1].append(p)
        last_end = p["t"]
    return out


def _rate(ps: list[dict[str, float]]) -> float | None:
    seconds = sum(p["seconds"] for p in ps)
    return sum(p["tokens"] for p in ps) / seconds if ps and seconds > 0 else None


def summarize(stretch: list[dict[str, float]]) -> dict[str, Any]:
    decodes = [p for p in stretch if p.get("kind", "decode") == "decode"]
    prefills = [p for p in stretch if p.get("kind") == "prefill"]
    wall = stretch[-1]["t"] - (stretch[0]["t"] - stretch[0]["seconds"])
    decode_s, prefill_s = sum(p["seconds"] for p in decodes), sum(p["seconds"] for p in prefills)
    budget = {"wall_s": round(wall, 3), "tokens": int(sum(p["tokens"] for p in decodes)),
              "decode_s": round(decode_s, 3), "prefill_s": round(prefill_s, 3),
              "prefill_drafter_s": round(sum(p.get("drafter_s", 0.0) for p in prefills), 3),
              "outside_s": round(wall - decode_s - prefill_s, 3)}
    if not decodes:
        return {"peak_batch": 0, "passes": 0, **budget}
    peak = int(max(p["batch"] for p in decodes))
    full = [p for p in decodes if p["batch"] * 4 >= peak * 3]
    spec = [p for p in full if p["width"] > 0 and not p["catch_up"]]
    plain = [p for p in full if p["width"] == 0]
    s, q = _rate(spec), _rate(plain)
    return {"peak_batch": peak, "passes": len(full), "spec_share": round(len(spec) / len(full), 3),
            "spec_tok_s": None if s is None else round(s, 1), "plain_tok_s": None if q is None else round(q, 1),
            "spec_over_plain": None if s is None or q is None else round(s / q, 3), **budget}


def after_speculation(passes: list[dict[str, float]], min_batch: int, warm_after: int = 9) -> dict[str, Any]:
    """Plain decode passes of at least `min_batch` requests by how many plain passes came since the last
    speculating one (1 = right after it; `warm_after` and more pooled as warm): per position, passes and the
    median seconds per request over the warm ones' median. What a plain pass measured during a refresh (the
    policy measures the second) says about plain decoding where the engine stays plain."""
    by: dict[int, list[float]] = {}
    since = warm_after
    for p in passes:
        if p["width"] > 0:
            since = 0
            continue
        since = min(since + 1, warm_after)
        if p["batch"] >= min_batch:
            by.setdefault(since, []).append(p["seconds"] / p["batch"])
    warm = by.get(warm_after)
    if not warm:
        return {}
    base = statistics.median(warm)
    return {str(k) if k < warm_after else f"{k}+":
            {"passes": len(v), "over_warm": round(statistics.median(v) / base, 3)} for k, v in sorted(by.items())}


def widths_at(passes: list[dict[str, float]], batch: int) -> dict[str, Any]:
    """Decode passes of exactly `batch` requests by draft width (catch-ups left out): passes, median ms, tokens
    per pass and tok/s; `ceiling`: the speculating passes' tok/s (all widths) over the plain passes' — what
    speculation gives over plain decoding at this batch size on this server were every pass like those (no
    prefill, no switching, no plain refreshes)."""
    by: dict[int, list[dict[str, float]]] = {}
    for p in passes:
        if p["batch"] == batch and not p["catch_up"]:
            by.setdefault(int(p["width"]), []).append(p)
    out: dict[str, Any] = {}
    for w, ps in sorted(by.items()):
        out[str(w)] = {"passes": len(ps), "median_ms": round(1e3 * statistics.median(p["seconds"] for p in ps), 2),
                       "tokens_per_pass": round(sum(p["tokens"] for p in ps) / len(ps), 2),
                       "tok_s": round(_rate(ps) or 0.0, 1)}
    plain, spec = _rate(by.get(0, [])), _rate([p for w, ps in by.items() if w > 0 for p in ps])
    out["ceiling"] = round(spec / plain, 3) if plain and spec is not None else None
    return out


def summarize_logs(paths: list[Path], gap: float = 1.0, min_batch: int = 4, after: int | None = None,
                   widths: int | None = None) -> dict[str, Any]:
    logs = []
    for path in paths:
        rows = [summarize(s) for s in stretches(read_pass_log(path, kind=None), gap)]
        entry: dict[str, Any] = {"pass_log": str(path), "stretches": [r for r in rows if r["peak_batch"] >= min_batch]}
        decodes = read_pass_log(path)
        if after is not None:
            entry["plain_after_speculation"] = after_speculation(decodes, after)
        if widths is not None:
            entry["widths_at"] = widths_at(decodes, widths)
        logs.append(entry)
    return {"kind": "trace", "logs": logs}


def add_trace_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("trace", help="summarize --speculative-adaptive-trace logs, level by level",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pass_log", type=Path, nargs="+", help="JSON-lines logs (`serve --speculative-adaptive-trace`)")
    p.add_argument("--gap", type=float, default=1.0, help="idle seconds that end a stretch")
    p.add_argument("--min-batch", type=int, default=4, help="leave out stretches of a smaller peak batch")
    p.add_argument("--after-speculation", type=int, default=None, metavar="B",
                   help="also: plain passes of at least B requests by their distance from the last speculating "
                        "pass, against warm ones")
    p.add_argument("--widths-at", type=int, default=None, metavar="B",
                   help="also: decode passes of exactly B requests by draft width, and the ceiling")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    p.set_defaults(func=cmd_trace)


def cmd_trace(a: argparse.Namespace) -> int:
    missing = [str(p) for p in a.pass_log if not p.is_file()]
    if missing:
        print(f"error: no trace log at {', '.join(missing)} (serve with --speculative-adaptive-trace FILE)",
              file=sys.stderr)
        return 2
    try:
        report = summarize_logs(list(a.pass_log), a.gap, a.min_batch, a.after_speculation, a.widths_at)
    except (ValueError, KeyError) as e:
        print(f"error: not a trace log ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=1)
    if a.out is not None:
        a.out.write_text(text + "\n")
    print(text)
    return 0
