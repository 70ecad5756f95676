"""Closing a constrained output before its token budget runs out, so that what a grammar admits is also what a
request gets: a JSON answer that loops (repeated keys, list items without end) would otherwise stop at
`max_tokens` as a valid prefix that does not parse.

`closing_tokens` walks a copy of the matcher to a complete output the short way: tokens the grammar forces, else
the first of a few closers it takes (in a JSON string `"}`, `"`, ...; outside one `}`, `]`, then the shortest
values `0`, `null`, `""`), else its lowest allowed id, then EOS. A request's `GrammarState` compares that path's
length `c` with the tokens left `r`:

- `r - c <= CLOSE_SLACK` (JSON grammars; others `r <= c`): closing: the path's next token is the only one allowed;
- `r - c <= window` (JSON grammars): winding down: the grammar's tokens without an opening character
  (`{ [ " : , \\`), which cannot lengthen the path by more than a token, or the path's next token;
- else the grammar alone.

A free token of a JSON grammar lengthens the path by a few tokens per opening character at most, which the
window's width covers; other grammars are closed on a best-effort basis. The rule is a function of the committed
tokens and the budget, applied through the grammar's masks, so plain and speculative decoding see the same
distributions (greedy: the same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specserve.tokenizer import Tokenizer
from specserve.types import Grammar

#: characters that open a JSON structure or ask for more of one (a key, a value, an escape)
OPENERS = frozenset('{["\\:,')
#: preferred steps of a closing path, in order, inside a JSON string and outside one
IN_STRING = ('"}', '"]', '"', "}}", "}]", "]}", "}", "]")
OUTSIDE = ("}}", "}]", "]}", "}", "]", "0", "null", '""', "{}", "false", '"}', '"]', '"', "[", "{")
#: slack kept between the tokens left and the closing path's length: a winding-down token adds at most this
CLOSE_SLACK = 3
#: tokens left beyond which nothing is checked (the path is not computed: far from the budget's end)
NEAR = 256
#: longest closing path searched (longer: the output is left to the grammar alone)
MAX_PATH = 128


@dataclass(frozen=True)
class ClosingTable:
    """Per tokenizer: the closer ids and which tokens can only wind a JSON output down."""

    in_string: tuple[int, ...]  # closer ids, inside a JSON string
    outside: tuple[int, ...]  # closer ids, outside one
    texts: tuple[str, ...]  # every token's text
    safe: torch.Tensor  # [V] bool: the token's text has no opening character and is not only whitespace
    window: int  # tokens left (beyond the path) from which JSON outputs wind down

    @classmethod
    def build(cls, tokenizer: Tokenizer, vocab_size: int) -> ClosingTable:
        def ids(texts: tuple[str, ...]) -> tuple[int, ...]:
            return tuple(t for text in texts if (t := tokenizer.token_to_id(text)) is not None)

        texts = tuple(tokenizer.decode([i]) for i in range(min(vocab_size, tokenizer.vocab_size)))
        safe = torch.zeros(vocab_size, dtype=torch.bool)
        most = 0
        for i, text in enumerate(texts):
            n = sum(ch in OPENERS for ch in text)
            safe[i] = n == 0 and text.strip() != ""  # whitespace only: no progress, an invitation to loop
            most = max(most, n)
        # one free token can open `most` structures, each a few tokens to close again
        return cls(ids(IN_STRING), ids(OUTSIDE), texts, safe, 16 + 4 * most)

    def scan(self, state: tuple[bool, bool], token: int) -> tuple[bool, bool]:
        """(inside a JSON string, after a backslash in one) after `token`'s text."""
        inside, escaped = state
        for ch in self.texts[token] if token < len(self.texts) else "":
            if escaped:
                escaped = False
            elif inside and ch == "\\":
                escaped = True
            elif ch == '"':
                inside = not inside
        return inside, escaped


def is_json(grammar: Grammar) -> bool:
    return grammar.kind in ("json_object", "json_schema") or (grammar.kind == "lark" and "%json" in grammar.spec)


def closing_tokens(matcher: Any, table: ClosingTable, eos: int | None,
                   string: tuple[bool, bool] = (False, False)) -> list[int] | None:
    """The tokens of a short complete output from the matcher's place (EOS last unless the grammar stops by
    itself); None when none is found within MAX_PATH. `string`: the JSON string state there (`scan`). The
    matcher is not moved (a copy is walked)."""
    m = matcher.deep_copy()
    path: list[int] = []
    while len(path) < MAX_PATH:
        if m.is_stopped():
            return path
        forced = list(m.compute_ff_tokens())
        if forced:
            if not m.consume_tokens(forced):
                return None
            path += forced
            for t in forced:
                string = table.scan(string, t)
            continue
        if m.is_accepting():
            return [*path, eos] if eos is not None else path
        closers = table.in_string if string[0] else table.outside
        step = next((t for t in closers if m.validate_tokens([t]) == 1), None)
        if step is None:
            step = _lowest_allowed(m, eos)
            if step is None:
                return None
        if not m.consume_token(step):
            return None
        path.append(step)
        string = table.scan(string, step)
    return None


def _lowest_allowed(m: Any, eos: int | None) -> int | None:
    bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
    for t in np.flatnonzero(bits).tolist():
        if t != eos:
            return int(t)
    return None
