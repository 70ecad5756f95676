"""Shadow rounds: the path an unverified draft tree would have had accepted, read off the tokens that followed."""

from __future__ import annotations

import torch

from specserve.engine.shadow import ShadowRounds, walk
from specserve.speculative.trees.tree import DraftTree


def tree(tokens: list[int], parents: list[int]) -> DraftTree:
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths))


def test_walk_a_chain() -> None:
    chain = DraftTree.chain(5, [1, 2, 3])
    assert walk(chain, [1, 2, 9]) == ([1, 2], True)  # the third token differs: two drafts accepted
    assert walk(chain, [7]) == ([], True)  # the first differs
    assert walk(chain, [1, 2, 3]) == ([1, 2, 3], True)  # all accepted: the last node has no children
    assert walk(chain, [1, 2, 3, 4, 5]) == ([1, 2, 3], True)
    assert walk(chain, [1, 2]) == ([1, 2], False)  # node 2 has a child: the next token decides
    assert walk(chain, []) == ([], False)
    assert walk(DraftTree.chain(5, []), []) == ([], True)  # nothing drafted: decided at once


def test_walk_a_tree_takes_the_branch_the_tokens_take() -> None:
    # root 0 -> (1: token 10, 2: token 20); node 3 (token 30) under node 2; node 4 (token 40) under node 1
    t = tree([0, 10, 20, 30, 40], [-1, 0, 0, 2, 1])
    assert walk(t, [20, 30]) == ([2, 3], True)
    assert walk(t, [10, 40, 1]) == ([1, 4], True)
    assert walk(t, [10, 30]) == ([1], True)  # 30 is not a child of node 1
    assert walk(t, [20]) == ([2], False)


def test_shadow_rounds_take_requests_in_turn_and_forget_finished_ones() -> None:
    rounds = ShadowRounds()
    first = rounds.pick(["a", "b"])
    assert first in ("a", "b")
    rounds.open(first, DraftTree.chain(1, [2, 3]), num_tokens=4, tag=3)  # root = token 4 of the request
    assert first in rounds
    assert rounds.pick(["a", "b"]) == ({"a", "b"} - {first}).pop()  # one open tree per request
    assert rounds.close(first, [9, 9, 9, 1, 2]) == ([1], False, 3) and rounds.decided == 0  # under way
    assert rounds.close(first, [9, 9, 9, 1, 2, 5]) == ([1], True, 3) and rounds.decided == 1
    assert first not in rounds
    rounds.open("a", DraftTree.chain(1, [2]), num_tokens=1)
    rounds.open("b", DraftTree.chain(1, [2]), num_tokens=1)
    rounds.drop_except({"b"})
    assert "a" not in rounds and "b" in rounds
    assert rounds.pick(["b"]) is None
