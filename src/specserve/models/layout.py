"""The in-memory layout of projection weights for inference on CPU.

`nn.Linear` keeps its weight [N, K] row-major, and `F.linear` multiplies by its transpose. On this project's CPU
(PyTorch 2.13, MKL/oneDNN fp32) that product is slow for the few-row inputs speculative decoding verifies: measured
per projection shape of the demo target on 2 threads, a 17-row product ran 1.2-2.7x faster when the same values
are stored column-major (the transpose contiguous; down 2.7x, qkv 1.8x, o 1.7x, gate/up 1.2x), a one-row product
1.05-1.37x, 160-row ones alike (1.00-1.05x). Only the storage order changes: every weight keeps its shape, dtype,
values and parameter name, so state dicts and checkpoints read the same.

The LM head (wide: [V, H], V = 8192, or a drafter's 4096) depends on the row count: measured at 1-256 rows,
column-major ran 1.3-1.95x faster for 4-32 rows (the rows a DFlash block drafts, an n-gram or DDTree verify, a
batch of 16 plain decodes), 0.85-0.95x for 2-3 rows (as every projection: 0.80-0.99x), 1.0-1.1x at one row and at
64-256 rows. In the engine, where the weight is not hot in cache, less: a DFLASH c=1 step's 15-row drafting product
2.06 -> 1.59 ms, its 17-row verify product 1.38 -> 1.35 ms (profiled, medians of 4 blocks of 15 steps). And in tied
models the table is also the token embedding, whose lookups want rows. So `two_layout_heads` keeps the head's
weight as it is and adds a column-major copy (a non-persistent buffer: the state dict is unchanged) used for
products of `FEW_ROWS` rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FEW_ROWS = range(4, 64)  # row counts whose head product reads the column-major copy


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


class TwoLayoutLinear(nn.Linear):
    """An `nn.Linear` (the same weight and bias parameters, the same state dict) that also keeps its weight
    column-major for products of `FEW_ROWS` rows. For inference: the copy is taken once, so a weight changed
    afterwards (training) would leave it stale."""

    weight_cm: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # shared, also with a tied embedding
        self.bias = linear.bias
        self.register_buffer("weight_cm", linear.weight.detach().t().contiguous().t(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N]."""
        rows = x.numel() // self.in_features
        few = FEW_ROWS.start <= rows < FEW_ROWS.stop  # (not `in`: a compiled step sees a symbolic row count)
        return F.linear(x, self.weight_cm if few else self.weight, self.bias)


def two_layout_heads(model: nn.Module, names: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace every `nn.Linear` of `model` whose name ends with one of `names` by a `TwoLayoutLinear` over the
    same parameters; returns how many were replaced (0 for heads replaced already)."""
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and not isinstance(m, TwoLayoutLinear) and name.split(".")[-1] in names]
    for name, module in found:
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        setattr(parent, name.rpartition(".")[2], TwoLayoutLinear(module))
    return len(found)
