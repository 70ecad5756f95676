"""An acceptance report's figures per cut kind and over the tasks that do not loop.

Small targets loop under greedy decoding and a loop is easy to draft, so a suite's mean flatters every drafter;
tasks whose plain continuation repeats more than `threshold` of its 4-grams are left out of the `nonlooping`
figures, and so are tasks without a loop measure (through a server without a tokenizer): where no task has one,
those figures and the headline are None. The headline is the minimum over cut kinds of the non-looping accept
length: a drafter is as good as the kind of request it serves worst. Rows are the report's task entries
(offline or through a server).
"""

from __future__ import annotations

from typing import Any

LOOP_THRESHOLD = 0.25  # repeated 4-gram fraction of the plain output above which a task counts as looping


def pooled_accept(rows: list[dict[str, Any]]) -> float | None:
    """Accepted tokens over verify steps, pooled across the rows (each row's mean weighted by its steps; a row
    without steps adds nothing); the unweighted mean where no row counts steps (a server that gives a mean
    only); None for no rows."""
    if not rows:
        return None
    counted = [r for r in rows if r.get("verify_steps")]
    if counted:
        return sum(r["accept_length"] * r["verify_steps"] for r in counted) / sum(r["verify_steps"] for r in counted)
    return sum(r["accept_length"] for r in rows) / len(rows)


def nonlooping(row: dict[str, Any], threshold: float) -> bool:
    """Whether the row is measured not to loop (without a loop measure it is not known to)."""
    return row.get("loop_4gram") is not None and row["loop_4gram"] <= threshold


def _group(rows: list[dict[str, Any]], threshold: float) -> dict[str, Any]:
    calm = [r for r in rows if nonlooping(r, threshold)]
    loops = [r["loop_4gram"] for r in rows if r.get("loop_4gram") is not None]
    acc, calm_acc = pooled_accept(rows), pooled_accept(calm)
    return {
        "tasks": len(rows), "nonlooping_tasks": len(calm),
        "accept_length": None if acc is None else round(acc, 4),
        "accept_length_nonlooping": None if calm_acc is None else round(calm_acc, 4),
        "loop_4gram": round(sum(loops) / len(loops), 4) if loops else None,
    }


def kind_summary(rows: list[dict[str, Any]], threshold: float = LOOP_THRESHOLD) -> dict[str, Any]:
    """Summary entries: the non-looping figures over all rows, per cut kind where rows carry one (`kind`), and
    the headline (minimum over kinds of the non-looping accept length; without kinds, the non-looping one)."""
    overall = _group(rows, threshold)
    out: dict[str, Any] = {"loop_threshold": threshold, "nonlooping_tasks": overall["nonlooping_tasks"],
                           "accept_length_nonlooping": overall["accept_length_nonlooping"]}
    kinds = sorted({r["kind"] for r in rows if r.get("kind")})
    if kinds:
        out["by_kind"] = {k: _group([r for r in rows if r.get("kind") == k], threshold) for k in kinds}
        per_kind = [g["accept_length_nonlooping"] for g in out["by_kind"].values()]
        out["headline_accept_length"] = min(per_kind) if None not in per_kind else None
    else:
        out["headline_accept_length"] = overall["accept_length_nonlooping"]
    return out
