"""DFLASH drafting: one non-causal forward over [root, MASK x (bs-1)] drafts a whole block.

Per request the drafter keeps, for every draft layer, the K/V of the projected target context (one slot per
token in the target's KV, at that token's position). A round:
  propose(root): block = embed([root, MASK, ..., MASK]) at positions P..P+bs-1 (P = tokens in the target KV,
      i.e. the root's position); queries from the block, keys/values = cached context + the block itself.
      Output position i (1 <= i < bs) is the drafter's distribution of the token at position P+i, the one
      its mask stands for (no shift: row i fills mask i). The block's own K/V are never cached.
      chain  -> the first num_draft_tokens-1 argmaxes as a chain;
      ddtree -> build_ddtree over the bs-1 per-position log-distributions, budget num_draft_tokens (the LM head
                over the rows past the first LAZY_ROWS only for the trees that reach them: `lazy_rows`).
  accept(tokens, hidden, next_root): queue the accepted tokens' states; the next propose projects and caches
      their context K/V (in one forward, however many rounds ran without speculation in between).
Greedy requests get deterministic drafts (argmax / best prefixes; draft_probs None, verified by descending
the target's picks). Sampling requests get *sampled* drafts: q_d = the request's processing (temperature,
top-k/p) of the drafter's depth-d distribution at `dflash_config.sample_temperature` (a calibration); a chain
draws one token per depth from q_d, a DDTree keeps the shape of the best tree over q and draws its tokens
(`sampled_tree.draw_tree`: siblings without replacement; q_d does not depend on the path, as the block is
drafted in one pass, unless `dflash_config.sample_reveal` shows the drafter the tree's first path: `_reveal`,
one more block forward per token shown). They verify by recursive rejection (`verify.verify_sampled`,
SpecInfer), accepting a sibling with min(1, p/q): where the target is uncertain that accepts more than a fixed
top-k set covers (coding10 at temperature 0.7: see the drafter's card).

A DFlash 2 drafter (`selector.py`) drafts the same block, then its candidate selector scores each slot's top-k
given the token before it: a chain is the selector's greedy walk (or, sampling, a walk drawn from its laws at
T x sample_temperature, the laws kept for verification); a DDTree is the best tree over the selector's chain of
laws (`selector_tree`, at dflash_config.tree_temperature), its tokens drawn for a sampling request
(`draw_selector_tree`). Every row of the block goes through the LM head at once (the selector needs them all).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from specserve.config import SpeculativeConfig
from specserve.kv.contiguous import ContiguousKVCache
from specserve.layers.quant import QuantLinear
from specserve.layers.sampling import target_probs
from specserve.models.llama import CausalLM
from specserve.speculative.dflash.checkpoint import check_against_target, dflash_block_size
from specserve.speculative.dflash.model import FLAG, DFlashDraftModel
from specserve.speculative.dflash.selector import draw_selector_tree, sampled_chain, selector_tree
from specserve.speculative.drafter import Drafter
from specserve.speculative.trees.ddtree import build_ddtree, rebuild_below
from specserve.speculative.trees.sampled_tree import draw_tree, redraw_below
from specserve.speculative.trees.tree import DraftTree
from specserve.types import SamplingParams

LAZY_ROWS = 6  # block rows given the LM head before a DDTree is built (see `DFlashDrafter.lazy_rows`)


class DFlashDrafter(Drafter):
    def __init__(self, draft: DFlashDraftModel, target: CausalLM, spec: SpeculativeConfig,
                 params: SamplingParams, generator: torch.Generator | None, max_len: int,
                 head: nn.Module | None = None) -> None:
        """`params` and `generator`: the request's sampling (greedy: deterministic drafts; otherwise drafts drawn
        with `generator`). max_len: the most tokens the target's KV will hold (sizes the context cache).
        head: the target's LM head in the drafter's dtype, where that differs from the target's."""
        cfg = draft.config
        check_against_target(cfg, target.config, f"{FLAG} {spec.draft_model_path}")
        if spec.tree not in ("chain", "ddtree"):
            raise ValueError(f"--speculative-tree {spec.tree} is not available for DFLASH; use chain or ddtree")
        self.block_size = dflash_block_size(spec, cfg)
        self.capture = cfg.capture
        self.draft, self.target, self.spec = draft, target, spec
        self.selector = draft.candidate_selector  # DFlash 2's; None for DFlash
        self.head = head if head is not None else target.lm_head
        self.params, self.gen = params, generator
        weight = draft.fc.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.cache = ContiguousKVCache.allocate(cfg.body, 1, max_len, self.device, self.dtype,
                                      num_layers=cfg.body.num_hidden_layers)
        self.length = 0  # context slots filled = tokens in the target's KV (once `_pending` is flushed)
        self._pending: list[torch.Tensor] = []  # [T_i, n*H] captured states accepted since the last propose
        self._block_ids = torch.full((1, self.block_size), cfg.mask_token_id, dtype=torch.long, device=self.device)
        self._offsets = torch.arange(self.block_size, device=self.device)
        self._last_deep = False  # the last DDTree reached row LAZY_ROWS (see `lazy_rows`)

    def prefill(self, prompt_ids: list[int], hidden: torch.Tensor | None) -> None:
        if hidden is None:
            raise ValueError("DFLASH needs the target's hidden states: run the prefill with capture=drafter.capture")
        self.length = 0
        self._pending = [hidden]  # projected at the first propose, like accepted tokens: a request that never
        # speculates (adaptive decoding plainly at high concurrency) costs no drafter forward over its prompt

    def accept(self, tokens: list[int], hidden: torch.Tensor | None, next_root: int) -> None:
        """Queue the accepted tokens' states; they enter the context cache in one forward at the next propose
        (rounds without speculation then cost no drafter forward)."""
        assert hidden is not None and hidden.shape[0] == len(tokens), "accept needs one hidden row per token"
        self._pending.append(hidden)

    @property
    def backlog(self) -> int:
        return sum(int(h.shape[0]) for h in self._pending)

    @property
    def context_tokens(self) -> int:
        """Tokens whose target states the drafter holds: in the context cache or queued for it."""
        return self.length + sum(int(h.shape[0]) for h in self._pending)

    def _take_pending(self) -> torch.Tensor | None:
        """[T, n*H] the queued states, now no longer queued; None when nothing is queued."""
        if not self._pending:
            return None
        hidden = torch.cat(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending = []
        return hidden

    def _flush(self) -> None:
        hidden = self._take_pending()
        if hidden is not None:
            self._append(hidden)

    def _append(self, hidden: torch.Tensor) -> None:
        """hidden [T, n*H] captured target states of the next T committed tokens."""
        t = hidden.shape[0]
        positions = torch.arange(self.length, self.length + t, device=self.device)[None]  # [1, T]
        self.draft.append_context(self.cache, self.length, hidden[None].to(self.dtype), positions)
        self.length += t

    def block_log_probs(self, root: int, rows: int | None = None) -> torch.Tensor:
        """[rows, V] float32 (rows: default bs-1): row i-1 = log-distribution of the token at position P+i (mask i
        of the block). The block forward is the whole block's either way; `rows` saves LM-head products."""
        n = self._rows(rows)
        return self._log_probs(self._block_hidden(root, n))

    def _block_hidden(self, root: int, rows: int, revealed: Sequence[int] = ()) -> torch.Tensor:
        """[rows, H]: the block forward's outputs at masks 1..rows (LM-head ready); the block is whole either
        way, only the last layer's later positions are skipped. `revealed`: tokens shown in the first masks."""
        self._flush()
        ids = self._block_ids.clone()
        ids[0, 0] = root
        if revealed:
            ids[0, 1:1 + len(revealed)] = torch.tensor(list(revealed), device=self.device)
        noise = self.target.embed(ids).to(self.dtype)  # [1, bs, H]
        positions = (self._offsets + self.length)[None]  # [1, bs]
        hidden = self.draft(noise, positions, self.draft.cached_context(self.cache, self.length), None,
                            rows + 1)  # [1, rows+1, H]
        return hidden[0, 1:]

    def _log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] block outputs -> log-distributions [..., V] float32 (the target's LM head)."""
        return torch.log_softmax(self._logits(hidden), dim=-1)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] block outputs -> logits [..., V] float32 (the target's LM head)."""
        # as one [N, H] matrix: a strided 3-D slice of the block outputs makes matmul fall back to a batched
        # product over a broadcast weight, 2-6x slower on CPU
        flat = hidden.reshape(-1, hidden.shape[-1])
        if isinstance(self.head, QuantLinear):  # the int8 kernel reads and writes float32
            flat = flat.float()
        return self.head(flat).float().view(*hidden.shape[:-1], -1)

    def _rows(self, rows: int | None) -> int:
        return self.block_size - 1 if rows is None else max(1, min(rows, self.block_size - 1))

    def _draft_nodes(self, max_drafts: int | None) -> int:
        """Draft nodes of this round's tree: the configured budget (DDTree: draft nodes; chain: the root
        included), cut to `max_drafts`, at least one."""
        budget = self.spec.num_draft_tokens if self.spec.tree == "ddtree" else self.spec.num_draft_tokens - 1
        return budget if max_drafts is None else max(1, min(budget, max_drafts))

    def rows_needed(self, max_drafts: int | None) -> int:
        """Block positions a tree of at most `max_drafts` draft nodes reads: its depth is at most its size."""
        return self._rows(self._draft_nodes(max_drafts))

    def skip(self, root: int) -> None:
        """The context cache only grows in `accept`; a round without drafts needs nothing."""

    def propose(self, root: int, max_drafts: int | None = None) -> DraftTree:
        rows = self.rows_needed(max_drafts)
        hidden = self._block_hidden(root, rows)  # [rows, H]
        if self.selector is not None:
            return _selector_trees([self], [root], hidden[None], [max_drafts])[0]
        first = self.lazy_rows(max_drafts)
        tree = self._tree_lazily(root, self._log_probs(hidden[:first]), hidden[first:rows], max_drafts)
        return _reveal([self], [root], [tree])[0]

    @property
    def reveal_levels(self) -> int:
        """Tokens of the tree's first-child path shown to the drafter, one more block forward each
        (`dflash_config.greedy_reveal` / `sample_reveal`, at most bs-2: a mask must stay)."""
        cfg = self.draft.config
        return min(cfg.greedy_reveal if self.params.greedy else cfg.sample_reveal, self.block_size - 2)

    def lazy_rows(self, max_drafts: int | None) -> int:
        """Block rows whose LM head is computed up front. A DDTree rarely reaches the block's far end (on the
        demo, 91% of held-out greedy trees and all coding T 0.7 trees of budget 16 are at most 6 deep), and
        the best tree over the first m rows *is* the best tree over all of them whenever it stays shallower
        than m (a node at depth m + 1 is only ever pushed as the child of a popped node at depth m), so the
        LM head runs over the other rows only for the trees that reach row m. A request whose last tree reached
        row m (a loop the drafter follows far) gets all rows at once: its next tree likely will too, and a
        second product would cost more than it saves. A chain reads all its rows."""
        rows = self.rows_needed(max_drafts)
        lazy = self.spec.tree == "ddtree" and not self._last_deep and self.selector is None
        return min(rows, LAZY_ROWS) if lazy else rows

    def _tree_lazily(self, root: int, head: torch.Tensor, rest: torch.Tensor, max_drafts: int | None) -> DraftTree:
        """head [m, V] log-probs of the first rows, rest [r, H] the remaining rows' block outputs."""
        tree = self._tree(root, head, max_drafts)
        depth, m = int(tree.depths.max()), int(head.shape[0])
        self._last_deep = depth >= min(LAZY_ROWS, m)
        if rest.shape[0] == 0 or depth < m:
            return tree
        # (a sampling request's first draw is discarded: whether to redo depends on the shape, not the draws)
        return self._tree(root, torch.cat((head, self._log_probs(rest))), max_drafts)

    @classmethod
    def propose_many(cls, drafters: Sequence[Drafter], roots: list[int],
                     max_drafts: list[int | None]) -> list[DraftTree]:
        """One batched block forward for all requests (same drafter model), the LM head batched over the rows
        every request needs up front and, for the requests that need more (`lazy_rows`), over theirs."""
        group = [d for d in drafters if isinstance(d, DFlashDrafter)]
        if (len(group) < 2 or len(group) != len(drafters)
                or any(d.draft is not group[0].draft or d.block_size != group[0].block_size for d in group)):
            return super().propose_many(drafters, roots, max_drafts)
        rows = [d.rows_needed(m) for d, m in zip(group, max_drafts, strict=True)]
        first = [d.lazy_rows(m) for d, m in zip(group, max_drafts, strict=True)]
        hidden = _block_hidden_many(group, roots, max(rows))  # [B, max(rows), H]
        if group[0].selector is not None:
            return _selector_trees(group, roots, hidden, max_drafts)
        lo, hi = min(first), max(first)
        head = group[0]._log_probs(hidden[:, :lo])  # [B, lo, V]
        more = [i for i, f in enumerate(first) if f > lo]
        extra = group[0]._log_probs(hidden[more, lo:hi]) if more else None  # [E, hi-lo, V]
        heads = [head[i] for i in range(len(group))]
        for j, i in enumerate(more):
            assert extra is not None
            heads[i] = torch.cat((head[i], extra[j, : first[i] - lo]))  # [first_i, V]
        trees = [d._tree_lazily(r, h, hidden[i, f:n], m)
                 for i, (d, r, m, h, f, n) in enumerate(zip(group, roots, max_drafts, heads, first, rows, strict=True))]
        return _reveal(group, roots, trees)

    def _tree(self, root: int, log_probs: torch.Tensor, max_drafts: int | None) -> DraftTree:
        n = self._draft_nodes(max_drafts)
        cfg = self.draft.config
        if not self.params.greedy:  # drafts drawn from the request's processing of the (calibrated) block laws
            q = target_probs(log_probs / cfg.sample_temperature, self.params)  # [rows, V]
            if self.spec.tree == "ddtree":  # the shape of the best tree over q; its tokens are then drawn
                shape = build_ddtree(root, torch.log(q), n)
            else:
                shape = DraftTree.chain(root, [0] * min(n, int(q.shape[0])), device=q.device)
            return draw_tree(shape, q, self.gen)
        if self.spec.tree == "ddtree":  # a smaller budget builds the best smaller tree, not a cut of the big one
            if cfg.tree_temperature != 1.0:
                log_probs = torch.log_softmax(log_probs / cfg.tree_temperature, dim=-1)
            return build_ddtree(root, log_probs, n)
        return DraftTree.chain(root, log_probs[:n].argmax(dim=-1))  # drafts [n]


def _reveal(drafters: Sequence[DFlashDrafter], roots: list[int], trees: list[DraftTree]) -> list[DraftTree]:
    """Trees made again below their first-child paths (`dflash_config.sample_reveal` / `greedy_reveal`). A block's
    deeper laws are marginals over the tokens before them, which the path does not follow (a drawn path least of
    all); so at level j every request still going shows the drafter its root and the first j tokens of its path
    in the block's first masks (one block forward for all of them), and below the path's j-th node a sampling
    request's subtree is drawn again from the block's laws given them (`sampled_tree.redraw_below`, same shape,
    each node keeping the law it was drawn from) and a greedy request's is rebuilt as the best tree of as many
    nodes over them (`ddtree.rebuild_below`, one row deeper allowed). Laws depend on drafts only, so
    verification stays exact. (Also tried for sampling on coding10 at T 0.7, not kept: every node of a level
    shown, and the drawn subtree's shape rebuilt; neither beat the first path alone over ten seeds.)"""
    levels = max(d.reveal_levels for d in drafters)
    if not levels:
        return trees
    trees = list(trees)
    paths: list[list[int]] = [[] for _ in trees]  # per request: the path's nodes shown so far
    for level in range(1, levels + 1):
        going: list[int] = []
        for i, (d, tree) in enumerate(zip(drafters, trees, strict=True)):
            if level > d.reveal_levels or len(paths[i]) != level - 1:
                continue
            kids = tree.children()
            at = paths[i][-1] if paths[i] else 0
            if kids[at] and kids[kids[at][0]]:  # a first child with a subtree below it to draw again
                paths[i].append(kids[at][0])
                going.append(i)
        if not going:
            break
        # the rows the trees reach (a greedy subtree may grow one deeper), within every block
        rows = min(min(drafters[i].block_size for i in going) - 1,
                   max(int(trees[i].depths.max()) + int(drafters[i].params.greedy) for i in going))
        shown = [trees[i].tokens[paths[i]].tolist() for i in going]
        group = [drafters[i] for i in going]
        if len(group) > 1 and all(d.draft is group[0].draft and d.block_size == group[0].block_size for d in group):
            hidden = _block_hidden_many(group, [roots[i] for i in going], rows, shown)  # [G, rows, H]
        else:
            hidden = torch.stack([d._block_hidden(roots[i], rows, s)
                                  for d, i, s in zip(group, going, shown, strict=True)])
        log_probs = group[0]._log_probs(hidden[:, level:rows])  # [G, rows-level, V]: depths level+1 .. rows
        for j, (d, i) in enumerate(zip(group, going, strict=True)):
            cfg = d.draft.config
            if d.params.greedy:
                lp = log_probs[j] if cfg.tree_temperature == 1.0 else torch.log_softmax(
                    log_probs[j] / cfg.tree_temperature, dim=-1)
                trees[i], paths[i][-1] = rebuild_below(trees[i], paths[i][-1], lp)
            else:
                q = target_probs(log_probs[j] / cfg.sample_temperature, d.params)
                trees[i] = redraw_below(trees[i], paths[i][-1], q, d.gen, first_depth=level + 1)
    return trees


def _selector_trees(drafters: Sequence[DFlashDrafter], roots: list[int], hidden: torch.Tensor,
                    max_drafts: list[int | None]) -> list[DraftTree]:
    """DFlash 2: hidden [B, rows, H] the block outputs of B requests (one drafter model) -> their trees, the LM
    head and the selector's scores batched over all of them."""
    first = drafters[0]
    assert first.selector is not None
    unary = first._logits(hidden)  # [B, rows, V]: a constant per slot changes none of the selector's choices
    dev = hidden.device
    tr = first.selector.transitions(hidden, unary, torch.tensor(roots, device=dev))
    vocab, rows = int(unary.shape[-1]), int(hidden.shape[1])
    trees = []
    for i, (d, root, m) in enumerate(zip(drafters, roots, max_drafts, strict=True)):
        n = d._draft_nodes(m)
        temperature = d.params.temperature * d.draft.config.sample_temperature
        if d.spec.tree == "chain":
            slots = min(n, rows)
            trees.append(DraftTree.chain(root, tr.tokens(i, tr.greedy_path(i, slots))) if d.params.greedy
                         else sampled_chain(tr, i, root, slots, temperature, vocab, d.gen))
        elif d.params.greedy:  # dflash_config.tree_temperature shapes it as it shapes a DFlash DDTree
            trees.append(selector_tree(tr, i, root, rows, n, d.draft.config.tree_temperature)[0])
        else:  # the shape of the best tree over the laws q; its tokens then drawn from them
            shape = selector_tree(tr, i, root, rows, n, temperature)[0]
            trees.append(draw_selector_tree(shape, tr, i, temperature, vocab, d.gen))
    return trees


def _block_hidden_many(drafters: list[DFlashDrafter], roots: list[int], rows: int,
                       revealed: list[list[int]] | None = None) -> torch.Tensor:
    """`_block_hidden` of B requests in one forward: each block attends to its own context (padded to the
    longest, masked) and itself; `revealed` (as many per request): tokens shown in the first masks.
    -> [B, rows, H]."""
    first = drafters[0]
    _flush_many(drafters)
    b, bs, dev = len(drafters), first.block_size, first.device
    lengths = torch.tensor([d.length for d in drafters], device=dev)  # [B]
    longest = int(lengths.max())
    ids = first._block_ids.expand(b, bs).clone()
    ids[:, 0] = torch.tensor(roots, device=dev)
    if revealed and revealed[0]:
        ids[:, 1:1 + len(revealed[0])] = torch.tensor(revealed, device=dev)
    noise = first.target.embed(ids).to(first.dtype)  # [B, bs, H]
    positions = lengths[:, None] + first._offsets[None]  # [B, bs]
    context = []
    for layer in range(len(first.cache.k)):
        k0 = first.cache.k[layer]
        k = k0.new_zeros(b, k0.shape[1], longest, k0.shape[3])  # [B, Hkv, C, D]
        v = torch.zeros_like(k)
        for i, d in enumerate(drafters):
            k[i, :, :d.length] = d.cache.k[layer][0, :, :d.length]
            v[i, :, :d.length] = d.cache.v[layer][0, :, :d.length]
        context.append((k, v))
    keys = torch.arange(longest + bs, device=dev)[None]  # [1, C+bs]
    mask = (keys < lengths[:, None]) | (keys >= longest)  # [B, C+bs]: own context, the whole block
    hidden = first.draft(noise, positions, context, mask[:, None, None, :], rows + 1)  # [B, rows+1, H]
    return hidden[:, 1:]


def _flush_many(drafters: list[DFlashDrafter]) -> None:
    """Every drafter's queued context in one projection (the projection is per token: the backlogs go in
    concatenated, not padded, so a request joining with its whole prompt costs its prompt, not the batch times
    it), each drafter's rows then written into its own cache: after a stretch of plain decoding a whole batch
    catches up in one forward."""
    waiting = [d for d in drafters if d._pending]
    if len(waiting) < 2:
        for d in waiting:
            d._flush()
        return
    first = waiting[0]
    rows = [r for r in (d._take_pending() for d in waiting) if r is not None]  # [T_i, n*H] each, one per drafter
    features = torch.cat(rows)[None].to(first.dtype)  # [1, sum T_i, n*H]
    positions = torch.cat([torch.arange(d.length, d.length + int(r.shape[0]), device=first.device)
                           for d, r in zip(waiting, rows, strict=True)])[None]  # [1, sum T_i]
    kv = first.draft.context_kv(features, positions)  # per layer k, v [1, Hkv, sum T_i, D]
    at = 0
    for d, r in zip(waiting, rows, strict=True):
        t = int(r.shape[0])
        view = d.cache.view(d.length, t, causal=False)
        for layer, (k, v) in enumerate(kv):
            view.update(layer, k[:, :, at:at + t], v[:, :, at:at + t])
        d.length += t
        at += t
