"""Verifying a draft tree against the target: pure functions that return which nodes were accepted.

Both rules are exact. `verify_greedy` emits what plain greedy decoding emits; `verify_sampled` emits
tokens distributed exactly as plain sampling from `target_probs` (lossless speculative sampling):
  * deterministic drafts (`draft_probs is None`: argmax, top-k, lookup): sample y ~ p at the current node,
    descend if y is a child's token, otherwise y is the bonus;
  * sampled drafts: recursive rejection sampling (Leviathan/Chen for a chain, SpecInfer for a tree whose
    siblings were drawn i.i.d. from one q): accept child x with min(1, p(x)/q(x)); after a rejection
    p <- norm(max(0, p - q)) and the next sibling is tried; when every child is rejected the bonus ~ p.

The caller applies the result: emitted tokens = tree.tokens[accepted] + [bonus]; the KV of
[root, *accepted] is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from specserve.layers.sampling import sample
from specserve.speculative.trees.tree import DraftTree, child_by_token


@dataclass(frozen=True)
class VerifyResult:
    accepted: list[int]  # accepted draft node indices in path order (root excluded); each a child of the previous
    bonus: int  # the token the target contributes after the last accepted node

    def __post_init__(self) -> None:
        if self.bonus < 0:
            raise ValueError(f"VerifyResult.bonus must be a token id >= 0, got {self.bonus}")
        if any(b <= a for a, b in pairwise([0, *self.accepted])):
            raise ValueError(f"VerifyResult.accepted must be increasing node indices >= 1, got {self.accepted}")

    @property
    def accept_length(self) -> int:
        """Tokens emitted by this step: accepted drafts + the bonus (plain decoding = 1)."""
        return len(self.accepted) + 1


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> VerifyResult:
    """target_logits [N+1, V]: row i = the target's next-token logits after node i."""
    _check_rows(tree, target_logits, "target_logits")
    picks = target_logits.argmax(dim=-1)  # [N+1]
    tokens, parents, picks_l = _to_host(tree.tokens, tree.parents, picks)
    return _descend(tokens, parents, picks_l)


def verify_greedy_picks(tree: DraftTree, picks: list[int]) -> VerifyResult:
    """Greedy verification from the target's pick after each node (picks[i]: after node i), for callers that
    pick on the host (constrained decoding corrects an argmax the grammar forbids)."""
    if len(picks) != tree.num_nodes + 1:
        raise ValueError(f"picks has {len(picks)} entries; the tree needs one per node ({tree.num_nodes + 1})")
    tokens, parents = _to_host(tree.tokens, tree.parents)
    return _descend(tokens, parents, picks)


def verify_sampled(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None) -> VerifyResult:
    """target_probs [N+1, V]: row i = the processed target distribution (see `layers.sampling.target_probs`)
    of the token after node i. `tree.draft_probs` selects the rule (see the module docstring)."""
    _check_rows(tree, target_probs, "target_probs")
    if tree.draft_probs is None:
        # One draw per node up front: each is used at most once, and only on the path the draws themselves
        # select, so the emitted tokens are distributed as sequential sampling; a single host sync.
        picks = sample(target_probs, generator)  # [N+1]
        tokens, parents, picks_l = _to_host(tree.tokens, tree.parents, picks)
        return _descend(tokens, parents, picks_l)
    if tree.draft_probs.shape != target_probs.shape:
        raise ValueError(f"tree.draft_probs {tuple(tree.draft_probs.shape)} must match target_probs "
                         f"{tuple(target_probs.shape)}: one draft distribution per node")
    return _verify_rejection(tree, target_probs, tree.draft_probs, generator)


def _verify_rejection(tree: DraftTree, target_probs: torch.Tensor, draft_probs: torch.Tensor,
                      generator: torch.Generator | None) -> VerifyResult:
    """Recursive rejection sampling on every internal node at once.

    The residual distribution a node reaches after rejecting its first r children does not depend on which
    child is accepted later, so all accept decisions (one uniform per node) and all bonus draws (from each
    node's residual after all its children) are computed up front; the host walk then takes, at each node,
    the first accepted child. Decisions off the walked path are simply never read.
    """
    tokens, parents = _to_host(tree.tokens, tree.parents)
    n = len(tokens)
    kids: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        kids[parents[i]].append(i)
    internal = [i for i in range(n) if kids[i]]
    # Per sibling rank r: (row of the parent in `internal`, child node) for parents with > r children.
    by_rank: list[tuple[list[int], list[int]]] = []
    for r in range(max((len(kids[i]) for i in internal), default=0)):
        rows = [k for k, node in enumerate(internal) if len(kids[node]) > r]
        by_rank.append((rows, [kids[internal[k]][r] for k in rows]))

    device = target_probs.device
    # All host-built indices travel in one copy, queued before any kernel of ours.
    flat = internal + [j for rows, child in by_rank for j in (*rows, *child)]
    packed = torch.tensor(flat, dtype=torch.long, device=device).split(
        [len(internal)] + [len(rows) for rows, _ in by_rank for _ in range(2)])
    internal_t = packed[0]  # [M]
    rank_idx = list(zip(packed[1::2], packed[2::2], strict=True))  # per rank: ([K] parent rows, [K] child nodes)
    tok = tree.tokens.to(device)  # [N+1]

    p = target_probs.float()  # [N+1, V]
    q = draft_probs.to(device=device, dtype=torch.float32)  # [N+1, V]
    u = torch.rand(n, generator=generator, device=device)  # [N+1] one uniform per child node
    accept = torch.zeros(n, dtype=torch.bool, device=device)  # [N+1]
    residual = p.index_select(0, internal_t)  # [M, V] p of each internal node after its rejected children
    for rows_t, child_t in rank_idx:
        x = tok.index_select(0, child_t)[:, None]  # [K, 1]
        cur = residual.index_select(0, rows_t)  # [K, V]
        q_c = q.index_select(0, child_t)  # [K, V]
        # u < p(x)/q(x) without dividing (q(x) > 0 for a token drawn from q; min(1, .) is implicit as u < 1)
        accept[child_t] = u.index_select(0, child_t) * q_c.gather(1, x).squeeze(1) < cur.gather(1, x).squeeze(1)
        residual[rows_t] = _residual(cur, q_c)
    # Bonus of each node: from its residual after all its children (leaves: from p itself).
    bonus = sample(p.index_copy(0, internal_t, residual), generator)  # [N+1]
    accept_l, bonus_l = _to_host(accept.long(), bonus)

    accepted: list[int] = []
    node = 0
    while (child := next((c for c in kids[node] if accept_l[c]), None)) is not None:
        accepted.append(child)
        node = child
    return VerifyResult(accepted, bonus_l[node])


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[K, V] rows of norm(max(0, p - q)). A row with no mass left (p <= q everywhere, i.e. p == q up to
    rounding, where a rejection has probability ~0) keeps p, so it still samples from the target."""
    r = (p - q).clamp_min(0.0)
    mass = r.sum(dim=-1, keepdim=True)  # [K, 1]
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


def _descend(tokens: list[int], parents: list[int], picks: list[int]) -> VerifyResult:
    """From the root, accept the child carrying the target's pick at each node (the first such sibling
    when several carry it); the pick at the first node without such a child is the bonus."""
    child_of = child_by_token(tokens, parents)
    accepted: list[int] = []
    node = 0
    while (child := child_of[node].get(picks[node])) is not None:
        accepted.append(child)
        node = child
    return VerifyResult(accepted, picks[node])


def _to_host(*rows: torch.Tensor) -> list[list[int]]:
    """Equal-length 1-D integer tensors -> Python lists, with one device -> host copy."""
    device = rows[0].device
    return torch.stack([r.to(device=device, dtype=torch.long) for r in rows]).tolist()


def _check_rows(tree: DraftTree, x: torch.Tensor, name: str) -> None:
    n = tree.num_nodes + 1
    if x.dim() != 2 or x.shape[0] != n:
        raise ValueError(f"{name} must be [N+1, V] with N+1 = {n} (one row per tree node), got {tuple(x.shape)}")
