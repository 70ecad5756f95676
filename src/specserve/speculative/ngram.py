"""NGRAM (prompt-lookup) drafting: propose what followed earlier occurrences of the current suffix.

No weights. The drafter keeps the request's token history and an index from every n-gram
(min_match <= n <= max_match) to the positions where it ends, updated as tokens are accepted,
so `propose` costs O(max_match * scan) rather than O(history).

Lookup, on q = history + [root] (L = len(q)):
  for n = max_match .. min_match, for each earlier end e of q[L-n:L] (most recent first, e < L):
      continuation = q[e], q[e+1], ... (max_depth tokens)
  where reading past the end of q continues with the continuation itself (q[j] = q[j - (L - e)]
  for j >= L): if q[e-n:e] repeats the suffix, the text is assumed to keep repeating with
  period L - e. This is what makes periodic text ("\\n\\n\\n", repeated lines) draft deeply
  instead of stopping after one period.
The first max_breadth distinct continuations are merged into a trie rooted at the root, in
priority order (best match's whole path first), and cut to max_nodes nodes.
"""

from __future__ import annotations

import torch

from specserve.config import SpeculativeConfig
from specserve.speculative.drafter import Drafter
from specserve.speculative.trees.tree import DraftTree


class NgramDrafter(Drafter):
    capture: tuple[int, ...] = ()

    def __init__(self, max_depth: int, max_nodes: int, min_match: int, max_match: int, max_breadth: int,
                 device: torch.device, max_scan: int = 64) -> None:
        """max_scan: earlier occurrences examined per n-gram length (most recent first); bounds the
        cost of `propose` on highly repetitive histories where one n-gram ends at thousands of places."""
        if max_depth < 1:
            raise ValueError(f"--speculative-num-steps must be >= 1 for NGRAM (draft depth), got {max_depth}")
        if max_nodes < 1:
            raise ValueError(
                f"--speculative-num-draft-tokens must be >= 2 for NGRAM (root + drafts), got {max_nodes + 1}"
            )
        if not 1 <= min_match <= max_match:
            raise ValueError(
                f"need 1 <= --speculative-ngram-min-match ({min_match}) <= --speculative-ngram-max-match ({max_match})"
            )
        if max_breadth < 1:
            raise ValueError(f"--speculative-ngram-max-breadth must be >= 1, got {max_breadth}")
        if max_scan < 1:
            raise ValueError(f"NgramDrafter max_scan must be >= 1, got {max_scan}")
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        self.min_match = min_match
        self.max_match = max_match
        self.max_breadth = max_breadth
        self.max_scan = max_scan
        self.device = device
        self._history: list[int] = []
        # n-gram (as a tuple, its length is n) -> end positions e (exclusive) in _history, ascending.
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._next_root: int | None = None  # bonus token of the last accept; the next accept's tokens[0]

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, device: torch.device) -> NgramDrafter:
        breadth = 1 if cfg.tree == "chain" else cfg.ngram_max_breadth
        return cls(
            max_depth=cfg.num_steps,
            max_nodes=cfg.num_draft_tokens - 1,
            min_match=cfg.ngram_min_match,
            max_match=cfg.ngram_max_match,
            max_breadth=breadth,
            device=device,
        )

    @property
    def history(self) -> tuple[int, ...]:
        """Prompt + every token committed to the target's KV (a copy; for inspection and tests)."""
        return tuple(self._history)

    def prefill(self, prompt_ids: list[int], hidden: torch.Tensor | None = None) -> None:
        self._history = []
        self._index = {}
        self._next_root = None
        self._extend(prompt_ids)

    def accept(self, tokens: list[int], hidden: torch.Tensor | None, next_root: int) -> None:
        assert tokens, "accept needs at least the root token"
        assert self._next_root is None or tokens[0] == self._next_root, (
            f"accepted path starts with {tokens[0]}, but the last bonus token was {self._next_root}"
        )
        self._extend(tokens)
        self._next_root = next_root

    def _extend(self, tokens: list[int]) -> None:
        h = self._history
        for t in tokens:
            h.append(int(t))
            end = len(h)
            for n in range(self.min_match, min(self.max_match, end) + 1):
                self._index.setdefault(tuple(h[end - n:end]), []).append(end)

    def continuations(self, root: int) -> list[list[int]]:
        """The distinct continuations of history + [root], best first (at most max_breadth)."""
        h = self._history
        big_l = len(h) + 1  # length of q = h + [root]
        found: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_match, big_l - 1), self.min_match - 1, -1):
            # A suffix of length n needs an earlier occurrence ending at e >= n, e < L: n <= len(h).
            key = (*h[big_l - n:], root)
            ends = self._index.get(key)
            if not ends:
                continue
            for i in range(len(ends) - 1, max(len(ends) - 1 - self.max_scan, -1), -1):
                cont = self._continuation(ends[i], root)
                if tuple(cont) in seen:
                    continue
                seen.add(tuple(cont))
                found.append(cont)
                if len(found) == self.max_breadth:
                    return found
        return found

    def _continuation(self, end: int, root: int) -> list[int]:
        h = self._history
        big_l = len(h) + 1
        period = big_l - end  # >= 1: the match ends before the trailing suffix does
        out: list[int] = []
        for k in range(self.max_depth):
            j = end + k % period
            out.append(h[j] if j < len(h) else root)
        return out

    def skip(self, root: int) -> None:
        """Lookup keeps no per-round state."""

    def propose(self, root: int, max_drafts: int | None = None) -> DraftTree:
        tokens = [int(root)]
        parents = [-1]
        depths = [0]
        child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for cont in self.continuations(int(root)):
            node = 0
            for t in cont:
                nxt = child.get((node, t))
                if nxt is None:
                    if len(tokens) - 1 == self.max_nodes:
                        break
                    nxt = len(tokens)
                    child[(node, t)] = nxt
                    tokens.append(t)
                    parents.append(node)
                    depths.append(depths[node] + 1)
                node = nxt
            if len(tokens) - 1 == self.max_nodes:
                break
        data = torch.tensor([tokens, parents, depths], dtype=torch.long, device=self.device)  # [3, N+1]
        return DraftTree(tokens=data[0], parents=data[1], depths=data[2])
