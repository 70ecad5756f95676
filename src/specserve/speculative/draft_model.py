"""STANDALONE drafting: a small causal LM with the target's tokenizer drafts autoregressively.

The draft model keeps its own contiguous KV cache of committed tokens; tokens it has not
seen yet (the root, or a fully accepted last draft) are fed at the start of the next round.
Chains sample their drafts when the request samples (rejection rule); trees use top-k.
"""

from __future__ import annotations

import torch

from specserve.config import SpeculativeConfig
from specserve.kv.contiguous import ContiguousKVCache
from specserve.layers.sampling import sample, target_probs
from specserve.models.llama import CausalLM
from specserve.speculative.drafter import Drafter
from specserve.speculative.trees.eagle_tree import expand_eagle_tree
from specserve.speculative.trees.tree import DraftTree
from specserve.types import SamplingParams


def check_draft_model(draft: CausalLM, target: CausalLM) -> None:
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"--speculative-draft-model-path: draft vocab_size {draft.config.vocab_size} differs from the "
            f"target's {target.config.vocab_size}; STANDALONE needs the same tokenizer"
        )


class DraftModelDrafter(Drafter):
    capture = ()

    def __init__(self, draft: CausalLM, spec: SpeculativeConfig, params: SamplingParams,
                 generator: torch.Generator, max_len: int) -> None:
        self.model = draft
        self.spec = spec
        self.params = params
        self.gen = generator
        self.device = draft.lm_head.weight.device
        self.cache = ContiguousKVCache.allocate(draft.config, 1, max_len + spec.num_draft_tokens + 2, self.device,
                                      draft.lm_head.weight.dtype)
        self.length = 0  # committed tokens in the draft KV
        self.pending: list[int] = []  # committed tokens not yet fed to the draft model
        self._round: tuple[int, list[int] | None] = (0, None)  # (start slot, chain tokens fed) of the last round

    def prefill(self, prompt_ids: list[int], hidden: torch.Tensor | None) -> None:
        self.length, self.pending = 0, list(prompt_ids)

    @property
    def backlog(self) -> int:
        return len(self.pending) + 1

    def _feed(self, tokens: list[int], mask: torch.Tensor | None = None,
              positions: torch.Tensor | None = None) -> torch.Tensor:
        """Run the draft model on `tokens` at slots [length, length+n); returns logits [n, V]."""
        n = len(tokens)
        ids = torch.tensor([tokens], device=self.device)
        pos = positions if positions is not None else torch.arange(self.length, self.length + n, device=self.device)
        out = self.model(ids, pos[None], self.cache.view(self.length, n, mask))
        return out.logits[0]

    def propose(self, root: int, max_drafts: int | None = None) -> DraftTree:
        start = self.length
        logits = self._feed([*self.pending, root])[-1]  # [V]
        self.length += len(self.pending) + 1  # temporarily includes the root
        self.pending = []
        steps = self.spec.num_steps if max_drafts is None else max(1, min(self.spec.num_steps, max_drafts))
        tree = self._tree(root, logits) if self.spec.eagle_topk > 1 else self._chain(root, logits, steps)
        self._round = (start, tree.tokens.tolist() if self.spec.eagle_topk == 1 else None)
        self.length = start  # crop: accept() recommits what the target accepted
        return tree

    def _chain(self, root: int, logits: torch.Tensor, steps: int) -> DraftTree:
        drafts: list[int] = []
        probs_rows: list[torch.Tensor] = []
        for step in range(steps):
            if self.params.greedy:
                tok = int(logits.argmax().item())
            else:
                q = target_probs(logits[None], self.params)[0]  # [V]
                tok = int(sample(q[None], self.gen).item())
                probs_rows.append(q)
            drafts.append(tok)
            if step + 1 < steps:
                logits = self._feed([tok])[-1]
                self.length += 1
        draft_probs = None
        if probs_rows:
            draft_probs = torch.stack([torch.zeros_like(probs_rows[0]), *probs_rows])  # [N+1, V]
        return DraftTree.chain(root, drafts, draft_probs, device=self.device)

    def _tree(self, root: int, logits: torch.Tensor) -> DraftTree:
        base = self.length  # slot after the root; fed node i (>=1) sits at base + i - 1
        root_pos = base - 1
        depth_of = [0]
        fed_parents = [-1]

        def step_fn(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
            f = tokens.shape[0]
            first = len(depth_of)
            for p in parents.tolist():
                depth_of.append(depth_of[p] + 1)
                fed_parents.append(p)
            total = len(depth_of)
            # ancestor mask among fed nodes; fed node 0 is the root at slot base-1
            anc = torch.zeros(total, total, dtype=torch.bool)
            for i in range(total):
                j = i
                while j >= 0:
                    anc[i, j] = True
                    j = fed_parents[j]
            rows = anc[first:, 1:]  # [F, total-1] over fed nodes 1.. (slots base..)
            prefix = torch.ones(f, base, dtype=torch.bool)
            mask = torch.cat((prefix, rows), dim=1)[None, None].to(self.device)
            pos = torch.tensor([root_pos + d for d in depth_of[first:]], device=self.device)
            self.length = base + first - 1
            out = self._feed(tokens.tolist(), mask=mask, positions=pos)
            return torch.log_softmax(out.float(), dim=-1)

        first_lp = torch.log_softmax(logits.float(), dim=-1)
        return expand_eagle_tree(root, first_lp, step_fn, self.spec.num_steps, self.spec.eagle_topk,
                                 self.spec.num_draft_tokens - 1)

    def accept(self, tokens: list[int], hidden: torch.Tensor | None, next_root: int) -> None:
        start, chain = self._round
        if chain is not None:
            # A chain round fed the root and every draft but the last into slots start.. in order,
            # so an accepted prefix is already in the KV; only a fully accepted last draft is not.
            fed = len(chain) - 1
            kept = min(len(tokens), fed)
            self.length, self.pending = start + kept, list(tokens[kept:])
        else:
            self.length, self.pending = start, list(tokens)  # tree slots are scattered: re-feed
