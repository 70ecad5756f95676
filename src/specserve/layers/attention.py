"""Scaled dot-product attention over keys/values that a KV view returns."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q [B, Hq, Q, D], k/v [B, Hkv, K, D], mask [B|1, 1, Q, K] bool or None -> [B, Hq, Q, D].

    Grouped-query attention is passed to SDPA as such (no copies of K/V per query group).
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
