"""SUFFIX drafting (SuffixDecoding, Arctic Inference; vLLM's `suffix` method): continuations of the longest match.

No weights. Two indexes (suffix automata, `suffix_index.py`), both updated incrementally, never rebuilt per step:
  * the request's own context (prompt + committed output), owned by its `SuffixDrafter`;
  * `SuffixCache` (`suffix_index.py`): the outputs of recent finished requests, shared by every drafter of one
    engine (owned by its `DrafterBuilder`; the engine calls drafters from one thread), LRU by request. A request
    enters when it ends (`Drafter.finish`, with its whole output) and is refreshed when a draft reads from it.
Per round, on q = context + [root], each index gives its longest suffix of q that occurs in it (length m, kept
as matching statistics: O(1) amortised per committed token). From up to `max_scan` occurrences of that match
the continuations (at most min(max_depth, floor(max_spec_factor * m)) tokens) are counted in a trie; a node's
probability is the product of the empirical frequencies along its path. Up to BACKOFF shorter matches (the
suffix links: more occurrences, fewer tokens drafted) are tried too. The draft is the most probable nodes
(best first, at least `min_token_prob`) within the verify width; a chain follows the most frequent child. The
index whose draft has the larger expected accepted length (its probabilities summed) wins the round.
Drafts are deterministic given what was committed, so verification samples y ~ p and descends (lossless).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.config import SpeculativeConfig
from specserve.speculative.drafter import Drafter
from specserve.speculative.suffix_index import IndexStats, SuffixAutomaton, SuffixCache, split_end
from specserve.speculative.trees.tree import DraftTree

REMATCH_TOKENS = 256  # context tail re-read against a rebuilt cache
BACKOFF = 3  # shorter matches tried per index and round


@dataclass
class _Match:
    """A reader's matching statistics against one index: the state and length of its longest matched suffix."""

    state: int = 0
    length: int = 0
    generation: int = -1


class SuffixDrafter(Drafter):
    capture: tuple[int, ...] = ()

    def __init__(self, cache: SuffixCache | None, max_depth: int, max_nodes: int, max_spec_factor: float,
                 min_token_prob: float, tree: bool, device: torch.device, max_scan: int = 64) -> None:
        """max_scan: occurrences of a match read per round (bounds a round's cost on repetitive text)."""
        if max_depth < 1:
            raise ValueError(f"--speculative-suffix-max-tree-depth must be >= 1, got {max_depth}")
        if max_nodes < 1:
            raise ValueError(f"--speculative-num-draft-tokens must be >= 2 for SUFFIX, got {max_nodes + 1}")
        self.cache = cache
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.tree = tree
        self.device = device
        self.max_scan = max_scan
        self._local = SuffixAutomaton()
        self._local.add_sequence(0)
        self._history = self._local.seqs[0]  # prompt + committed tokens
        self._prompt_len = 0
        self._global = _Match()
        self._next_root: int | None = None

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, cache: SuffixCache | None, device: torch.device) -> SuffixDrafter:
        return cls(cache, max_depth=cfg.suffix_max_tree_depth, max_nodes=cfg.num_draft_tokens - 1,
                   max_spec_factor=cfg.suffix_max_spec_factor, min_token_prob=cfg.suffix_min_token_prob,
                   tree=cfg.tree != "chain", device=device)

    @property
    def history(self) -> tuple[int, ...]:
        return tuple(self._history)

    def index_stats(self) -> IndexStats:
        """The request's own index (the shared one: `SuffixCache.stats`)."""
        return self._local.stats()

    def prefill(self, prompt_ids: list[int], hidden: torch.Tensor | None = None) -> None:
        assert not self._history, "a SuffixDrafter serves one request"
        self._extend(prompt_ids)
        self._prompt_len = len(self._history)

    def accept(self, tokens: list[int], hidden: torch.Tensor | None, next_root: int) -> None:
        assert tokens, "accept needs at least the root token"
        assert self._next_root is None or tokens[0] == self._next_root, (
            f"accepted path starts with {tokens[0]}, but the last bonus token was {self._next_root}")
        self._extend(tokens)
        self._next_root = next_root

    def finish(self, output: list[int]) -> None:
        """The request's whole output goes to the shared cache."""
        if self.cache is not None:
            self.cache.add(list(output))

    def skip(self, root: int) -> None:
        """Lookup keeps no per-round state."""

    def _extend(self, tokens: list[int]) -> None:
        g = self._global_match()
        for t in tokens:
            t = int(t)
            self._local.extend(0, t)
            if g is not None and self.cache is not None:
                g.state, g.length = self.cache.index.step(g.state, g.length, t)

    def _global_match(self) -> _Match | None:
        """The context's matching statistics against the shared cache, re-read after a rebuild."""
        if self.cache is None:
            return None
        g = self._global
        if g.generation != self.cache.generation:
            index = self.cache.index
            g.state, g.length, g.generation = 0, 0, self.cache.generation
            for t in self._history[-REMATCH_TOKENS:]:
                g.state, g.length = index.step(g.state, g.length, t)
        return g

    # -- drafting

    def propose(self, root: int, max_drafts: int | None = None) -> DraftTree:
        root = int(root)
        budget = self.max_nodes if max_drafts is None else min(self.max_nodes, max_drafts)
        best: list[tuple[int, int, float]] = []  # (token, parent node, probability), parents first
        if budget > 0:
            best = self._draft_local(root, budget)
            if self.cache is not None and len(self.cache):
                other = self._draft_cached(root, budget)
                if sum(p for *_, p in other) > sum(p for *_, p in best):
                    best = other
        tokens, parents, depths = [root], [-1], [0]
        for tok, parent, _ in best:
            tokens.append(tok)
            parents.append(parent)
            depths.append(depths[parent] + 1)
        data = torch.tensor([tokens, parents, depths], dtype=torch.long, device=self.device)  # [3, N+1]
        return DraftTree(tokens=data[0], parents=data[1], depths=data[2])

    def _draft_local(self, root: int, budget: int) -> list[tuple[int, int, float]]:
        idx, h = self._local, self._history
        start = idx.link[idx.last(0)]  # longest suffix of the context that also ends earlier
        state, m = idx.step(start, idx.length[start], root)
        big_l = len(h) + 1  # q = h + [root]

        def read(end: int, depth: int) -> list[int]:
            e = end & 0xFFFFFFFF
            period = big_l - e  # >= 1; past the end the text is read as repeating (as NGRAM does)
            return [h[e + k % period] if e + k % period < len(h) else root for k in range(depth)]

        return self._best(idx, state, m, budget, read, None)

    def _draft_cached(self, root: int, budget: int) -> list[tuple[int, int, float]]:
        cache = self.cache
        assert cache is not None
        g = self._global_match()
        assert g is not None
        idx = cache.index
        state, m = idx.step(g.state, g.length, root)

        def read(end: int, depth: int) -> list[int]:
            sid, e = split_end(end)
            cache.touch(sid)
            return idx.seqs[sid][e:e + depth]

        return self._best(idx, state, m, budget, read, cache.alive)

    def _best(self, idx: SuffixAutomaton, state: int, m: int, budget: int, read: Callable[[int, int], list[int]],
              alive: set[int] | None) -> list[tuple[int, int, float]]:
        """The best draft over the match and up to BACKOFF shorter ones (its suffix links): a shorter match has
        more occurrences (surer frequencies) but drafts fewer tokens (max_spec_factor x its length)."""
        best: list[tuple[int, int, float]] = []
        best_score = 0.0
        for _ in range(BACKOFF + 1):
            depth = min(self.max_depth, int(self.max_spec_factor * m))
            if state <= 0 or depth < 1:
                break
            conts = [c for c in (read(e, depth) for e in idx.occurrences(state, self.max_scan, alive)) if c]
            draft = self._select(conts, budget)
            score = sum(p for *_, p in draft)
            if score > best_score:
                best, best_score = draft, score
            state = idx.link[state]
            m = idx.length[state]
        return best

    def _select(self, conts: list[list[int]], budget: int) -> list[tuple[int, int, float]]:
        """The most probable nodes of the continuations' trie (probability = product of the empirical
        frequencies along the path), at least min_token_prob each, parents before children."""
        if not conts:
            return []
        # trie: node -> {token: child}; count[node] = continuations through it (node 0: all)
        kids: list[dict[int, int]] = [{}]
        count = [len(conts)]
        token = [-1]
        for c in conts:
            node = 0
            for t in c:
                nxt = kids[node].get(t)
                if nxt is None:
                    nxt = kids[node][t] = len(count)
                    kids.append({})
                    count.append(0)
                    token.append(t)
                count[nxt] += 1
                node = nxt
        out: list[tuple[int, int, float]] = []
        out_node = {0: 0}  # trie node -> draft node
        heap = [(-1.0, 0, 0)]  # (-probability, trie node, trie parent)
        while heap and len(out) < budget:
            neg, node, parent = heapq.heappop(heap)
            if node != 0:
                out.append((token[node], out_node[parent], -neg))
                out_node[node] = len(out)
            children = sorted(kids[node].values(), key=lambda k: -count[k])
            for child in children if self.tree else children[:1]:
                p = -neg * count[child] / count[node]
                if p >= self.min_token_prob:
                    heapq.heappush(heap, (-p, child, node))
        return out
