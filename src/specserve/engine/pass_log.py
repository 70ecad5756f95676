"""A JSON-lines log of engine passes (`specserve serve --speculative-adaptive-trace FILE`): per step, what
adaptive speculation chose and what it got, so a served run's choices can be checked after the fact.

One line per decode pass: {"t": seconds since the log opened, at the pass's end, "batch": running requests,
"width": draft tokens verified per request (0 = plain decoding), "tokens": tokens the pass produced (before
stop conditions), "seconds": the pass's wall time (drafting, forward, verification), "forward_s": of which the
target forward, "catch_up": some drafter absorbed more than a round's tokens (not measured by the policy),
"kind": "decode"}.

One line per prefill pass (chunks of prompts, in steps of their own or before a step's decode pass):
{"t", "kind": "prefill", "batch": prompt chunks, "tokens": prompt tokens computed, "seconds": the pass's wall
time, "forward_s": of which the target forward, "drafter_s": of which the drafters taking in completed prompts,
"merged": the chunks rode in the step's decode forward (`BatchEngine._merges`): "seconds" is then only their work
after it, and "forward_s" 0 (their rows' share of the forward counts in the decode pass's)}.
A plain server writes the same log: comparing the two in one run says what speculation costs outside its own
decode passes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class PassLog:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)  # a line per pass: a killed server loses none
        self._t0 = time.monotonic()

    def write(self, batch: int, width: int, tokens: int, seconds: float, forward_s: float, catch_up: bool) -> None:
        self._file.write(json.dumps({
            "t": round(time.monotonic() - self._t0, 4), "batch": batch, "width": width, "tokens": tokens,
            "seconds": round(seconds, 5), "forward_s": round(forward_s, 5), "catch_up": catch_up, "kind": "decode",
        }) + "\n")

    def write_prefill(self, chunks: int, tokens: int, seconds: float, forward_s: float, drafter_s: float,
                      merged: bool = False) -> None:
        """`merged`: the chunks rode in a decode forward; `seconds` is then their work after it (forward_s 0)."""
        self._file.write(json.dumps({
            "t": round(time.monotonic() - self._t0, 4), "kind": "prefill", "batch": chunks, "tokens": tokens,
            "seconds": round(seconds, 5), "forward_s": round(forward_s, 5), "drafter_s": round(drafter_s, 5),
            "merged": merged,
        }) + "\n")

    def close(self) -> None:
        self._file.close()


def read_pass_log(path: Path, kind: str | None = "decode") -> list[dict[str, float]]:
    """The passes of `kind` ("decode", "prefill"; None: all) a `PassLog` wrote, in order."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [p for p in lines if kind is None or p.get("kind", "decode") == kind]
