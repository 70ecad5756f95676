"""The in-memory layout of projection weights for inference on CPU.

`nn.Linear` keeps its weight [N, K] row-major, and `F.linear` multiplies by its transpose. On this project's CPU
(PyTorch 2.13, MKL/oneDNN fp32) that product is slow for the few-row inputs speculative decoding verifies: `python
benchmarks/linear_layout.py --threads 2` measures, per projection shape of the demo target, a 17-row product
1.2-2.7x faster when the same values are stored column-major (the transpose contiguous; down 2.7x, qkv 1.8x, o
1.7x, gate/up 1.2x), a one-row product 1.05-1.37x, 160-row ones alike (1.00-1.05x). Only the storage order changes:
every weight keeps its shape, dtype, values and parameter name, so state dicts and checkpoints read the same. The
LM head is left row-major: it shares its table with the token embedding in tied models, and its wide product gained
nothing (0.99-1.00x).
"""

from __future__ import annotations

import torch
from torch import nn


def column_major_projections(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Store every `nn.Linear` weight of `model` column-major, except modules whose name ends with one of
    `skip`; returns how many were changed. A no-op for weights already stored that way."""
    changed = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear) or name.split(".")[-1] in skip:
                continue
            w = module.weight
            if w.dim() == 2 and w.stride() != (1, w.shape[0]):
                w.data = w.data.t().contiguous().t()  # [N, K] with strides (1, N)
                changed += 1
    return changed
