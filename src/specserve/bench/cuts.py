"""Contexts cut from source files at three kinds of point, as requests start in practice.

A served prompt ends anywhere: at a line's end (an editor's cursor after the last character typed), after a
newline (a completion of the next line), or inside a line, often inside an identifier (a half-typed name).
A suite cut at one kind flatters drafters trained on that kind, so each task records its kind and reports are
given per kind (`bench/acceptance.py`).
  line_end       the context ends with a line's last character, its newline not included
  after_newline  the context ends right after a newline
  mid_line       the context ends strictly inside a line's code (after its indentation, before its last character)
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

CUT_KINDS = ("line_end", "after_newline", "mid_line")
_WORD = re.compile(r"\w")


@dataclass(frozen=True)
class Cut:
    prompt: str  # the context, starting at a line's beginning
    kind: str  # one of CUT_KINDS
    line: int  # 1-based line of the file the cut falls on
    in_identifier: bool  # the characters either side of the cut are both word characters


def code_lines(lines: list[str], lo: float = 1 / 3, hi: float = 2 / 3) -> list[int]:
    """Indices of non-blank, non-comment lines in the [lo, hi) fraction of the file."""
    return [i for i in range(int(len(lines) * lo), int(len(lines) * hi))
            if lines[i].strip() and not lines[i].lstrip().startswith("#")]


def cut_file(text: str, kind: str, rng: random.Random, context_lines: int | None = 24, context_chars: int = 1200,
             lo: float = 1 / 3, hi: float = 2 / 3) -> Cut | None:
    """One context of `kind` from the middle of `text` (the [lo, hi) fraction of its lines), at most
    `context_lines` lines (None: any number) and `context_chars` characters, beginning at a line; None where no
    line fits."""
    if kind not in CUT_KINDS:
        raise ValueError(f"cut kind {kind!r}: one of {', '.join(CUT_KINDS)}")
    lines = text.splitlines(keepends=True)
    candidates = [i for i in code_lines(lines, lo, hi) if cuttable(lines[i], kind, context_chars)]
    if not candidates:
        return None
    return cut_at(lines, rng.choice(candidates), kind, rng, context_lines, context_chars)


def cuttable(line: str, kind: str, context_chars: int) -> bool:
    """Whether `line` can be cut at `kind` (inside a line: two characters of code after its indentation) in a
    context of `context_chars`: the line, its newline included, must be shorter, else the context would begin
    inside it or, after a newline, hold nothing."""
    return len(line) < context_chars and (kind != "mid_line" or len(line.strip()) >= 2)


def cut_at(lines: list[str], i: int, kind: str, rng: random.Random, context_lines: int | None = 24,
           context_chars: int = 1200) -> Cut:
    """The context ending at line `i` (0-based) cut at `kind` (`cuttable` lines only)."""
    line = lines[i]
    body = line.rstrip("\r\n")
    if kind == "after_newline":
        offset = len(line)
    elif kind == "line_end":
        offset = len(body)
    else:
        indent = len(body) - len(body.lstrip())
        offset = rng.randrange(indent + 1, len(body))  # at least one code character before, one after
    first = 0 if context_lines is None else max(0, i - context_lines + 1)
    head = "".join(lines[first:i]) + line[:offset]
    if len(head) > context_chars:
        head = head[-context_chars:]
        head = head[head.find("\n") + 1:] if "\n" in head else head
    in_ident = 0 < offset < len(line) and bool(_WORD.match(line[offset - 1])) and bool(_WORD.match(line[offset]))
    return Cut(head, kind, i + 1, in_ident)
