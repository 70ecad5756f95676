"""A KV view over B rows that each keep their own contiguous cache (batch 1), for batched drafting.

Per-request drafters (EAGLE-3) own a small one-layer `ContiguousKVCache` each. To run one drafter forward for all
requests of an engine step, `RowsView` writes each row's new K/V into that row's cache and hands attention
the rows' keys and values padded to the longest, with a mask: row i's query j sees its slots
[0, starts[i] + j]; padding queries (j >= q_lens[i]) see slot 0 only, so no row of the softmax is empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kv.contiguous import ContiguousKVCache
from specserve.kv.view import KVView


@dataclass(frozen=True)
class RowsView(KVView):
    caches: list[ContiguousKVCache]  # [B], each with batch 1
    starts: list[int]  # [B] slot of each row's first new token
    q_lens: list[int]  # [B] new tokens of each row (<= Q)
    mask: torch.Tensor  # [B, 1, Q, K] bool, K = max(starts[i] + q_lens[i])

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, Hkv, Q, D] -> keys/values [B, Hkv, K, D] (each row's cache, zero-padded)."""
        b, h, _, d = k.shape
        length = self.mask.shape[-1]
        keys = k.new_zeros(b, h, length, d)
        values = v.new_zeros(b, h, length, d)
        for i, (cache, start, q) in enumerate(zip(self.caches, self.starts, self.q_lens, strict=True)):
            kc, vc = cache.k[layer], cache.v[layer]
            kc[0, :, start:start + q] = k[i, :, :q]
            vc[0, :, start:start + q] = v[i, :, :q]
            keys[i, :, :start + q] = kc[0, :, :start + q]
            values[i, :, :start + q] = vc[0, :, :start + q]
        return keys, values


def rows_view(caches: list[ContiguousKVCache], starts: list[int], q_lens: list[int], device: torch.device) -> RowsView:
    for cache, start, q in zip(caches, starts, q_lens, strict=True):
        if start + q > cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} slots; {start + q} needed")
    width, length = max(q_lens), max(s + q for s, q in zip(starts, q_lens, strict=True))
    qi = torch.arange(width, device=device)[None, :, None]  # [1, Q, 1]
    kj = torch.arange(length, device=device)[None, None, :]  # [1, 1, K]
    s = torch.tensor(starts, device=device)[:, None, None]  # [B, 1, 1]
    ql = torch.tensor(q_lens, device=device)[:, None, None]
    real = qi < ql
    mask = (real & (kj <= s + qi)) | (~real & (kj == 0))  # [B, Q, K]
    return RowsView(caches, starts, q_lens, mask[:, None])
