"""Token ids in, text deltas out: what a streaming response may send now, and what it ends with.

    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, stop_token_ids, stops)
    detok.push(ids) -> delta, ..., detok.finish() -> the rest

The concatenated deltas equal the final text of the request, which is what a non-streaming response
returns: the decoded completion without its closing stop token, cut before the first stop string.
Two things are held back until they are decided: an incomplete UTF-8 sequence (`tokenizers`' DecodeStream,
`Tokenizer.decode_stream`, decodes incrementally and waits for it), and a suffix of the text that may be
the start of a stop string (ours: `stop_cut`, `undecided_tail`). Where a decoder is not prefix-stable
(DecodeStream refuses), nothing more streams and `finish` sends the rest if it still extends what was sent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from specserve.tokenizer import Tokenizer

#: (token ids, skip_special_tokens) -> text


def stop_cut(text: str, stops: Iterable[str]) -> int:
    """Where the first stop string starts in `text`, else len(text)."""
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return min(hits, default=len(text))


def undecided_tail(text: str, stops: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class IncrementalDetokenizer:
    def __init__(self, tok: Tokenizer, skip_special_tokens: bool, stop_token_ids: Iterable[int],
                 stops: tuple[str, ...]) -> None:
        self._decode = tok.decode
        self._step: Callable[[list[int]], str] | None = tok.decode_stream(skip_special_tokens)  # None: stopped
        self._skip = skip_special_tokens
        self._stop_ids = frozenset(stop_token_ids)
        self._stops = stops
        self._ids: list[int] = []
        self._text = ""  # decoded so far
        self._sent = 0  # characters of _text already handed out

    def push(self, token_ids: Iterable[int]) -> str:
        """Add committed tokens; return the text that can be sent now."""
        new = [t for t in token_ids if t not in self._stop_ids]
        self._ids.extend(new)
        if not new or self._step is None:
            return ""
        try:
            self._text += self._step(new)
        except ValueError:  # the decoder is not prefix-stable: the rest waits for finish()
            self._step = None
            return ""
        limit = len(self._text)
        if self._stops:
            start = max(0, self._sent - max(len(s) for s in self._stops))
            limit = min(start + stop_cut(self._text[start:], self._stops),
                        len(self._text) - undecided_tail(self._text, self._stops))
        if limit <= self._sent:
            return ""
        delta = self._text[self._sent : limit]
        self._sent = limit
        return delta

    def finish(self) -> str:
        """The rest of the text, once the request has finished."""
        full = self._decode(self._ids, self._skip)
        full = full[: stop_cut(full, self._stops)]
        if not full.startswith(self._text[: self._sent]):  # a decoder that is not prefix-stable
            return ""
        delta = full[self._sent :]
        self._text, self._sent = full, len(full)
        return delta

    @property
    def text(self) -> str:
        """Everything handed out so far."""
        return self._text[: self._sent]
