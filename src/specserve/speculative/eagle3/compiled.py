"""A greedy EAGLE-3 chain round as one compiled graph: the commit of the pending pairs and every draft step.

Eager, a round of a 5-step chain is six one-layer forwards, five LM heads and argmaxes, dispatched op by op from
Python; at batch 1 on a CPU that costs about as much as the target's verify pass. Here the round is one
`torch.compile`d function per chain length S (one graph whatever the context length):
  commit  the n <= PAD pending pairs, padded to PAD tokens, at slots start.., causal (padding sits after the real
          pairs, so no real query sees it; the draft steps overwrite those slots before they read them)
  chain   S argmaxes; step d writes its entry at slot start + n + d - 1 and reads the slots before it (a mask
          over one fixed read of K slots: K, the cache prefix read, is the graph's one dynamic dimension)
Slots are tensors, never Python ints, so a new context length or pending count does not recompile. Sampled
rounds, trees and batched chains stay eager (`eagle3/drafter.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.kv.contiguous import ContiguousKVCache
from specserve.kv.view import KVView
from specserve.layers.compiled_fn import Compiled, CompiledFns, compile_named
from specserve.speculative.eagle3.model import Eagle3Model

PAD = 8  # pending pairs a compiled round commits (more: the round runs eager)



@dataclass(frozen=True)
class SlotView(KVView):
    """Write new K/V at `write` [Q] slots of a batch-1 contiguous cache; read its first K slots under `mask`."""

    k: torch.Tensor  # [1, Hkv, S_max, D]
    v: torch.Tensor
    write: torch.Tensor  # [Q] long
    k_len: int  # K (symbolic inside the graph)
    mask: torch.Tensor | None  # [1, 1, Q, K] bool

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k.index_copy_(2, self.write, k)
        self.v.index_copy_(2, self.write, v)
        return self.k[:, :, : self.k_len], self.v[:, :, : self.k_len]


class CompiledChains:
    """Compiled greedy chain rounds of one EAGLE-3 model, shared by its requests' drafters."""

    def __init__(self, model: Eagle3Model, embed: Callable[[torch.Tensor], torch.Tensor], max_steps: int) -> None:
        """`embed`: token ids -> embeddings in the drafter's dtype (its own table or the target's)."""
        self.model, self.embed, self.max_steps = model, embed, max_steps
        self._rounds: CompiledFns[int] = CompiledFns()  # by chain length
        weight = model.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        # the padded commit and the draft steps reach PAD + max_steps positions past the last real one
        model.rotary.reserve(model.config.layer.max_position_embeddings + PAD + max_steps, self.device)

    @property
    def compiled_fns(self) -> CompiledFns[int]:
        """Its compiled functions (`CompiledFns.lazy` is switched off while a background warm-up runs)."""
        return self._rounds

    @property
    def graphs(self) -> list[str]:
        """The chain lengths compiled so far, as /server_info reports them."""
        return [f"eagle3-chain-{s}" for s in sorted(self._rounds.ran)]

    def holds(self, steps: int, pending: int) -> bool:
        return 1 <= steps <= self.max_steps and 1 <= pending <= PAD and steps not in self._rounds.failed

    @staticmethod
    def slots_needed(start: int, steps: int) -> int:
        """Cache slots a round at `start` reads and writes (the padded commit and the draft entries)."""
        return start + PAD + steps - 1

    @torch.inference_mode()
    def warm(self, steps: int, target_hidden: int) -> None:
        """Compile the S = `steps` round now (at load) on a scratch cache."""
        cfg = self.model.config.layer
        cache = ContiguousKVCache.allocate(cfg, 1, self.slots_needed(2, steps), self.device, self.dtype, num_layers=1)
        hidden = torch.zeros(1, target_hidden, device=self.device, dtype=self.dtype)
        self.run(cache, [0], hidden, 2, steps, warming=True)

    @torch.inference_mode()
    def run(self, cache: ContiguousKVCache, tokens: list[int], hidden: torch.Tensor, start: int,
            steps: int, warming: bool = False) -> torch.Tensor | None:
        """tokens [n] the pending pairs' next tokens (the root last), hidden [n, 3·Ht] their captured target
        states, committed at slots start.. -> the S greedy drafts [S] (target ids), or None: run it eager."""
        n = len(tokens)
        assert self.holds(steps, n) and self.slots_needed(start, steps) <= cache.max_len
        dev = self.device
        ids = torch.zeros(1, PAD, dtype=torch.long, device=dev)
        ids[0, :n] = torch.tensor(tokens, device=dev)
        feats = torch.zeros(1, PAD, hidden.shape[-1], dtype=self.dtype, device=dev)
        feats[0, :n] = hidden.to(dev, self.dtype)
        read = torch.empty(self.slots_needed(start, steps), dtype=torch.long, device=dev)  # only its length counts
        counts = torch.tensor([start, n], device=dev)
        k, v = cache.k[0], cache.v[0]
        torch._dynamo.mark_dynamic(read, 0)
        torch._dynamo.mark_dynamic(k, 2)
        torch._dynamo.mark_dynamic(v, 2)
        return self._rounds.call(steps, lambda: self._compile(steps), f"the EAGLE-3 {steps}-step chain",
                                 ids, feats, counts, read, k, v, warming=warming)  # [S]

    def _compile(self, steps: int) -> Compiled:
        model, embed = self.model, self.embed

        def chain_round(ids: torch.Tensor, feats: torch.Tensor, counts: torch.Tensor, read: torch.Tensor,
                        k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            """ids [1, PAD], feats [1, PAD, 3·Ht], counts [start, n], read [K] -> drafts [S]."""
            k_len = read.shape[0]
            start, n = counts[0], counts[1]
            keys = torch.arange(k_len, device=ids.device)  # [K]
            pos = start + torch.arange(PAD, device=ids.device)  # [PAD] slots = positions
            mask = (keys[None, :] <= pos[:, None])[None, None]  # [1, 1, PAD, K]
            out = model(embed(ids), model.project(feats), pos[None], SlotView(k, v, pos, k_len, mask))
            feat = out.index_select(1, (n - 1)[None])  # [1, 1, H]
            drafts = []
            for d in range(steps):
                tok = model.target_ids(model.draft_logits(feat).argmax(dim=-1))  # [1, 1]
                drafts.append(tok[0])
                if d == steps - 1:
                    break
                slot = (start + n + d)[None]  # [1]
                step_mask = (keys <= slot)[None, None, None]  # [1, 1, 1, K]
                feat = model(embed(tok), feat, slot[None], SlotView(k, v, slot, k_len, step_mask))
            return torch.cat(drafts)

        return compile_named(chain_round, f"eagle3_chain_{steps}_{id(self):x}")
