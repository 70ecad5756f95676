"""The acceptance model of adaptive speculation: per request class and draft node j, the decayed share of rounds
that verified node j and kept it on the accepted path.

Nodes are indexed parents first, so a tree's first w nodes are a tree, and cutting a round to w nodes keeps
exactly the accepted path's nodes of index <= w: one set of counts prices every cut, of chains and trees alike.
Acceptance runs in streaks, so rounds are kept apart by what the request's previous round accepted
(`streak_class`; measurements in docs/adaptive.md)."""

from __future__ import annotations

from collections.abc import Sequence

NUM_CLASSES = 4  # of `streak_class`
ALL_NEW = (1.0,) + (0.0,) * (NUM_CLASSES - 1)  # a batch's class shares when no classes are given


def streak_class(last_accepted: int | None) -> int:
    """A request's class for the acceptance model, from the drafts its last decided round accepted: 0 no round
    yet (None), 1 none, 2 one or two, 3 three or more."""
    if last_accepted is None:
        return 0
    return 1 if last_accepted == 0 else 2 if last_accepted < 3 else 3


class AcceptanceModel:
    """P(node j on the accepted path | the round verified node j, the request's class), as decayed counts that
    start at `prior_rounds` pseudo-rounds accepting every node (a fresh engine speculates until real rounds say
    otherwise); and the current batch's mix of classes, which `expected` averages over."""

    def __init__(self, max_width: int, decay: float, prior_rounds: float) -> None:
        self.max_width = max_width
        self.decay = decay
        # [class][j]: decayed count of rounds whose accepted path holds node j+1 / that verified node j+1
        self._on_path = [[prior_rounds] * max_width for _ in range(NUM_CLASSES)]
        self._offered = [[prior_rounds] * max_width for _ in range(NUM_CLASSES)]
        self._mix: Sequence[float] = ALL_NEW  # share of each class in the current batch

    def record(self, path: Sequence[int], width: int, cls: int) -> None:
        """A request of class `cls` verified its first `width` draft nodes and accepted the nodes `path` (their
        tree indices, root excluded: a chain's are 1..k)."""
        on = set(path)
        offered, on_path = self._offered[cls], self._on_path[cls]
        for j in range(min(width, self.max_width)):
            offered[j] = offered[j] * self.decay + 1.0
            on_path[j] = on_path[j] * self.decay + (1.0 if j + 1 in on else 0.0)

    def set_batch(self, classes: Sequence[int]) -> None:
        """The classes of the requests of the next step (empty: all new)."""
        counts = [0] * NUM_CLASSES
        for c in classes:
            counts[c] += 1
        total = sum(counts)
        self._mix = tuple(n / total for n in counts) if total else ALL_NEW

    def rounds(self, cls: int) -> float:
        """Decayed count of rounds recorded for requests of class `cls` (the prior's pseudo-rounds included)."""
        return self._offered[cls][0]

    def expected(self, cls: int | None = None) -> list[float]:
        """[w] for w in 0..max_width: 1 + the expected accepted drafts of a round cut to its first w nodes, for
        a request of class `cls`, or (None) averaged over the current batch (running sums of P(node j))."""
        mix = self._mix if cls is None else [1.0 if c == cls else 0.0 for c in range(NUM_CLASSES)]
        p = [0.0] * self.max_width
        for share, on_path, offered in zip(mix, self._on_path, self._offered, strict=True):
            if share:
                for j, (a, n) in enumerate(zip(on_path, offered, strict=True)):
                    p[j] += share * (a / n if n > 0 else 0.0)
        out = [1.0]
        for pj in p:
            out.append(out[-1] + pj)
        return out
