"""Where a drafter loses: acceptance by draft position and by the class of the token it had to guess.

A greedy speculative run splits its output into verify rounds (`accept_lengths`): in a round accepting a, the
first a-1 tokens were drafts the target accepted at depths 1..a-1, and the last is the target's own token at
depth a — a miss, since the drafter did not propose it there (for a tree: on the accepted path), unless the round
had accepted drafts to the drafter's full depth. The output's first token comes from the prefill and the last
round may be cut by the length limit. Token classes: identifier (letters, digits, `_`, after a leading space),
whitespace (spaces, indents, newlines), punctuation (everything else: operators, brackets, quotes).

With a reference drafter on the same greedy continuation (same tokens), the report also counts, class by class,
the tokens one drafter accepted and the other missed: where ours falls short. A task whose reference output
differs (bf16 or GPU kernels can flip a greedy choice) has no token-by-token comparison: it is left out of
that count and counted in `skipped_mismatched`; our own figures still cover every task.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from specserve.config import SpeculativeConfig

CLASSES = ("identifier", "whitespace", "punctuation")
_IDENT = re.compile(r"\w+")


def token_class(text: str) -> str:
    if not text.strip():
        return "whitespace"
    return "identifier" if _IDENT.fullmatch(text.lstrip()) else "punctuation"


def max_depth(spec: SpeculativeConfig) -> int:
    """The deepest draft a round can propose (a round accepting this many drafts had no miss)."""
    if spec.algorithm == "DFLASH":
        return (spec.dflash_block_size or spec.num_draft_tokens) - 1
    if spec.algorithm in ("EAGLE3", "STANDALONE"):
        return spec.num_steps
    return spec.num_draft_tokens - 1


def token_outcomes(n_tokens: int, accept_lengths: Sequence[int], depth_cap: int) -> list[tuple[str, int] | None]:
    """Per output token: ("accepted" | "missed", depth), or None (the prefill's token, or a bonus token after
    a round that accepted drafts to the full depth)."""
    out: list[tuple[str, int] | None] = [None]
    for a in accept_lengths:
        out += [("accepted", d) for d in range(1, a)]
        out.append(("missed", a) if a - 1 < depth_cap else None)
        if len(out) >= n_tokens:
            break
    return out[:n_tokens]


def _rate(reached: int, accepted: int) -> float | None:
    return round(accepted / reached, 4) if reached else None


def diagnose(runs: Sequence[tuple[list[int], Sequence[int]]], decode: Callable[[list[int]], str], depth_cap: int,
             reference: Sequence[tuple[list[int], Sequence[int]]] | None = None,
             reference_depth_cap: int | None = None) -> dict[str, Any]:
    """runs: (output token ids, accept lengths) per task -> acceptance by depth and by token class (and, with
    `reference` runs of the same tasks, the classes of the tokens each accepted and the other missed, over the
    tasks where both outputs agree)."""
    depth: dict[int, list[int]] = {}  # depth -> [reached, accepted]
    by_class = {c: [0, 0] for c in CLASSES}
    misses = dict.fromkeys(CLASSES, 0)
    versus = {c: {"ours_missed_reference_accepted": 0, "ours_accepted_reference_missed": 0} for c in CLASSES}
    mismatched = 0
    for i, (ids, steps) in enumerate(runs):
        ours = token_outcomes(len(ids), steps, depth_cap)
        theirs = None
        if reference is not None:
            ref_ids, ref_steps = reference[i]
            if ref_ids == ids:
                theirs = token_outcomes(len(ids), ref_steps, reference_depth_cap or depth_cap)
            else:
                mismatched += 1
        for j, o in enumerate(ours):
            cls = token_class(decode([ids[j]]))
            if o is not None:
                kind, d = o
                hit = kind == "accepted"
                depth.setdefault(d, [0, 0])[0] += 1
                depth[d][1] += hit
                by_class[cls][0] += 1
                by_class[cls][1] += hit
                misses[cls] += not hit
            other = theirs[j] if theirs is not None else None
            if o is not None and other is not None:
                mine, ref = o[0] == "accepted", other[0] == "accepted"
                if ref and not mine:
                    versus[cls]["ours_missed_reference_accepted"] += 1
                elif mine and not ref:
                    versus[cls]["ours_accepted_reference_missed"] += 1
    total_misses = max(1, sum(misses.values()))
    report: dict[str, Any] = {
        "by_depth": [{"depth": d, "reached": r, "accepted": a, "rate": _rate(r, a)}
                     for d, (r, a) in sorted(depth.items())],
        "by_class": {c: {"reached": r, "accepted": a, "rate": _rate(r, a),
                         "share_of_misses": round(misses[c] / total_misses, 4)}
                     for c, (r, a) in by_class.items()},
    }
    if reference is not None:
        report["versus_reference"] = versus
        report["skipped_mismatched"] = mismatched
    return report
