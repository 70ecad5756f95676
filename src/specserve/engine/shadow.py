"""Shadow rounds: acceptance measured while decoding plainly, for drafters whose drafting is nearly free.

Adaptive speculation needs each draft node's acceptance to price a width, but while plain decoding wins it
verifies nothing, and a try at high concurrency costs several plain steps. An n-gram lookup costs next to
nothing, so during plain steps one request per step drafts a tree anyway (not verified); once the target has
emitted the tokens that follow its root, the walk down the tree along them gives exactly the path
verification would have accepted: at temperature 0 the target's argmax is the token it emitted; when sampling,
verifying deterministic children samples y ~ p at each node and descends while y is a child, which is how the
emitted tokens were drawn. So the policy keeps measuring acceptance across each request's whole life, not only
in the first steps of a try (where a lookup drafter, with no history yet, finds little).
"""

from __future__ import annotations

from collections.abc import Sequence

from specserve.spec.drafter import Drafter
from specserve.spec.tree import DraftTree


def walk(tree: DraftTree, following: list[int]) -> list[int] | None:
    """Node indices (root excluded) the emitted `following` tokens accept, or None while undecided: the walk
    stops at the first token that is not a child of the current node, or at a node without children."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    children: dict[int, dict[int, int]] = {}
    for node in range(1, len(tokens)):
        children.setdefault(parents[node], {})[tokens[node]] = node
    path: list[int] = []
    node = 0
    for t in following:
        nxt = children.get(node, {}).get(t)
        if nxt is None:
            return path
        path.append(nxt)
        node = nxt
    return path if node not in children else None


class ShadowRounds:
    """Unverified draft trees waiting for the tokens that decide them, one per request at most."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[DraftTree, int]] = {}  # request id -> (tree, tokens before its root's next)
        self._turn = 0
        self.decided = 0  # trees whose accepted path is known (counted for tests and metrics)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._open

    def pick(self, request_ids: list[str]) -> str | None:
        """The next request (round robin) without an open tree, or None."""
        free = [r for r in request_ids if r not in self._open]
        if not free:
            return None
        self._turn += 1
        return free[self._turn % len(free)]

    def open(self, request_id: str, tree: DraftTree, num_tokens: int) -> None:
        """`tree` is rooted at the request's last token; `num_tokens` its tokens so far (prompt included)."""
        self._open[request_id] = (tree, num_tokens)

    def close(self, request_id: str, token_ids: list[int]) -> list[int] | None:
        """The accepted path once `token_ids` (the request's tokens now) decide it (the tree is then closed);
        None while undecided."""
        tree, start = self._open[request_id]
        path = walk(tree, token_ids[start:])
        if path is not None:
            del self._open[request_id]
            self.decided += 1
        return path

    def drop_except(self, live: set[str]) -> None:
        """Forget trees of requests that finished or were aborted."""
        for rid in [r for r in self._open if r not in live]:
            del self._open[rid]

    def after_step(self, live: Sequence[tuple[str, list[int], Drafter | None]], running: set[str], plain: bool,
                   width: int) -> list[list[int]]:
        """After an engine decode step: `live` = (request id, its tokens now, its drafter) of the step's requests
        still running, `running` every running request's id. Returns the accepted paths of the trees this
        step's tokens decided; after a plain step, one more request (in turn) drafts a tree of `width` nodes."""
        decided = []
        for rid, token_ids, _ in live:
            if rid in self:
                path = self.close(rid, token_ids)
                if path is not None:
                    decided.append(path)
        self.drop_except(running)
        turn = self.pick([rid for rid, _, _ in live]) if plain else None
        for rid, token_ids, drafter in live:
            if rid == turn and drafter is not None:
                self.open(rid, drafter.propose(token_ids[-1], width), len(token_ids))
        return decided
