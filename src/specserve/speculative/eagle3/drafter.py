"""EAGLE-3 drafting for one request: a chain (topk 1) or an EAGLE dynamic tree (topk > 1).

Drafter KV slot j holds the pair (target feature of token j, embedding of token j+1) at position j;
its output predicts token j+2. The last pair of a committed stretch waits for its next token:
  prefill(prompt, hidden)          pending = features of the T prompt tokens, tokens prompt[1:]
  propose(root)                    the pending pairs complete with `root` and are committed (slots
                                   [P-n, P), P = tokens in the target KV); then drafting
  accept([root, a1..ak], hidden)   pending = the k+1 accepted features, tokens a1..ak; the pair
                                   (feature of ak, next_root) completes at the next propose
  skip(root)                       (a round without drafts) root joins the pending tokens; pending pairs
                                   accumulate until the next propose commits them in one forward
Draft entries (fed with the drafter's own output features, no fc) sit in slots P, P+1, ... and are
dropped by not counting them: the next commit overwrites them. Tree nodes sit there too, each attending
to the committed prefix, its ancestors and itself; a node of depth d has position P + d - 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.config import SpeculativeConfig
from specserve.kv.contiguous import ContiguousKVCache
from specserve.kv.rows import rows_view
from specserve.layers.sampling import sample, target_probs
from specserve.models.llama import CausalLM
from specserve.speculative.drafter import Drafter
from specserve.speculative.eagle3.checkpoint import check_target
from specserve.speculative.eagle3.compiled import PAD, CompiledChains
from specserve.speculative.eagle3.model import Eagle3Model
from specserve.speculative.trees.eagle_tree import expand_eagle_tree
from specserve.speculative.trees.tree import DraftTree
from specserve.types import SamplingParams


class Eagle3Drafter(Drafter):
    def __init__(self, model: Eagle3Model, target: CausalLM, spec: SpeculativeConfig, params: SamplingParams,
                 generator: torch.Generator | None, max_len: int, compiled: CompiledChains | None = None) -> None:
        """`compiled`: greedy chain rounds as compiled graphs (`eagle3/compiled.py`), None: all eager."""
        cfg = model.config
        check_target(cfg, target.config, model.embed_tokens is not None, "(loaded drafter)")
        if spec.num_steps < 1:
            raise ValueError(f"--speculative-num-steps must be >= 1 for EAGLE3, got {spec.num_steps}")
        if not 1 <= spec.eagle_topk <= cfg.draft_vocab_size:
            raise ValueError(f"--speculative-eagle-topk must be in [1, draft_vocab_size={cfg.draft_vocab_size}], "
                             f"got {spec.eagle_topk}")
        self.model = model
        self.target = target
        self.spec = spec
        self.params = params
        self.gen = generator
        self.capture = cfg.aux_layer_ids
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        # Fed draft nodes per round: the root plus topk per step but the last (one per step for a chain).
        self.max_fed = 1 + (spec.num_steps - 1) * spec.eagle_topk
        self.compiled = compiled if spec.eagle_topk == 1 and params.greedy else None
        room = self.max_fed + (PAD if self.compiled is not None else 0)  # a compiled round pads its commit
        self.kv = ContiguousKVCache.allocate(cfg.layer, 1, max_len + room, self.device, self.dtype, num_layers=1)
        self.committed = 0  # drafter KV slots holding complete pairs (= target positions before the root)
        # [n_i, 3·Ht] parts of the features awaiting their next token (concatenated once, at the next commit);
        # None right after a commit, until accept()
        self._pending_hidden: list[torch.Tensor] | None = None
        self._pending_tokens: list[int] = []  # the n-1 next tokens already known
        self._root: int | None = None  # the root this round's pending pair completed with / must complete with

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], hidden: torch.Tensor | None) -> None:
        if hidden is None or hidden.shape[0] != len(prompt_ids):
            raise ValueError("EAGLE3 needs the target's captured states of every prompt token "
                             "(run the target prefill with capture=drafter.capture)")
        self.committed = 0
        self._pending_hidden, self._pending_tokens, self._root = [hidden], list(prompt_ids[1:]), None

    @torch.inference_mode()
    def accept(self, tokens: list[int], hidden: torch.Tensor | None, next_root: int) -> None:
        if hidden is None or hidden.shape[0] != len(tokens):
            raise ValueError("EAGLE3 needs the target's captured states of every accepted token")
        assert tokens[0] == self._root, "accept() must follow propose(root) or skip(root)"
        if self._pending_hidden is None:
            self._pending_hidden = [hidden]
        else:  # after skip(): those pairs wait for the next propose
            self._pending_hidden.append(hidden)
        self._pending_tokens += list(tokens[1:])
        self._root = next_root

    @torch.inference_mode()
    def propose(self, root: int, max_drafts: int | None = None) -> DraftTree:
        assert self._pending_hidden is not None, "propose() must follow prefill() or accept()"
        assert self._root is None or self._root == root, "propose(root) must get accept()'s next_root"
        if self.compiled is not None:
            tree = self._compiled_chain(root, _steps(self.spec.num_steps, max_drafts))
            if tree is not None:
                return tree
        feat = self._commit(root)  # [1, H]
        self._root = root
        if self.spec.eagle_topk == 1:
            return self._chain(root, feat, _steps(self.spec.num_steps, max_drafts))
        return self._tree(root, feat)

    @classmethod
    def propose_many(cls, drafters: Sequence[Drafter], roots: list[int],
                     max_drafts: list[int | None]) -> list[DraftTree]:
        """Chains of one drafter model: one batched drafter forward per step for all requests (a padded
        batch over their own caches, `kv/rows.py`) instead of one forward per request."""
        group = [d for d in drafters if isinstance(d, Eagle3Drafter)]
        if (len(group) < 2 or len(group) != len(drafters)
                or any(d.spec.eagle_topk != 1 or d.model is not group[0].model for d in group)):
            return super().propose_many(drafters, roots, max_drafts)
        for d, root in zip(group, roots, strict=True):
            assert d._root is None or d._root == root, "propose(root) must get accept()'s next_root"
        steps = [_steps(d.spec.num_steps, m) for d, m in zip(group, max_drafts, strict=True)]
        return _propose_chains(group, roots, steps)

    @property
    def backlog(self) -> int:
        return len(self._pending_tokens) + (self._pending_hidden is not None)

    def skip(self, root: int) -> None:
        """No drafting this round: `root` completes the last pending pair, and the pending pairs stay pending,
        so rounds without speculation cost no drafter forward; the next `propose` commits them all at once."""
        assert self._pending_hidden is not None, "skip() must follow prefill() or accept()"
        assert self._root is None or self._root == root, "skip(root) must get accept()'s next_root"
        self._pending_tokens.append(root)
        self._root = root

    def _compiled_chain(self, root: int, steps: int) -> DraftTree | None:
        """The round as one compiled graph, where it holds the round (None: run it eager)."""
        assert self.compiled is not None and self._pending_hidden is not None
        tokens = [*self._pending_tokens, root]
        if (not self.compiled.holds(steps, len(tokens))
                or self.compiled.slots_needed(self.committed, steps) > self.kv.max_len):
            return None
        parts = self._pending_hidden
        hidden = torch.cat(parts) if len(parts) > 1 else parts[0]  # [n, 3·Ht]
        drafts = self.compiled.run(self.kv, tokens, hidden, self.committed, steps)  # [S]
        if drafts is None:
            return None
        self._mark_committed(len(tokens), root)
        return DraftTree.chain(root, drafts)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        emb = self.model.embed_tokens(ids) if self.model.embed_tokens is not None else self.target.embed(ids)
        return emb.to(self.dtype)

    def _run(self, tokens: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor, start: int,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [Q], feats [Q, H], positions [Q] written at slots start.. -> layer outputs [Q, H]."""
        view = self.kv.view(start, int(tokens.shape[0]), mask)
        return self.model(self._embed(tokens[None]), feats[None], positions[None], view)[0]

    def _pending_inputs(self, root: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending pairs completed with `root`: tokens [n] and features [n, H], for slots committed.."""
        parts = self._pending_hidden
        assert parts is not None, "propose() must follow prefill() or accept()"
        hidden = torch.cat(parts) if len(parts) > 1 else parts[0]
        tokens = torch.tensor([*self._pending_tokens, root], device=self.device)
        return tokens, self.model.project(hidden.to(self.device, self.dtype))

    def _mark_committed(self, n: int, root: int) -> None:
        self.committed += n
        self._pending_hidden, self._pending_tokens, self._root = None, [], root

    def _commit(self, root: int) -> torch.Tensor:
        tokens, feats = self._pending_inputs(root)
        n, start = int(tokens.shape[0]), self.committed
        out = self._run(tokens, feats, torch.arange(start, start + n, device=self.device), start)
        self._mark_committed(n, root)
        return out[-1:]

    def _log_probs(self, out: torch.Tensor) -> torch.Tensor:
        """Outputs [F, H] -> log-probs over the TARGET vocabulary [F, V] (-inf outside the draft vocab)."""
        lp = torch.log_softmax(self.model.draft_logits(out).float(), dim=-1)
        return self.model.to_target_vocab(lp, float("-inf"))

    def _chain(self, root: int, feat: torch.Tensor, steps: int) -> DraftTree:
        base = self.committed  # slot and position of the depth-1 draft's entry
        drafts: list[torch.Tensor] = []  # [1] each, kept on the device
        rows: list[torch.Tensor] = []
        logits = self.model.draft_logits(feat)  # [1, Vd]
        for depth in range(1, steps + 1):
            tok = self._pick(logits, rows)
            drafts.append(tok)
            if depth == steps:
                break
            slot = base + depth - 1
            feat = self._run(tok, feat, torch.tensor([slot], device=self.device), slot)
            logits = self.model.draft_logits(feat)
        return _chain_tree(root, drafts, rows)

    def _pick(self, logits: torch.Tensor, rows: list[torch.Tensor]) -> torch.Tensor:
        """Draft-vocab logits [1, Vd] -> the next draft token [1] (target ids): argmax, or sampled, its
        distribution [V] appended to `rows`."""
        if self.params.greedy:
            return self.model.target_ids(logits.argmax(dim=-1))
        q = target_probs(self.model.to_target_vocab(logits, float("-inf")), self.params)  # [1, V]
        rows.append(q[0])
        return sample(q, self.gen)

    def _tree(self, root: int, feat: torch.Tensor) -> DraftTree:
        base = self.committed  # fed node i >= 1 sits at slot base + i - 1; fed node 0 is the root
        cap, dev = self.max_fed, self.device
        feats = torch.zeros(cap, feat.shape[-1], device=dev, dtype=self.dtype)  # [cap, H] outputs per fed node
        feats[0] = feat[0]
        anc = torch.zeros(cap, cap, dtype=torch.bool, device=dev)  # anc[i, j]: fed j is i or an ancestor (j >= 1)
        depth = torch.zeros(cap, dtype=torch.long, device=dev)
        prefix = torch.ones(cap, base, dtype=torch.bool, device=dev)
        fed = 1

        def step_fn(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
            nonlocal fed
            f = int(tokens.shape[0])
            if fed + f > cap:
                raise RuntimeError(f"EAGLE tree fed {fed + f} nodes; the drafter sized its KV for {cap}")
            idx = torch.arange(fed, fed + f, device=dev)
            par = parents.to(dev)
            anc[idx] = anc[par]
            anc[idx, idx] = True
            depth[idx] = depth[par] + 1
            mask = torch.cat((prefix[:f], anc[idx, 1:fed + f]), dim=1)[None, None]  # [1, 1, F, base+fed+F-1]
            out = self._run(tokens.to(dev), feats[par], base + depth[idx] - 1, base + fed - 1, mask)
            feats[idx] = out
            fed += f
            return self._log_probs(out)

        return expand_eagle_tree(root, self._log_probs(feat)[0], step_fn, self.spec.num_steps,
                                 self.spec.eagle_topk, self.spec.num_draft_tokens - 1)



def _steps(num_steps: int, max_drafts: int | None) -> int:
    return num_steps if max_drafts is None else max(1, min(num_steps, max_drafts))


# Rows whose pending pairs are longer (a prompt, a long run of plain rounds) are committed alone: padding the
# one-token rows of the batch to their length would cost more than their own forward.
_MAX_BATCHED_COMMIT = 16


def _run_rows(drafters: list[Eagle3Drafter], tokens: list[torch.Tensor], feats: list[torch.Tensor],
              starts: list[int]) -> torch.Tensor:
    """Row i: tokens [n_i], features [n_i, H] written at slots starts[i].. of drafter i's cache (positions =
    slots) -> layer outputs [B, max n_i, H] (padding rows after n_i)."""
    first = drafters[0]
    lens = [int(t.shape[0]) for t in tokens]
    b, q, dev = len(tokens), max(lens), first.device
    ids = torch.zeros(b, q, dtype=torch.long, device=dev)
    f = torch.zeros(b, q, feats[0].shape[-1], dtype=first.dtype, device=dev)
    pos = torch.zeros(b, q, dtype=torch.long, device=dev)
    for i, (t, x, start, n) in enumerate(zip(tokens, feats, starts, lens, strict=True)):
        ids[i, :n], f[i, :n] = t, x
        pos[i, :n] = torch.arange(start, start + n, device=dev)
    view = rows_view([d.kv for d in drafters], starts, lens, dev)
    return first.model(first._embed(ids), f, pos, view)


def _propose_chains(drafters: list[Eagle3Drafter], roots: list[int], steps: list[int]) -> list[DraftTree]:
    """`Eagle3Drafter._chain` for B requests at once: the same drafts, one forward per step for all."""
    first, b = drafters[0], len(drafters)
    model = first.model
    feat: list[torch.Tensor] = [torch.empty(0)] * b  # [H] current feature of each row
    short: list[int] = []
    for i, (d, root) in enumerate(zip(drafters, roots, strict=True)):
        assert d._pending_hidden is not None, "propose() must follow prefill() or accept()"
        if sum(int(h.shape[0]) for h in d._pending_hidden) > _MAX_BATCHED_COMMIT:
            feat[i] = d._commit(root)[0]
        else:
            short.append(i)
    if short:
        inputs = [drafters[i]._pending_inputs(roots[i]) for i in short]
        out = _run_rows([drafters[i] for i in short], [t for t, _ in inputs], [x for _, x in inputs],
                        [drafters[i].committed for i in short])
        for row, (i, (t, _)) in enumerate(zip(short, inputs, strict=True)):
            n = int(t.shape[0])
            feat[i] = out[row, n - 1]
            drafters[i]._mark_committed(n, roots[i])
    drafts: list[list[torch.Tensor]] = [[] for _ in range(b)]  # [1] each, kept on the device
    rows: list[list[torch.Tensor]] = [[] for _ in range(b)]
    active = list(range(b))
    logits = model.draft_logits(torch.stack(feat))  # [B, Vd]
    for depth in range(1, max(steps) + 1):
        for row, i in enumerate(active):
            drafts[i].append(drafters[i]._pick(logits[row:row + 1], rows[i]))
        active = [i for i in active if steps[i] > depth]
        if not active:
            break
        slots = [drafters[i].committed + depth - 1 for i in active]  # a depth-d entry sits at base + d - 1
        out = _run_rows([drafters[i] for i in active], [drafts[i][-1] for i in active],
                        [feat[i][None] for i in active], slots)
        for row, i in enumerate(active):
            feat[i] = out[row, 0]
        logits = model.draft_logits(out[:, 0])
    return [_chain_tree(root, d, r) for root, d, r in zip(roots, drafts, rows, strict=True)]


def _chain_tree(root: int, drafts: list[torch.Tensor], rows: list[torch.Tensor]) -> DraftTree:
    """A drafted chain: tokens [1] each; `rows` the sampled drafts' distributions [V] (empty when greedy)."""
    probs = torch.stack([torch.zeros_like(rows[0]), *rows]) if rows else None  # [N+1, V]
    return DraftTree.chain(root, torch.cat(drafts), probs)
