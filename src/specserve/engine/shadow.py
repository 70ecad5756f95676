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

from specserve.speculative.drafter import Drafter
from specserve.speculative.trees.tree import DraftTree


def walk(tree: DraftTree, following: list[int]) -> tuple[list[int], bool]:
    """Node indices (root excluded) the emitted `following` tokens accept, and whether that is decided: the walk
    stops at the first token that is not a child of the current node, or at a node without children; until one
    of those, the path so far (the round's accepted path starts with it) and False."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    children: dict[int, dict[int, int]] = {}
    for node in range(1, len(tokens)):
        children.setdefault(parents[node], {})[tokens[node]] = node
    path: list[int] = []
    node = 0
    for t in following:
        nxt = children.get(node, {}).get(t)
        if nxt is None:
            return path, True
        path.append(nxt)
        node = nxt
    return path, node not in children


class ShadowRounds:
    """Unverified draft trees waiting for the tokens that decide them, one per request at most."""

    def __init__(self) -> None:
        # request id -> (tree, tokens before its root's next, the caller's tag when it opened)
        self._open: dict[str, tuple[DraftTree, int, int]] = {}
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

    def open(self, request_id: str, tree: DraftTree, num_tokens: int, tag: int = 0) -> None:
        """`tree` is rooted at the request's last token; `num_tokens` its tokens so far (prompt included); `tag`
        is handed back with its walks (the engine's: the request's acceptance class when the round began)."""
        self._open[request_id] = (tree, num_tokens, tag)

    def close(self, request_id: str, token_ids: list[int]) -> tuple[list[int], bool, int]:
        """`walk` of the request's tree along `token_ids` (its tokens now), and its tag; a decided tree is
        closed."""
        tree, start, tag = self._open[request_id]
        path, decided = walk(tree, token_ids[start:])
        if decided:
            del self._open[request_id]
            self.decided += 1
        return path, decided, tag

    def drop_except(self, live: set[str]) -> None:
        """Forget trees of requests that finished or were aborted."""
        for rid in [r for r in self._open if r not in live]:
            del self._open[rid]

    def after_step(self, live: Sequence[tuple[str, list[int], Drafter | None, int]], running: set[str],
                   plain: bool, width: int) -> list[tuple[str, list[int], bool, int]]:
        """After an engine decode step: `live` = (request id, its tokens now, its drafter, a tag for a tree it
        opens) of the step's requests still running, `running` every running request's id. Returns (request id,
        `walk`, the tree's tag) of every open tree of
        `live` (decided ones closed: their paths are final; the others' are where their round has got to); after
        a plain step, one more request (in turn) drafts a tree of `width` nodes."""
        decided = []
        for rid, token_ids, _, _ in live:
            if rid in self:
                decided.append((rid, *self.close(rid, token_ids)))
        self.drop_except(running)
        turn = self.pick([rid for rid, _, _, _ in live]) if plain else None
        for rid, token_ids, drafter, tag in live:
            if rid == turn and drafter is not None:
                self.open(rid, drafter.propose(token_ids[-1], width), len(token_ids), tag)
        return decided
