"""A contiguous per-sequence KV cache (offline decoding and speculative verification).

Slots are cache indices; they differ from RoPE positions inside a verified tree,
where nodes sit in consecutive slots but share positions by depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.config import ModelConfig
from specserve.kv.view import KVView


@dataclass(frozen=True)
class ContiguousView(KVView):
    """What one forward may touch: write `q_len` new entries at slot `start`, read slots [0, start+q_len)."""

    cache: ContiguousKVCache
    start: int
    q_len: int
    mask: torch.Tensor | None  # [B, 1, Q, start+Q] bool (True = attend), None = attend to all

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, Hkv, Q, D] -> all keys/values visible to this forward [B, Hkv, start+Q, D]."""
        end = self.start + self.q_len
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc[:, :, self.start:end] = k
        vc[:, :, self.start:end] = v
        return kc[:, :, :end], vc[:, :, :end]


class ContiguousKVCache:
    """Per-layer tensors [B, Hkv, S_max, D]; the caller tracks how many slots are valid."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        self.k = k
        self.v = v

    @classmethod
    def allocate(
        cls, cfg: ModelConfig, batch: int, max_len: int, device: torch.device, dtype: torch.dtype,
        num_layers: int | None = None,
    ) -> ContiguousKVCache:
        layers = cfg.num_hidden_layers if num_layers is None else num_layers
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        return cls(k, v)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def view(self, start: int, q_len: int, mask: torch.Tensor | None = None, causal: bool = True) -> ContiguousView:
        """A view for `q_len` new tokens at slot `start`.

        With no mask given and `causal`, new tokens attend to the whole prefix and causally
        among themselves (no mask is built for a single token).
        """
        if start + q_len > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} slots; {start + q_len} needed")
        if mask is None and causal and q_len > 1:
            mask = causal_mask(start, q_len, self.k[0].device)
        return ContiguousView(self, start, q_len, mask)

    def move(self, src: torch.Tensor, dst_start: int) -> None:
        """Copy slots `src` [n] (ascending, each >= dst_start) to dst_start..dst_start+n-1, every layer."""
        n = src.numel()
        if n == 0:
            return
        for kc, vc in zip(self.k, self.v, strict=True):
            kc[:, :, dst_start:dst_start + n] = kc[:, :, src]
            vc[:, :, dst_start:dst_start + n] = vc[:, :, src]


def causal_mask(start: int, q_len: int, device: torch.device) -> torch.Tensor:
    """[1, 1, Q, start+Q] bool: query i sees slots <= start+i."""
    q = torch.arange(q_len, device=device)[:, None] + start
    k = torch.arange(start + q_len, device=device)[None, :]
    return (k <= q)[None, None]
