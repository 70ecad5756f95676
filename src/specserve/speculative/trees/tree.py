"""The plain data every drafter produces and every verifier consumes: a draft tree.

Node 0 is the root: the last emitted token, whose KV the verify forward computes.
Nodes 1..N are draft tokens; a chain is a tree where parents[i] = i - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [N+1] long; tokens[0] is the root token
    parents: torch.Tensor  # [N+1] long; parents[0] = -1, parents[i] < i
    depths: torch.Tensor  # [N+1] long; depths[0] = 0, depths[i] = depths[parents[i]] + 1
    # Distribution each node's token was *sampled* from ([N+1, V], row 0 unused), or None when the
    # drafts are deterministic (argmax / top-k / lookup). Sampled trees verify with rejection rules.
    draft_probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        assert self.parents.shape == (n,) and self.depths.shape == (n,), "tree arrays must align"
        assert int(self.parents[0]) == -1 and int(self.depths[0]) == 0, "node 0 must be the root"

    @property
    def num_nodes(self) -> int:
        """Draft nodes, root excluded."""
        return int(self.tokens.shape[0]) - 1

    @property
    def is_chain(self) -> bool:
        n = self.tokens.shape[0]
        return bool((self.parents == torch.arange(-1, n - 1, device=self.parents.device)).all())

    @classmethod
    def chain(cls, root: int, drafts: list[int] | torch.Tensor, draft_probs: torch.Tensor | None = None,
              device: torch.device | None = None) -> DraftTree:
        """root, then drafts [N] in a line; drafts given as a tensor stay on its device (no host sync)."""
        if isinstance(drafts, torch.Tensor):
            device = drafts.device
            tokens = torch.cat((torch.tensor([root], dtype=torch.long, device=device), drafts.long()))
        else:
            tokens = torch.tensor([root, *drafts], dtype=torch.long, device=device)
        n = int(tokens.shape[0])
        return cls(
            tokens=tokens,
            parents=torch.arange(-1, n - 1, dtype=torch.long, device=device),
            depths=torch.arange(n, dtype=torch.long, device=device),
            draft_probs=draft_probs,
        )

    def ancestor_mask(self) -> torch.Tensor:
        """[N+1, N+1] bool: mask[i, j] = node j is node i or one of its ancestors."""
        n = self.tokens.shape[0]
        rows: list[list[bool]] = []
        for i, p in enumerate(self.parents.tolist()):  # parents precede children
            row = list(rows[p]) if p >= 0 else [False] * n
            row[i] = True
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool, device=self.tokens.device)

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(self.tokens.shape[0])]
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                kids[p].append(i)
        return kids


def child_by_token(tokens: list[int], parents: list[int]) -> list[dict[int, int]]:
    """[N+1] maps token -> the first child of node i carrying it (greedy verification follows these)."""
    child_of: list[dict[int, int]] = [{} for _ in tokens]
    for i in range(1, len(tokens)):
        child_of[parents[i]].setdefault(tokens[i], i)
    return child_of


def descendants(parents: list[int], node: int) -> list[bool]:
    """parents (parents[i] < i) -> [N+1] bool: node i lies below `node` (node itself excluded)."""
    below = [False] * len(parents)
    for i in range(1, len(parents)):
        below[i] = parents[i] == node or below[parents[i]]
    return below
