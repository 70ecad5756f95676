"""Weight-only quantized projections for the CPU: int4 (Q4_1 blocks) and int8 (Q8_0 blocks), one kernel for
every width.

`QuantLinear` multiplies through `specserve_q::qmatmul` (`layers/qkernel.py`, `layers/csrc/qmatmul.cpp`):
activations are quantized per row and block of 32 to int8 and each block's dot product is an exact integer sum,
so a weight tile is unpacked once for all rows and a row's result does not depend on how many rows are
multiplied with it (row invariance: a verify of 16 tokens gives each token the logits a one-token step would).
A GGUF's Q4_0/Q4_1 and Q8_0 blocks are taken as stored. Where the kernel cannot be built, the same blocked
product runs in PyTorch (`qkernel.reference_qmatmul`).

Activations stay in the model's dtype (float32 by default); the kernel reads float32 and writes float32.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.layers import qkernel as qk

GROUP = qk.BLOCK
NONE, NORM, SILU_MUL = 0, 1, 2  # `specserve_q::qlinear` prologues (csrc/qmatmul.cpp, models/fused.py)


def quantize_q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float [N, K] weight -> Q4_1-style blocks (q [N, K] uint8, d, m [N, K/32]): per group of 32, m = min,
    d = (max - min) / 15, q = round((w - m) / d). For weights that arrive unquantized."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / 15.0
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = ((g - lo[..., None]) / safe[..., None]).round().clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), d, lo


class QuantLinear(nn.Module):
    """y = x W^T + b with W in int4 (Q4_1) or int8 (Q8_0) blocks of 32 along K. Built by `from_int4`,
    `from_q8` or `from_int8`; inference only."""

    def __init__(self, packed: qk.PackedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.kind, self.in_features, self.out_features = packed.kind, packed.k, packed.n
        self.code = qk.KINDS[packed.kind]
        self.w: torch.Tensor
        self.d: torch.Tensor
        self.m: torch.Tensor
        self.corr: torch.Tensor
        for name in ("w", "d", "m", "corr"):
            self.register_buffer(name, getattr(packed, name))
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.kernel = qk.load_kernel()  # False: the PyTorch fallback

    @classmethod
    def from_int4(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None) -> QuantLinear:
        """Blocks w = d * q + m: q [N, K] in 0..15, d and m [N, K/32]."""
        _check_k(q.shape)
        return cls(qk.pack_q4(q, d, m), bias)

    @classmethod
    def from_q8(cls, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None) -> QuantLinear:
        """Blocks w = d * q: q [N, K] int8, d [N, K/32]."""
        _check_k(q.shape)
        return cls(qk.pack_q8(q, d), bias)

    @classmethod
    def from_int8(cls, w: torch.Tensor, bias: torch.Tensor | None) -> QuantLinear:
        """A float [N, K] weight, cut into Q8_0 blocks (per block of 32: d = amax / 127)."""
        _check_k(w.shape)
        return cls.from_q8(*qk.quantize_q8(w.detach()), bias)

    def packed(self) -> qk.PackedWeight:
        return qk.PackedWeight(self.kind, self.out_features, self.w, self.d, self.m, self.corr)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        xf = x.reshape(-1, self.in_features).float()  # [M, K]
        if self.kernel:
            y = torch.ops.specserve_q.qmatmul(xf, self.w, self.d, self.m, self.corr, self.code, 0)
            if y.shape[1] != self.out_features:
                y = y[:, : self.out_features]
        else:
            y = qk.reference_qmatmul(xf, self.packed())
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.kind}, in={self.in_features}, out={self.out_features}, kernel={self.kernel}"


class QuantHead(QuantLinear):
    """An LM head multiplying in int8 (Q8_0) blocks that still holds the float `weight` it was made from (in a
    tied model the embedding's), which drafters and profiles read."""

    def __init__(self, packed: qk.PackedWeight, weight: nn.Parameter) -> None:
        super().__init__(packed, None)
        self.weight = weight


def _check_k(shape: torch.Size) -> None:
    if shape[1] % GROUP:
        raise ValueError(f"int4/int8 need K a multiple of {GROUP}, got {list(shape)}: use --quantization none")
