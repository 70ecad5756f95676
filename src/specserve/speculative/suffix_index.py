"""An online suffix automaton over token sequences, and the cache of recent outputs built on one: the indexes
behind SUFFIX drafting (`suffix.py`).

Why an automaton rather than a suffix tree or array: appending a token is O(1) amortised (Blumer et al.: at
most 2n-1 states and 3n-4 transitions, and the suffix-link walks of all appends sum to O(n)), it needs no
end marker or implicit-suffix bookkeeping as Ukkonen's tree does, and a suffix array has no cheap append at
all. Matching is O(1) amortised too: a reader that feeds its own tokens through `step` keeps the longest
suffix of what it read that occurs in the indexed text (matching statistics), each token costing at most the
link steps an earlier token paid for. Several sequences may share one automaton and grow interleaved (the
generalised automaton: each sequence keeps its own last state).

State s stands for the substrings with one set of end positions, endpos(s); those positions are recorded in
the suffix-link tree: every appended token records its end (sequence id, offset after it) at the state it
ends in, and endpos(s) is what is recorded in s's subtree. `occurrences` walks that subtree (bounded), which
is where drafting reads continuations from and counts their frequencies.

Memory: per state three array slots and a transition dict (~350 bytes per indexed token in CPython, measured);
`stats` reports states, transitions, tokens and bytes.

`SuffixCache`: finished requests' outputs in one generalised automaton, LRU by request: past `max_requests` the
least recent is evicted. Evicted sequences are skipped by `occurrences` until they are as many tokens as the live
ones; then a new automaton is built from the live ones, `REBUILD_RATE` tokens for each token added to the cache
(reads use the old one meanwhile), and replaces it when it holds them all. So no add stalls the engine thread
for a pass over the whole cache (a one-shot rebuild of 500k tokens took 3.5 s), the cost stays O(1) amortised
per cached token, and memory stays within about 2.2x the live outputs plus the copy.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass

SEQ_SHIFT = 32  # an end position is (sequence id << SEQ_SHIFT) | offset
REBUILD_RATE = 8  # tokens copied into a rebuilding automaton per token added to the cache


@dataclass(frozen=True)
class IndexStats:
    states: int
    transitions: int
    tokens: int
    bytes: int  # the automaton's containers as CPython sizes them (`sys.getsizeof`), token lists included


class SuffixAutomaton:
    def __init__(self) -> None:
        self.length = array("q", [0])  # longest string of each state; state 0 is the root (empty string)
        self.link = array("q", [-1])  # suffix link
        self.pos = array("q", [-1])  # first end position recorded at the state (-1: none)
        self.next: list[dict[int, int]] = [{}]  # token -> state
        self._more_pos: dict[int, list[int]] = {}  # further end positions recorded at a state
        self._kids: dict[int, list[int]] = {}  # suffix-link tree; stale entries (link moved) are skipped
        self.seqs: dict[int, list[int]] = {}  # sequence id -> its tokens
        self._last: dict[int, int] = {}  # sequence id -> state of the whole sequence
        self.transitions = 0

    @property
    def num_states(self) -> int:
        return len(self.length)

    def add_sequence(self, seq_id: int) -> None:
        assert seq_id not in self.seqs, f"sequence {seq_id} is already indexed"
        self.seqs[seq_id] = []
        self._last[seq_id] = 0

    def last(self, seq_id: int) -> int:
        return self._last[seq_id]

    def extend(self, seq_id: int, token: int) -> None:
        """Append `token` to sequence `seq_id`: O(1) amortised."""
        toks = self.seqs[seq_id]
        toks.append(token)
        last = self._last[seq_id]
        q = self.next[last].get(token)
        if q is not None:  # another sequence already made this string (generalised automaton)
            state = q if self.length[q] == self.length[last] + 1 else self._clone(last, q, token)
        else:
            state = self._new(self.length[last] + 1, -1, {})
            p = last
            while p != -1 and token not in self.next[p]:
                self.next[p][token] = state
                self.transitions += 1
                p = self.link[p]
            if p == -1:
                self._set_link(state, 0)
            else:
                q = self.next[p][token]
                self._set_link(state, q if self.length[p] + 1 == self.length[q] else self._clone(p, q, token))
        end = (seq_id << SEQ_SHIFT) | len(toks)
        if self.pos[state] == -1:
            self.pos[state] = end
        else:
            self._more_pos.setdefault(state, []).append(end)
        self._last[seq_id] = state

    def _new(self, length: int, link: int, nxt: dict[int, int]) -> int:
        self.length.append(length)
        self.link.append(link)
        self.pos.append(-1)
        self.next.append(nxt)
        self.transitions += len(nxt)
        return len(self.length) - 1

    def _set_link(self, state: int, to: int) -> None:
        self.link[state] = to
        self._kids.setdefault(to, []).append(state)

    def _clone(self, p: int, q: int, token: int) -> int:
        clone = self._new(self.length[p] + 1, -1, dict(self.next[q]))
        self._set_link(clone, self.link[q])
        self._set_link(q, clone)
        while p != -1 and self.next[p].get(token) == q:
            self.next[p][token] = clone
            p = self.link[p]
        return clone

    def step(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """(state, length) of the longest suffix of (the `matched`-long string read so far + `token`) that occurs
        in the index, from (state, matched) of the string read so far. O(1) amortised over a reader's tokens."""
        state = self.normalize(state, matched)
        while state > 0 and token not in self.next[state]:
            state = self.link[state]
            matched = self.length[state]
        nxt = self.next[state].get(token)
        return (nxt, matched + 1) if nxt is not None else (0, 0)

    def normalize(self, state: int, matched: int) -> int:
        """The state that holds the `matched`-long suffix now: a clone made since may have taken it over."""
        while state > 0 and matched <= self.length[self.link[state]]:
            state = self.link[state]
        return state

    def occurrences(self, state: int, limit: int, alive: set[int] | None = None) -> list[int]:
        """Up to `limit` end positions (encoded, see SEQ_SHIFT) of the state's strings, from sequences in `alive`
        (None: all). Cost O(limit + stale or dead entries passed)."""
        found: list[int] = []
        stack = [state]
        while stack and len(found) < limit:
            s = stack.pop()
            for end in self._positions(s):
                if alive is None or end >> SEQ_SHIFT in alive:
                    found.append(end)
            stack.extend(c for c in self._kids.get(s, ()) if self.link[c] == s)
        return found[:limit]

    def _positions(self, state: int) -> Iterator[int]:
        if self.pos[state] != -1:
            yield self.pos[state]
            yield from self._more_pos.get(state, ())

    def stats(self) -> IndexStats:
        """Sizes (O(states): for reports and tests, not the decode loop)."""
        size = sys.getsizeof
        containers = (self.length, self.link, self.pos, self.next, self._more_pos, self._kids, self.seqs,
                      self._last)
        total = sum(size(c) for c in containers)
        total += sum(size(d) for d in self.next) + sum(size(v) for v in self._more_pos.values())
        total += sum(size(v) for v in self._kids.values()) + sum(size(v) for v in self.seqs.values())
        return IndexStats(states=self.num_states, transitions=self.transitions,
                          tokens=sum(len(v) for v in self.seqs.values()), bytes=total)


def split_end(end: int) -> tuple[int, int]:
    """(sequence id, offset after the occurrence) of an encoded end position."""
    return end >> SEQ_SHIFT, end & ((1 << SEQ_SHIFT) - 1)


class SuffixCache:
    """Recent requests' outputs in one generalised suffix automaton, LRU by request (0 requests: off)."""

    def __init__(self, max_requests: int, min_rebuild_tokens: int = 4096) -> None:
        if max_requests < 0:
            raise ValueError(f"--speculative-suffix-max-cached-requests must be >= 0, got {max_requests}")
        self.max_requests = max_requests
        self.min_rebuild_tokens = min_rebuild_tokens
        self.index = SuffixAutomaton()
        self.generation = 0  # bumped by every rebuild: readers' matching states are void
        self._lru: OrderedDict[int, None] = OrderedDict()  # live sequence ids, least recent first
        self._next_id = 0
        self._live_tokens = 0
        self._dead_tokens = 0
        self.evicted = 0
        self._next: SuffixAutomaton | None = None  # being built from the live outputs; replaces `index` when done
        self._copying: deque[int] = deque()  # live sequences still to copy into it, the first one from `_copied`
        self._copied = 0
        self.rebuild_tokens = 0  # tokens copied into rebuilt automata

    @property
    def alive(self) -> set[int]:
        return set(self._lru)

    def __len__(self) -> int:
        return len(self._lru)

    def add(self, tokens: list[int]) -> None:
        """A finished request's output (empty outputs are not kept)."""
        if self.max_requests == 0 or not tokens:
            return
        sid = self._next_id
        self._next_id += 1
        self.index.add_sequence(sid)
        for t in tokens:
            self.index.extend(sid, t)
        self._lru[sid] = None
        self._live_tokens += len(tokens)
        while len(self._lru) > self.max_requests:
            old, _ = self._lru.popitem(last=False)
            n = len(self.index.seqs[old])
            self._live_tokens -= n
            self._dead_tokens += n
            self.evicted += 1
        if self._next is not None:
            self._copying.append(sid)
        elif self._dead_tokens >= max(self._live_tokens, self.min_rebuild_tokens):
            self._next, self._copying, self._copied = SuffixAutomaton(), deque(self._lru), 0
        if self._next is not None:
            self._rebuild_some(REBUILD_RATE * len(tokens))

    def touch(self, seq_id: int) -> None:
        if seq_id in self._lru:
            self._lru.move_to_end(seq_id)

    def _rebuild_some(self, budget: int) -> None:
        """Copy up to `budget` live tokens into the new automaton; swap it in once it holds every live one."""
        nxt = self._next
        assert nxt is not None
        while self._copying and budget > 0:
            sid = self._copying[0]
            if sid not in self._lru:  # evicted while waiting (what of it was copied is dead in the new one)
                self._copying.popleft()
                self._copied = 0
                continue
            if self._copied == 0:
                nxt.add_sequence(sid)
            src = self.index.seqs[sid]
            end = min(len(src), self._copied + budget)
            for t in src[self._copied: end]:
                nxt.extend(sid, t)
            budget -= end - self._copied
            self.rebuild_tokens += end - self._copied
            self._copied = end
            if end == len(src):
                self._copying.popleft()
                self._copied = 0
        if not self._copying:
            self.index, self._next = nxt, None
            self._dead_tokens = sum(len(v) for k, v in nxt.seqs.items() if k not in self._lru)
            self.generation += 1

    def stats(self) -> dict[str, int]:
        s = self.index.stats()
        n = self._next.stats() if self._next is not None else IndexStats(0, 0, 0, 0)
        return {"requests": len(self._lru), "evicted": self.evicted, "live_tokens": self._live_tokens,
                "states": s.states + n.states, "transitions": s.transitions + n.transitions,
                "bytes": s.bytes + n.bytes}
