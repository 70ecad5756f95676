"""DDTree: the best draft tree of a given size from one DFlash block's per-position marginals.

A DFlash pass gives q_d, the drafter's distribution of the token at depth d (d = 1..D) after the root.
Treating the continuation as factorised, P(y_1..y_d) = prod_i q_i(y_i), the expected number of accepted
tokens of a tree is the sum over its nodes of P(path to the node). The tree of `budget` nodes maximising it
is therefore the `budget` most probable prefixes, which is prefix-closed on its own (a prefix is at least
as probable as any extension, since log q <= 0).

They are found best-first: a node is a rank tuple (r_1..r_d) (r_i = rank of its token in q_i), scored
sum_i log q_i(rank r_i). Starting from (0,), pop the best, emit it, push its next sibling (r_d + 1) and its
first child (r_1..r_d, 0). Both pushes score no higher than the popped node and every tuple has exactly one
such predecessor, so pops come out in non-increasing score order. O(budget log budget) after one top-k.
"""

from __future__ import annotations

import heapq
import math

import torch

from specserve.speculative.trees.tree import DraftTree, descendants

_LOG_PROB_SLACK = 1e-4  # log_softmax can round a little above 0


def build_ddtree(root: int, log_probs: torch.Tensor, budget: int) -> DraftTree:
    """log_probs [D, V]: row d-1 = log q_d, the drafter's log-distribution of the depth-d token.

    Returns up to `budget` draft nodes (root not counted; fewer only when fewer than `budget` prefixes of
    positive probability exist: a token with log q = -inf is never a node), in pop order so parents precede
    children, with depth <= D and draft_probs None (deterministic drafts: verify with `verify_greedy` or
    sample-and-descend `verify_sampled`; or fill the shape by `sampled_tree.draw_tree`). Ties pop in push
    order.
    """
    if log_probs.dim() != 2 or log_probs.shape[0] < 1:
        raise ValueError(f"log_probs must be [D, V] with D >= 1 (block positions after the root), "
                         f"got {tuple(log_probs.shape)}")
    if budget < 0:
        raise ValueError(f"budget (draft nodes per step, root excluded) must be >= 0, got {budget}")
    device = log_probs.device
    max_depth = min(int(log_probs.shape[0]), budget)  # a path of depth d needs d nodes
    k = min(budget, int(log_probs.shape[1]))  # no depth uses more than `budget` distinct ranks
    if budget == 0:
        return DraftTree.chain(root, [], device=device)
    top_vals, top_ids = torch.topk(log_probs[:max_depth].float(), k, dim=-1)  # [D', k] each, sorted descending
    vals: list[list[float]] = top_vals.tolist()
    ids: list[list[int]] = top_ids.tolist()
    highest = max(row[0] for row in vals)
    if highest > _LOG_PROB_SLACK:
        raise ValueError(f"log_probs must be log-probabilities (log_softmax, every value <= 0), got max {highest:.4g}")

    tokens, parents, depths = [root], [-1], [0]
    # Entry: (-score, push order, depth index d (0-based), rank r, parent node, parent score).
    heap: list[tuple[float, int, int, int, int, float]] = [(-vals[0][0], 0, 0, 0, 0, 0.0)]
    pushes = 1
    while heap and len(tokens) <= budget:
        neg_score, _, d, r, parent, parent_score = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(ids[d][r])
        parents.append(parent)
        depths.append(d + 1)
        if r + 1 < k and vals[d][r + 1] > -math.inf:  # next sibling: the next-ranked token (never one of q = 0)
            heapq.heappush(heap, (-(parent_score + vals[d][r + 1]), pushes, d, r + 1, parent, parent_score))
            pushes += 1
        if d + 1 < max_depth:  # first child: best token at the next depth
            heapq.heappush(heap, (neg_score - vals[d + 1][0], pushes, d + 1, 0, node, -neg_score))
            pushes += 1
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        parents=torch.tensor(parents, dtype=torch.long, device=device),
        depths=torch.tensor(depths, dtype=torch.long, device=device),
    )


def rebuild_below(tree: DraftTree, node: int, log_probs: torch.Tensor) -> tuple[DraftTree, int]:
    """The subtree below `node` replaced by the best DDTree of as many nodes over log_probs [D, V] (row k = the
    log-distribution of a token k+1 below `node`), rooted at node's token. Nodes outside the subtree keep their
    order; the new subtree follows them, parents still before children. Deterministic trees only (draft_probs
    None). -> (the tree, node's index in it)."""
    if tree.draft_probs is not None:
        raise ValueError("rebuild_below builds deterministic trees; a drawn tree is drawn again by redraw_below")
    below = descendants(tree.parents.tolist(), node)
    keep = [i for i, b in enumerate(below) if not b]
    index = {old: k for k, old in enumerate(keep)}
    sub = build_ddtree(int(tree.tokens[node]), log_probs, sum(below))
    parents = tree.parents.tolist()
    at = len(keep) - 1  # sub's node j > 0 becomes at + j
    device = tree.tokens.device
    tokens = torch.cat((tree.tokens[keep], sub.tokens[1:].to(device)))
    new_parents = [index[parents[i]] if i else -1 for i in keep] + [
        index[node] if p == 0 else at + p for p in sub.parents[1:].tolist()]
    depths = torch.cat((tree.depths[keep], sub.depths[1:].to(device) + int(tree.depths[node])))
    return DraftTree(tokens, torch.tensor(new_parents, dtype=torch.long, device=device), depths), index[node]
