"""Scaled dot-product attention over keys/values that a KV view returns."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q [B, Hq, Q, D], k/v [B, Hkv, K, D], mask [B|1, 1, Q, K] bool or None -> [B, Hq, Q, D]."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
