"""`KVView`: what one forward's attention may touch of a KV cache, the one interface every model reads.

A view takes the forward's new keys and values for a layer and returns everything its queries attend over,
with `mask` saying which of those each query sees. Implementations: `ContiguousView` (a per-sequence cache:
drafters, test oracles), `PagedView` (the engine's paged pool), `RowsView` (per-request drafter caches in one
batched forward), and training's `UnrolledKV`. A packed paged forward runs its tokens as one [1, T] sequence:
`to_grid` / `from_grid` lay queries out on the per-row grid attention runs on, and back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class KVView(ABC):
    mask: torch.Tensor | None  # [B, 1, Q, K] bool (True = attend), None = attend to all K

    @abstractmethod
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This forward's k, v [B, Hkv, Q, D] of `layer` -> the keys/values its queries attend over [B, Hkv, K, D]."""

    def to_grid(self, q: torch.Tensor) -> torch.Tensor:
        """Queries as the forward computed them -> [B, Hq, Q, D] (the same tensor unless packed)."""
        return q

    def from_grid(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's output [B, Hq, Q, D] -> the forward's layout (the same tensor unless packed)."""
        return out
