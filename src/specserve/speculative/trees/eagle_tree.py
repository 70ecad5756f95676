"""EAGLE-2/3 dynamic draft tree: beam-like expansion with the drafter, then a global top-`num_nodes` cut.

Depth 1 holds the `topk` best tokens after the root. Each further step feeds the current frontier (`topk`
nodes) to the drafter, every frontier node proposes its `topk` best children (topk² candidates, scored by
cumulative log-prob), and the best `topk` of them become the next frontier. At the end all
topk + (num_steps - 1)·topk² candidates compete and the best `num_nodes` by cumulative score are kept.

Fed-node numbering (what `step_fn` receives as `parents`): the drafter has already consumed the root,
which is fed node 0. Each call feeds the F frontier nodes it is given; they become fed nodes
n, n+1, ..., n+F-1 in the order given, where n is the number of nodes fed before the call. So call c
(1-based) feeds nodes 1 + (c-1)·topk ... c·topk, and `parents[j]` is the fed-node index of the j-th
token's parent (0 for every token of the first call). A drafter keeping one KV entry per fed node can
build each token's ancestor mask from these indices alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specserve.speculative.trees.tree import DraftTree

# step_fn(tokens [F], parents [F] fed-node indices) -> log-probs [F, V] of each fed token's next token.
StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def expand_eagle_tree(root: int, first_log_probs: torch.Tensor, step_fn: StepFn, num_steps: int, topk: int,
                      num_nodes: int) -> DraftTree:
    """first_log_probs [V]: the drafter's log-distribution of the token after the root.

    Calls `step_fn` num_steps - 1 times. Keeps min(num_nodes, topk + (num_steps-1)·topk²) nodes, prefix-closed
    (a node never outranks its parent: scores are capped by the parent's and ties favour the shallower node),
    indexed depth by depth so parents precede children. draft_probs is None (deterministic drafts).
    topk == 1 gives the drafter's greedy chain of length min(num_steps, num_nodes).
    """
    if first_log_probs.dim() != 1:
        raise ValueError(f"first_log_probs must be [V], got {tuple(first_log_probs.shape)}")
    vocab = int(first_log_probs.shape[0])
    if num_steps < 1:
        raise ValueError(f"num_steps (--speculative-num-steps, tree depth) must be >= 1, got {num_steps}")
    if not 1 <= topk <= vocab:
        raise ValueError(f"topk (--speculative-eagle-topk) must be in [1, V={vocab}], got {topk}")
    if num_nodes < 1:
        raise ValueError(f"num_nodes (--speculative-num-draft-tokens minus the root) must be >= 1, got {num_nodes}")
    device = first_log_probs.device

    front_score, front_tok = torch.topk(first_log_probs.float(), topk)  # [K] each
    front_id = torch.arange(topk, device=device)  # [K] candidate index of each frontier node
    fed_parent = torch.zeros(topk, dtype=torch.long, device=device)  # [K] all children of the root (fed node 0)
    scores, toks, cand_parents = [front_score], [front_tok], [torch.full((topk,), -1, device=device)]
    sizes = [topk]  # candidates per depth, in creation order
    num_fed = 1  # the root
    for _ in range(num_steps - 1):
        log_probs = step_fn(front_tok, fed_parent)  # [K, V]
        if log_probs.shape != (topk, vocab):
            raise ValueError(f"step_fn must return log-probs [{topk}, {vocab}] (one row per fed token), "
                             f"got {tuple(log_probs.shape)}")
        child_lp, child_tok = torch.topk(log_probs.float(), topk, dim=-1)  # [K, K] each
        cand_score = (front_score[:, None] + child_lp).flatten()  # [K*K], row-major: frontier j's children at j*K
        cand_tok = child_tok.flatten()  # [K*K]
        scores.append(cand_score)
        toks.append(cand_tok)
        cand_parents.append(front_id.repeat_interleave(topk))
        front_score, sel = torch.topk(cand_score, topk)  # [K] each
        front_tok = cand_tok[sel]
        front_id = sum(sizes) + sel
        fed_parent = num_fed + torch.div(sel, topk, rounding_mode="floor")  # parents were just fed
        num_fed += topk
        sizes.append(topk * topk)

    score = torch.cat(scores)  # [C]
    token = torch.cat(toks)  # [C]
    parent = torch.cat(cand_parents)  # [C], -1 = the root
    depth = torch.cat([torch.full((n,), d + 1, dtype=torch.long, device=device) for d, n in enumerate(sizes)])
    # Cap each score by its parent's (a no-op for true log-probs) so that sorting never ranks a child first.
    capped = score.clone()
    start = sizes[0]
    for n in sizes[1:]:
        block = slice(start, start + n)
        capped[block] = torch.minimum(capped[block], capped[parent[block]])
        start += n
    keep = min(num_nodes, int(score.shape[0]))
    # Creation order is depth-major, so a stable sort breaks score ties towards the shallower node.
    best = torch.sort(capped, descending=True, stable=True).indices[:keep]
    kept = torch.sort(best).values  # [keep] back to creation order: parents first
    new_index = torch.full_like(parent, -1)
    new_index[kept] = torch.arange(1, keep + 1, device=device)
    kept_parent = parent[kept]
    tree_parent = torch.where(kept_parent < 0, 0, new_index[kept_parent.clamp_min(0)])
    root_t = torch.tensor([root], dtype=torch.long, device=device)
    return DraftTree(
        tokens=torch.cat([root_t, token[kept]]),
        parents=torch.cat([root_t.new_full((1,), -1), tree_parent]),
        depths=torch.cat([root_t.new_zeros(1), depth[kept]]),
    )
