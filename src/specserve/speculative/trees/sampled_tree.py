"""Sampled draft trees for block drafters: a fixed shape, each node's token drawn from its depth's law.

A block drafter (DFlash) gives one distribution q_d per depth d, the same for every node at that depth.
For a request that samples, a tree of a given shape is filled by drawing, for the children of each node in
order, from q_d without the tokens their earlier siblings drew (renormalised): siblings are distinct, and
each node records the exact law it was drawn from.

That is what recursive rejection sampling (`verify.verify_sampled`, SpecInfer) needs to be lossless: it
tries the children in order, accepting child x with min(1, p(x)/q_x(x)) against the target's residual p,
and after a rejection replaces p by norm(max(0, p - q_x)). The residual does not depend on which token
was drawn, so a later sibling's law may depend on the earlier siblings' draws (here: excluding them), as
long as no law depends on the target. Drawing without replacement wastes no node on a duplicate, which
i.i.d. siblings do whenever q is peaked.

`redraw_below` draws a node's subtree again from other laws, ones that may depend on the drawn tokens of the
node and its ancestors (DFlash shown the path so far: `dflash._reveal`); the same argument holds, as the
children of a node are still drawn from laws fixed before the target is consulted.
"""

from __future__ import annotations

import torch

from specserve.layers.sampling import sample
from specserve.speculative.trees.tree import DraftTree, descendants


def draw_tree(shape: DraftTree, q: torch.Tensor, generator: torch.Generator | None) -> DraftTree:
    """shape: a tree whose root token is kept and whose other tokens are ignored; q [D, V] float: row d-1 =
    the law of a depth-d token (rows normalised; depth <= D for every node).

    Returns the tree with drawn tokens and draft_probs [N+1, V] (row 0 zero; row i = the law node i was
    drawn from). Every node must have a law left to draw from: a node needs more tokens of positive
    probability at its depth than it has earlier siblings (a shape from `build_ddtree` over log q, which
    never picks a zero-probability token, satisfies this).
    """
    probs = torch.zeros(shape.tokens.shape[0], q.shape[-1], dtype=torch.float32, device=q.device)  # [N+1, V]
    blank = DraftTree(shape.tokens.to(q.device), shape.parents.to(q.device), shape.depths.to(q.device), probs)
    return redraw_below(blank, 0, q, generator)


def redraw_below(tree: DraftTree, node: int, q: torch.Tensor, generator: torch.Generator | None,
                 first_depth: int = 1) -> DraftTree:
    """Every descendant of `node` drawn again, as `draw_tree` draws, from q [D, V] (row k = the law of a token at
    depth first_depth + k; every descendant's depth within those rows); the other nodes and their laws kept.

    A law may depend on the drawn tokens of `node` and its ancestors (a drafter shown them): given the path to a
    node, its children are still drawn from laws the target does not enter, which is all the rejection rule
    asks. tree.draft_probs must be set (a drawn tree)."""
    if q.dim() != 2:
        raise ValueError(f"q must be [D, V] (one law per depth), got {tuple(q.shape)}")
    if tree.draft_probs is None:
        raise ValueError("redraw_below needs a drawn tree (draft_probs set)")
    parents: list[int] = tree.parents.tolist()
    kids: list[list[int]] = [[] for _ in parents]
    below = descendants(parents, node)
    by_rank: list[list[int]] = []  # by_rank[r]: descendants that are the r-th child of their parent
    for i in range(1, len(parents)):
        siblings = kids[parents[i]]
        if below[i]:
            if len(siblings) == len(by_rank):
                by_rank.append([])
            by_rank[len(siblings)].append(i)
        siblings.append(i)
    if not by_rank:
        return tree
    device = q.device
    depths = tree.depths.to(device)
    rows_at = depths - first_depth  # [N+1]: row of q each node's law is at
    reached = [int(depths[i]) for nodes in by_rank for i in nodes]
    if min(reached) < first_depth or max(reached) >= first_depth + q.shape[0]:
        raise ValueError(f"q has laws for depths {first_depth}..{first_depth + q.shape[0] - 1}, but the nodes "
                         f"below node {node} are at depths {min(reached)}..{max(reached)}")
    tokens = tree.tokens.clone().to(device)  # [N+1]
    probs = tree.draft_probs.clone().to(device)  # [N+1, V]
    for r, nodes in enumerate(by_rank):
        idx = torch.tensor(nodes, dtype=torch.long, device=device)  # [K]
        rows = q.float().index_select(0, rows_at[idx])  # [K, V]
        if r:
            earlier = torch.tensor([kids[parents[i]][:r] for i in nodes], dtype=torch.long, device=device)  # [K, r]
            rows = rows.scatter(1, tokens[earlier], 0.0)
            mass = rows.sum(dim=-1, keepdim=True)  # [K, 1]
            if bool((mass <= 0).any()):
                raise ValueError("a node has more earlier siblings than its depth's law has tokens: "
                                 "build the shape over log q so that no zero-probability token is a node")
            rows = rows / mass
        probs[idx] = rows
        tokens[idx] = sample(rows, generator)
    return DraftTree(tokens, tree.parents.to(device), depths, probs)
