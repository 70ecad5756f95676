"""Paged KV storage: one tensor per layer, addressed by physical slot (block * block_size + offset).

`PagedKVCache` holds k/v `[num_slots + 1, Hkv, D]` per layer; the extra last slot is scratch, where padding
rows of a batch write so that every row of a padded forward has somewhere to go. Which slots a sequence
owns is `kv/block_pool.py`'s business; this file only moves tensors:

  PagedView    what one batched forward may touch: write new K/V at `write_slots`, read `read_slots`
  copy_slots   speculative compaction (accepted tree nodes to consecutive slots)
  read_block / write_block   the host tier's copies of whole blocks
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.config import ModelConfig


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, num_layers: int | None = None) -> None:
        layers = cfg.num_hidden_layers if num_layers is None else num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.scratch = self.num_slots  # padding rows write here
        shape = (self.num_slots + 1, cfg.num_key_value_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.device = device

    @staticmethod
    def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
        """Bytes of K and V of one block over all layers (sizes the pool and the host tier before allocating)."""
        layers = cfg.num_hidden_layers if num_layers is None else num_layers
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * layers * block_size * cfg.num_key_value_heads * cfg.head_dim * itemsize

    @property
    def bytes_per_block(self) -> int:
        t = self.k[0]
        return 2 * len(self.k) * self.block_size * t.shape[1] * t.shape[2] * t.element_size()

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the KV of slots `src` [n] to slots `dst` [n] in every layer (reads all before writing)."""
        if src.numel() == 0:
            return
        for kc, vc in zip(self.k, self.v, strict=True):
            kc[dst] = kc[src]
            vc[dst] = vc[src]

    def _block(self, block: int) -> slice:
        return slice(block * self.block_size, (block + 1) * self.block_size)

    def read_block(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one block's K and V in every layer: [L, block_size, Hkv, D] each."""
        s = self._block(block)
        return torch.stack([k[s] for k in self.k]), torch.stack([v[s] for v in self.v])

    def write_block(self, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        s = self._block(block)
        for i, (kc, vc) in enumerate(zip(self.k, self.v, strict=True)):
            kc[s] = k[i]
            vc[s] = v[i]


@dataclass(frozen=True)
class PagedView:
    """One padded batch of B rows with up to Q new tokens each.

    write_slots [B*Q] where each new token's K/V goes (padding -> scratch); read_slots [B, K] the slots each
    row attends over (its context, then its new tokens, then padding); mask [B, 1, Q, K] bool (True = attend),
    or None when every row attends to all of `read_slots` (a batch of one row without padding).
    """

    cache: PagedKVCache
    write_slots: torch.Tensor  # [B*Q] long
    read_slots: torch.Tensor  # [B, K] long
    mask: torch.Tensor | None  # [B, 1, Q, K] bool

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, Hkv, Q, D] -> keys/values each row attends over [B, Hkv, K, D]."""
        b, h, q, d = k.shape
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc[self.write_slots] = k.transpose(1, 2).reshape(b * q, h, d)
        vc[self.write_slots] = v.transpose(1, 2).reshape(b * q, h, d)
        keys = kc[self.read_slots].transpose(1, 2)  # [B, Hkv, K, D]
        values = vc[self.read_slots].transpose(1, 2)
        return keys, values
