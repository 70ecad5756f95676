"""RMSNorm as the Llama family computes it (in float32, scaled after casting back)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., R, D] with a weight per row [R, D] (e.g. q and k heads normed in one call)."""
    if x.dtype == torch.float32:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=eps) * weight
    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight
