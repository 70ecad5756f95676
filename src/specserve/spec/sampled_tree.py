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
"""

from __future__ import annotations

import torch

from specserve.layers.sampling import sample
from specserve.spec.tree import DraftTree


def draw_tree(shape: DraftTree, q: torch.Tensor, generator: torch.Generator | None) -> DraftTree:
    """shape: a tree whose root token is kept and whose other tokens are ignored; q [D, V] float: row d-1 =
    the law of a depth-d token (rows normalised; depth <= D for every node).

    Returns the tree with drawn tokens and draft_probs [N+1, V] (row 0 zero; row i = the law node i was
    drawn from). Every node must have a law left to draw from: a node needs more tokens of positive
    probability at its depth than it has earlier siblings (a shape from `build_ddtree` over log q, which
    never picks a zero-probability token, satisfies this).
    """
    if q.dim() != 2:
        raise ValueError(f"q must be [D, V] (one law per depth), got {tuple(q.shape)}")
    n = shape.num_nodes
    parents: list[int] = shape.parents.tolist()
    depths = shape.depths
    if n and int(depths.max()) > q.shape[0]:
        raise ValueError(f"the shape is {int(depths.max())} deep but q has laws for {q.shape[0]} depths")
    device = q.device
    kids: list[list[int]] = [[] for _ in parents]
    by_rank: list[list[int]] = []  # by_rank[r]: nodes that are the r-th child of their parent
    for i in range(1, n + 1):
        siblings = kids[parents[i]]
        if len(siblings) == len(by_rank):
            by_rank.append([])
        by_rank[len(siblings)].append(i)
        siblings.append(i)

    tokens = shape.tokens.clone().to(device)  # [N+1]
    probs = torch.zeros(n + 1, q.shape[1], dtype=torch.float32, device=device)  # [N+1, V]
    if n:
        probs[1:] = q.float().index_select(0, depths[1:].to(device) - 1)
    for r, nodes in enumerate(by_rank):
        idx = torch.tensor(nodes, dtype=torch.long, device=device)  # [K]
        rows = probs.index_select(0, idx)  # [K, V]
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
    return DraftTree(tokens, shape.parents.to(device), depths.to(device), probs)
