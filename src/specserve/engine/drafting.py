"""One decode step's draft trees: each running request's drafter proposes at most its scheduled width.

Drafters of one class propose together (`Drafter.propose_many`), so those that can share their forwards
across requests do; in batch-invariant mode each proposes alone, because a request's drafts (and so its
sampled tokens) must not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from specserve.engine.scheduler import DecodeItem
from specserve.speculative.drafter import Drafter
from specserve.speculative.trees.tree import DraftTree


def draft_trees(items: Sequence[DecodeItem], drafters: Sequence[Drafter | None],
                batch_invariant: bool) -> list[DraftTree | None]:
    """Each decode's tree, rooted at its last token; None where it drafts nothing this step and decodes plainly
    (its drafter, if any, is told to `skip`)."""
    trees: list[DraftTree | None] = [None] * len(items)
    groups: dict[type[Drafter] | None, list[int]] = {}  # None: each drafter on its own
    for i, (item, drafter) in enumerate(zip(items, drafters, strict=True)):
        if drafter is None or item.num_draft_tokens == 0:
            if drafter is not None:
                drafter.skip(item.seq.token_ids[-1])
        else:
            groups.setdefault(None if batch_invariant else type(drafter), []).append(i)
    for cls, idx in groups.items():
        group = [d for d in (drafters[i] for i in idx) if d is not None]
        proposed = (cls or Drafter).propose_many(
            group, [items[i].seq.token_ids[-1] for i in idx], [items[i].num_draft_tokens for i in idx])
        for i, tree in zip(idx, proposed, strict=True):
            trees[i] = truncate(tree, items[i].num_draft_tokens)
    return trees


def truncate(tree: DraftTree, max_nodes: int) -> DraftTree:
    """The first `max_nodes` draft nodes (parents precede children, so it is still a tree)."""
    if tree.num_nodes <= max_nodes:
        return tree
    n = max_nodes + 1
    probs = tree.draft_probs[:n] if tree.draft_probs is not None else None
    return DraftTree(tree.tokens[:n], tree.parents[:n], tree.depths[:n], probs)
