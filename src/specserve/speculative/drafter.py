"""The one interface every drafter implements (n-gram, draft model, EAGLE-3, DFlash).

The speculative loop drives a drafter through one request:
  prefill(prompt_ids, hidden)          once, after the target's prefill
  propose(root, max_drafts) -> DraftTree  each round
  accept(tokens, hidden)               after verification, with the accepted path
A round the engine runs without speculation (adaptive speculation chose plain decoding) calls
`skip(root)` instead of `propose(root)`; `accept` follows with tokens [root]. When the request ends the engine
calls `finish(output)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from specserve.speculative.trees.tree import DraftTree


class Drafter(ABC):
    #: HF hidden_states indices of the target this drafter needs (0 = embeddings, i = output of layer i-1).
    capture: tuple[int, ...] = ()

    @abstractmethod
    def prefill(self, prompt_ids: list[int], hidden: torch.Tensor | None) -> None:
        """Start a request. hidden: captured target states of the prompt [T, len(capture)*H] or None."""

    @abstractmethod
    def propose(self, root: int, max_drafts: int | None = None) -> DraftTree:
        """Draft a tree rooted at `root`, the last emitted token (not yet in the target's KV).

        `max_drafts`: the caller verifies at most this many draft nodes (it cuts the rest); drafters whose cost
        grows with the draft (chains drafted step by step, DFlash's tree budget) draft only that much."""

    @abstractmethod
    def accept(self, tokens: list[int], hidden: torch.Tensor | None, next_root: int) -> None:
        """After verification: `tokens` = [root, accepted drafts...] now in the target's KV;
        hidden [len(tokens), len(capture)*H] their captured target states; `next_root` the bonus token."""

    @classmethod
    def propose_many(cls, drafters: Sequence[Drafter], roots: list[int],
                     max_drafts: list[int | None]) -> list[DraftTree]:
        """`propose` for several requests' drafters of this class in one engine step; drafters that can share
        their forwards across requests override it."""
        return [d.propose(r, m) for d, r, m in zip(drafters, roots, max_drafts, strict=True)]

    @property
    def backlog(self) -> int:
        """Committed tokens the next `propose` absorbs before drafting (drafters that catch up lazily: a new
        request's prompt, rounds skipped); at most the last round's accepted tokens + 1 while speculating."""
        return 0

    def finish(self, output: list[int]) -> None:
        """The request ended (finished or aborted; not preempted); `output`: every token it produced. Drafters that
        learn across requests keep it."""
        return

    def skip(self, root: int) -> None:
        """A round without drafts at `root`; `accept([root], ...)` follows. Drafters whose `propose` keeps
        state override this with something cheaper than drafting and discarding."""
        self.propose(root)
