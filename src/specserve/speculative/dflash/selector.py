"""DFlash 2's candidate selector: a path through the block's per-slot top-k, scored with a low-rank pairwise term.

Per draft slot s the block gives unary scores (the drafter's logits through the target's LM head) and keeps its
top-k tokens c[s, :]. A candidate's score given the token before it (the anchor for slot 0):
    score(s, k | prev) = unary[s, k] + < pred[prev] * proj(h_s), succ[c[s, k]] >          (rank r)
with `pred`/`succ` two [V, r] codebooks and `proj` an [H -> r] projection of the slot's block output. As the
predecessor of slot s+1 is one of slot s's candidates, every score of a block is in two small tensors
(`transitions`): the root's row over slot 0, and a [S-1, K, K] table, candidate j of slot s -> candidate k of
slot s+1. A greedy path takes the best candidate at each slot (the reference's walk); a sampled one draws it
from softmax(scores / T), whose rows are the laws q verification needs. Trees: `selector_tree` is the DDTree of
this chain of laws (the best `budget` prefixes, the law of each node's children now depending on its token), and
`draw_selector_tree` fills a shape by drawing each node's children from the law its drawn token gives.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch
from torch import nn

from specserve.speculative.trees.tree import DraftTree


class CandidateSelector(nn.Module):
    """z-lab's layout: `predecessor_codebook` / `successor_codebook` [V, r], `hidden_projection.weight` [r, H]."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def transitions(self, hidden: torch.Tensor, unary: torch.Tensor, root: torch.Tensor) -> Transitions:
        """hidden [B, S, H] block outputs of the draft slots, unary [B, S, V] their scores (logits or
        log-probabilities: a constant per slot changes nothing), root [B] the anchors -> the block's scores."""
        values, cands = torch.topk(unary.float(), self.top_k, dim=-1)  # [B, S, K], sorted
        proj = self.hidden_projection(hidden).float()  # [B, S, r]
        succ = self.successor_codebook(cands).float() * proj[:, :, None]  # [B, S, K, r]
        first = values[:, 0] + torch.einsum("br,bkr->bk", self.predecessor_codebook(root).float(), succ[:, 0])
        pred = self.predecessor_codebook(cands[:, :-1]).float()  # [B, S-1, K, r]
        step = values[:, 1:, None, :] + torch.einsum("bsjr,bskr->bsjk", pred, succ[:, 1:])  # [B, S-1, K, K]
        return Transitions(cands, first, step)

    def pair_scores(self, hidden: torch.Tensor, prev: torch.Tensor, cands: torch.Tensor) -> torch.Tensor:
        """Training's pairwise term: hidden [..., H], prev [...] the token before, cands [..., K] -> [..., K]."""
        proj = self.hidden_projection(hidden) * self.predecessor_codebook(prev)  # [..., r]
        return torch.einsum("...r,...kr->...k", proj, self.successor_codebook(cands))


@dataclass(frozen=True)
class Transitions:
    """One block's selector scores. cands [B, S, K] the slots' candidates; first [B, K] slot 0's scores after the
    root; step [B, S-1, K, K]: step[:, s, j, k] = score of cands[:, s+1, k] after cands[:, s, j]."""

    cands: torch.Tensor
    first: torch.Tensor
    step: torch.Tensor

    def greedy_path(self, row: int, slots: int) -> list[int]:
        """The reference's greedy walk over the first `slots` slots of block `row` -> candidate indices."""
        j = int(self.first[row].argmax())
        best: list[list[int]] = self.step[row, : slots - 1].argmax(dim=-1).tolist()  # [S-1][K]: the best next
        path = [j]
        for s in range(slots - 1):
            j = best[s][j]
            path.append(j)
        return path

    def laws(self, row: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Block `row`'s softmax(scores / T): ([K] after the root, [S-1, K, K] after each candidate)."""
        return (torch.softmax(self.first[row] / temperature, dim=-1),
                torch.softmax(self.step[row] / temperature, dim=-1))

    def tokens(self, row: int, path: list[int]) -> torch.Tensor:
        """Candidate indices, slot by slot from slot 0 -> the tokens [len(path)]."""
        cands = self.cands[row]
        return cands[torch.arange(len(path), device=cands.device), torch.tensor(path, device=cands.device)]


def _dense(law: torch.Tensor, cands: torch.Tensor, vocab: int) -> torch.Tensor:
    """law [K] over candidate tokens cands [K] -> [V]."""
    return torch.zeros(vocab, dtype=torch.float32, device=law.device).scatter(0, cands, law.float())


def sampled_chain(tr: Transitions, row: int, root: int, slots: int, temperature: float, vocab: int,
                  generator: torch.Generator | None) -> DraftTree:
    """A chain of `slots` drafts drawn slot by slot from the selector's laws, each given the token drawn before
    it; draft_probs row i = the law node i was drawn from (dense over the vocabulary)."""
    first, step = tr.laws(row, temperature)
    law, path = first, list[int]()
    rows = [torch.zeros(vocab, dtype=torch.float32, device=first.device)]
    for s in range(slots):
        if s:
            law = step[s - 1, path[-1]]
        j = int(torch.multinomial(law, 1, generator=generator))
        path.append(j)
        rows.append(_dense(law, tr.cands[row, s], vocab))
    return DraftTree.chain(root, tr.tokens(row, path), torch.stack(rows))


def selector_tree(tr: Transitions, row: int, root: int, slots: int, budget: int,
                  temperature: float = 1.0) -> tuple[DraftTree, list[int]]:
    """The best tree of `budget` draft nodes over the selector's chain of laws: the `budget` most probable
    prefixes, a prefix's probability being the product of log_softmax(scores / T) along it (prefix-closed, as
    log-probabilities are <= 0). Best-first as `ddtree.build_ddtree`: pop the best, push its next sibling (the
    next-ranked candidate under the same parent) and its first child (the best candidate after its own token).
    -> (the tree, each node's candidate index in its slot; the root's is -1)."""
    first = torch.log_softmax(tr.first[row] / temperature, dim=-1)  # [K]
    step = torch.log_softmax(tr.step[row, : max(slots - 1, 0)] / temperature, dim=-1)  # [S-1, K, K]
    first_vals, first_ids = first.sort(descending=True)
    step_vals, step_ids = step.sort(dim=-1, descending=True)
    # ranked[(slot, parent candidate)] -> (log-probs, candidate indices) of the children, best first
    ranked: dict[tuple[int, int], tuple[list[float], list[int]]] = {(0, -1): (first_vals.tolist(), first_ids.tolist())}
    sv, si = step_vals.tolist(), step_ids.tolist()
    cand_tokens: list[list[int]] = tr.cands[row, :slots].tolist()
    depth_cap = min(slots, budget)
    tokens, parents, depths, index = [root], [-1], [0], [-1]
    # entry: (-score, push order, slot, rank, parent node, parent score)
    heap: list[tuple[float, int, int, int, int, float]] = [(-first_vals.tolist()[0], 0, 0, 0, 0, 0.0)]
    pushes = 1
    while heap and len(tokens) <= budget:
        neg, _, s, r, parent, parent_score = heapq.heappop(heap)
        vals, ids = ranked[(s, index[parent])]
        j = ids[r]
        node = len(tokens)
        tokens.append(cand_tokens[s][j])
        parents.append(parent)
        depths.append(s + 1)
        index.append(j)
        if r + 1 < len(vals) and vals[r + 1] > -math.inf:
            heapq.heappush(heap, (-(parent_score + vals[r + 1]), pushes, s, r + 1, parent, parent_score))
            pushes += 1
        if s + 1 < depth_cap:
            ranked.setdefault((s + 1, j), (sv[s][j], si[s][j]))
            heapq.heappush(heap, (neg - sv[s][j][0], pushes, s + 1, 0, node, -neg))
            pushes += 1
    device = tr.cands.device
    tree = DraftTree(torch.tensor(tokens, dtype=torch.long, device=device),
                     torch.tensor(parents, dtype=torch.long, device=device),
                     torch.tensor(depths, dtype=torch.long, device=device))
    return tree, index


def draw_selector_tree(shape: DraftTree, tr: Transitions, row: int, temperature: float, vocab: int,
                       generator: torch.Generator | None) -> DraftTree:
    """shape's nodes (parents first) filled by drawing: the children of a node, in order, from the law its own
    drawn token gives (the root's: slot 0's law after the anchor), without the candidates their earlier siblings
    drew (renormalised). Each node keeps the exact law it was drawn from, which is all recursive rejection
    (`verify.verify_sampled`) needs: the laws depend on the drafts, never on the target. A node whose law has no
    mass left (its drawn parent's law is sharper than the shape assumed: more siblings than candidates of positive
    probability) is left out, with its subtree."""
    first, step = tr.laws(row, temperature)
    parents: list[int] = shape.parents.tolist()
    depths: list[int] = shape.depths.tolist()
    keep = [0]  # the shape's nodes drawn, in order
    new_of = {0: 0}  # shape node -> its index in the drawn tree
    index = {0: -1}  # drawn candidate index of each kept shape node
    taken: dict[int, torch.Tensor] = {}  # parent -> its children's law so far (drawn candidates zeroed)
    rows = [torch.zeros(vocab, dtype=torch.float32, device=first.device)]
    tokens = [int(shape.tokens[0])]
    for i in range(1, len(parents)):
        p, s = parents[i], depths[i] - 1
        if p not in new_of:
            continue  # its parent was left out
        law = taken.get(p)
        if law is None:
            law = (first if p == 0 else step[s - 1, index[p]]).clone()
        total = float(law.sum())
        if not total > 0:
            continue
        law = law / total
        j = int(torch.multinomial(law, 1, generator=generator))
        new_of[i], index[i] = len(keep), j
        keep.append(i)
        rows.append(_dense(law, tr.cands[row, s], vocab))
        tokens.append(int(tr.cands[row, s, j]))
        law = law.clone()
        law[j] = 0.0
        taken[p] = law
    dev = first.device
    return DraftTree(torch.tensor(tokens, dtype=torch.long, device=dev),
                     torch.tensor([-1] + [new_of[parents[i]] for i in keep[1:]], dtype=torch.long, device=dev),
                     torch.tensor([depths[i] for i in keep], dtype=torch.long, device=dev), torch.stack(rows))
