"""When a sequence finishes: EOS, stop tokens, stop strings, max new tokens, context limit.

Speculative paths accept several tokens per step; `StopChecker.feed` takes them one by one,
so a stop that falls inside an accepted run ends the output exactly where plain decoding would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from specserve.types import SamplingParams


class StopChecker:
    def __init__(
        self,
        params: SamplingParams,
        eos_ids: Iterable[int],
        max_total_len: int,
        prompt_len: int,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.limit = min(params.max_new_tokens, max_total_len - prompt_len)
        if self.limit < 1:
            raise ValueError(
                f"prompt of {prompt_len} tokens leaves no room under the context limit of {max_total_len}"
            )
        if params.stop and decode is None:
            raise ValueError("stop strings need a tokenizer to decode with")
        self.decode = decode
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.stop_text_at: int | None = None  # char offset where a matched stop string starts

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def feed(self, new_tokens: Iterable[int]) -> int:
        """Append tokens until one finishes the sequence; returns how many were taken."""
        taken = 0
        for t in new_tokens:
            if self.done:
                break
            self.tokens.append(int(t))
            taken += 1
            if int(t) in self.stop_ids or (self.params.stop and self._stop_string_hit()):
                self.finish_reason = "stop"
            elif len(self.tokens) >= self.limit:
                self.finish_reason = "length"
        return taken

    def _stop_string_hit(self) -> bool:
        """Look for a stop string in the text of the last few tokens (a token decodes to at least a
        fraction of a character, so 4 tokens per character cover any stop string); on a hit, find its
        exact offset in the full text once."""
        assert self.decode is not None
        longest = max(len(s) for s in self.params.stop)
        tail = self.decode(self.tokens[-(4 * longest + 8):])
        if not any(s in tail for s in self.params.stop):
            return False
        text = self.decode(self.tokens)
        hits = [i for s in self.params.stop if (i := text.find(s)) >= 0]
        if not hits:  # the tail decoded differently from the full text (a split character): not a hit
            return False
        self.stop_text_at = min(hits)
        return True

    def text(self) -> str:
        if self.decode is None:
            return ""
        text = self.decode(self.tokens)
        return text[: self.stop_text_at] if self.stop_text_at is not None else text
