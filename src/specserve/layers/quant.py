"""Weight-only quantized projections for the CPU: int4 (group 32) and int8 (per channel), with a bf16 wide path.

The int4 kernel (`aten._weight_int4pack_mm_for_cpu`, bf16 activations) dequantizes w = (q - 8) * scale + zero per
group of 32 along K, so llama.cpp's Q4_1 blocks (w = d * q + m) map exactly: scale = d, zero = m + 8 d. It reads
a quarter of bf16's bytes, which is what a one-row decode step is bound by, but its cost grows with every row it
multiplies; a oneDNN bf16 product on pre-packed weights costs nearly the same for 1 and 16 rows. So each layer
multiplies products of fewer than `wide_rows` rows with the narrow kernel and wider ones (verifies, batches) in
bf16 (`bf16_linear`): the crossover on this project's CPU is measured by `benchmarks/real_target.py`
(docs/real-target.md).

Activations stay in the model's dtype (float32 by default); each product casts its input to bf16 and its
output back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GROUP = 32
#: products of this many rows or more take the bf16 path, per narrow kernel (the crossovers measured by
#: benchmarks/real_target.py's `kernel_ms_30_layers`: docs/real-target.md)
WIDE_ROWS = {"int4": 9, "int8": 6}


PACKED = "_specserve_mkldnn"  # the attribute of a bf16 weight tensor that holds its oneDNN-packed copy
#: products of up to this many rows run at their own height; taller ones are padded (`padded_rows`)
EXACT_ROWS = 16


def padded_rows(m: int) -> int:
    """The height a product of `m` rows runs at: m itself up to EXACT_ROWS, above that m rounded up to one of 8
    heights per octave (at most 12.5% more rows). oneDNN keeps a primitive (~0.6 MB of JIT code and
    descriptors here) per product shape in a cache of 1024 by default, and prefill chunks come in every length:
    without the bound a server's memory grows with each new prompt length (docs/real-target.md)."""
    if m <= EXACT_ROWS:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


def attach_packed(w: torch.Tensor) -> torch.Tensor:
    """Give a bf16 [N, K] CPU weight its oneDNN-packed copy (read by `bf16_linear`); returns `w`."""
    if w.device.type == "cpu" and torch.backends.mkldnn.is_available():
        setattr(w, PACKED, torch.ops.mkldnn._reorder_linear_weight(w, 16))
    return w


def _bf16_linear_impl(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    packed = getattr(weight, PACKED, None)
    if packed is None:
        return F.linear(x, weight)
    m = x.shape[0]
    if (rows := padded_rows(m)) != m:
        x = F.pad(x, (0, 0, 0, rows - m))  # [rows, K]
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")[:m]


def _bf16_linear_shape(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


# An opaque op, registered with the dispatcher directly (a `custom_op` wrapper cost ~9 us a call, this ~3 us): a
# compiled step cannot hold oneDNN's packed tensors, and its own bf16 product ran at half the packed one's speed
# here; called with the weight tensor itself, the op finds the packed copy in compiled steps too.
if not hasattr(torch.ops.specserve, "bf16_linear"):
    torch.library.define("specserve::bf16_linear", "(Tensor x, Tensor weight) -> Tensor")
    torch.library.impl("specserve::bf16_linear", "CPU", _bf16_linear_impl)
    torch.library.register_fake("specserve::bf16_linear", _bf16_linear_shape)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 times weight [N, K] bf16 -> [M, N], through the weight's oneDNN-packed copy when it has one
    (`attach_packed`)."""
    return torch.ops.specserve.bf16_linear(x, weight)


def _as_input(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A product y [M, N] back to x's dtype and leading shape [..., N], plus the bias."""
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y.view(*x.shape[:-1], y.shape[-1])


def pack_int4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks w = d * q + m (q [N, K] in 0..15, d and m [N, K/32]) -> (packed weight, scales_and_zeros
    [K/32, N, 2] bf16) for `_weight_int4pack_mm_for_cpu`."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    zeros = m + 8.0 * d
    sz = torch.stack([d.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, sz


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
    """y = x W^T + b with W stored int4 (group 32) or int8 (per channel) for narrow products and bf16 for wide
    ones (`WIDE_ROWS`). Built by `from_int4` / `from_int8`; inference only."""

    def __init__(self, kind: str, in_features: int, out_features: int, dense: torch.Tensor,
                 bias: torch.Tensor | None, wide_rows: int | None = None) -> None:
        super().__init__()
        self.kind, self.in_features, self.out_features = kind, in_features, out_features
        self.wide_rows = WIDE_ROWS[kind] if wide_rows is None else wide_rows
        self.dense_weight: torch.Tensor
        self.register_buffer("dense_weight", dense.to(torch.bfloat16).contiguous(), persistent=False)  # [N, K]
        attach_packed(self.dense_weight)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.packed: torch.Tensor
        self.scales: torch.Tensor

    @classmethod
    def from_int4(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None,
                  wide_rows: int | None = None) -> QuantLinear:
        """Blocks w = d * q + m: q [N, K] in 0..15, d and m [N, K/32]."""
        n, k = q.shape
        if k % GROUP:
            raise ValueError(f"int4 needs K a multiple of {GROUP}, got [{n}, {k}]: use --quantization none")
        dense = (q.view(n, k // GROUP, GROUP).float() * d[..., None] + m[..., None]).reshape(n, k)
        mod = cls("int4", k, n, dense, bias, wide_rows)
        packed, sz = pack_int4(q, d, m)
        mod.register_buffer("packed", packed)
        mod.register_buffer("scales", sz)
        return mod

    @classmethod
    def from_int8(cls, w: torch.Tensor, bias: torch.Tensor | None, wide_rows: int | None = None) -> QuantLinear:
        """A float [N, K] weight, quantized symmetrically per output channel."""
        n, k = w.shape
        scale = (w.float().abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [N]
        q = (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        mod = cls("int8", k, n, q.float() * scale[:, None], bias, wide_rows)
        mod.register_buffer("packed", q.contiguous())
        mod.register_buffer("scales", scale.to(torch.bfloat16))
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        xb = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, K]
        if xb.shape[0] >= self.wide_rows:
            y = bf16_linear(xb, self.dense_weight)
        elif self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(xb, self.packed, self.scales)
        return _as_input(y, x, self.bias)

    def extra_repr(self) -> str:
        return f"{self.kind}, in={self.in_features}, out={self.out_features}, wide_rows={self.wide_rows}"


class BF16Head(nn.Linear):
    """An LM head (an `nn.Linear` keeping its float weight, tied to the embedding where the model ties them) that
    multiplies in bf16 with oneDNN's packed weight: at 1 and 16 rows ~4x and ~6x faster than float32 here."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.dense_weight: torch.Tensor
        self.register_buffer("dense_weight", linear.weight.detach().to(torch.bfloat16).contiguous(),
                             persistent=False)
        attach_packed(self.dense_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., V] in x's dtype."""
        xb = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, H]
        return _as_input(bf16_linear(xb, self.dense_weight), x, self.bias)
