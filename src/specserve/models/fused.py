"""A quantized decoder layer on the CPU in five kernel calls, for the engine's default (eager) steps.

Unfused, a layer makes about forty small PyTorch calls (norms, views, RoPE, KV writes, SiLU, adds), each paying
Python and dispatcher time that at one row costs as much as the products themselves. `FusedLayer` holds the
layer's packed weights and calls the extension directly:

  qkv  = qlinear(x, norm=input_layernorm)              RMSNorm + product + bias
  attn = attend_paged(qkv, cos, sin, cache, slots)     RoPE + KV write + attention in place on the paged cache
  x    = qlinear(attn, residual=x)                     o_proj + residual
  gu   = qlinear(x, norm=post_attention_layernorm)     RMSNorm + gate/up
  x    = qlinear(gu, silu_mul, residual=x)             SiLU-mul + down + residual

Every call is row-invariant (`layers/csrc`), so speculative verification stays exact. Off the paged cache
(drafter and test caches) or under torch.compile (whose graphs must see the cache writes), attention runs
unfused; it computes the same bits (tests/unit/test_qkernel.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.kv.paged import PagedView
from specserve.kv.view import KVView
from specserve.layers.attention import attend_paged
from specserve.layers.norm import RMSNorm
from specserve.layers.qkernel import kernel_loaded
from specserve.layers.quant import NONE, NORM, SILU_MUL, QuantLinear

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, KVView | None, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True, eq=False)
class Projection:
    """One QuantLinear's arguments to `specserve_q::qlinear`, read once."""

    args: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]  # w, d, m, corr, kind, n_out
    bias: torch.Tensor | None

    @classmethod
    def of(cls, lin: QuantLinear) -> Projection:
        return cls((lin.w, lin.d, lin.m, lin.corr, lin.code, lin.out_features), lin.bias)

    def __call__(self, x: torch.Tensor, prologue: int = NONE, norm: tuple[torch.Tensor, float] | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        w, eps = norm if norm is not None else (None, 0.0)
        return torch.ops.specserve_q.qlinear(x, *self.args, prologue, w, eps, self.bias, residual)


@dataclass(frozen=True, eq=False)
class FusedLayer:
    """A decoder layer's kernel calls. `attend` is the layer's unfused attention (from the q/k/v projection's
    output [B, Q, (Hq + 2 Hkv) D] to [B, Q, Hq D]), for caches other than the paged one."""

    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    attn_norm: tuple[torch.Tensor, float]
    mlp_norm: tuple[torch.Tensor, float]
    heads: tuple[int, int, float]  # Hq, Hkv, softmax scale
    paged: bool  # whether attention may run on the paged cache in one call (`DecoderLayer.paged_attention_fuses`)
    attend: Attend

    @staticmethod
    def build(projections: tuple[torch.nn.Module, ...], norms: tuple[RMSNorm, RMSNorm], heads: tuple[int, int, float],
              paged: bool, attend: Attend) -> FusedLayer | None:
        """The plan for projections (qkv, o, gate_up, down) and norms (input, post-attention); None unless all four
        are int4/int8 on the kernel and the norms' weights float32."""
        if not (kernel_loaded() and all(isinstance(p, QuantLinear) and p.kernel for p in projections)
                and all(n.weight.dtype == torch.float32 for n in norms)):
            return None
        qkv, o, gate_up, down = (Projection.of(p) for p in projections if isinstance(p, QuantLinear))
        return FusedLayer(qkv, o, gate_up, down, (norms[0].weight.detach(), norms[0].eps),
                          (norms[1].weight.detach(), norms[1].eps), heads, paged, attend)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, kv: KVView | None,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, Q, H] float32 -> [B, Q, H]; cos/sin [B, 1, Q, rot]."""
        b, q_len, hidden = x.shape
        x2 = x.reshape(-1, hidden)  # [T, H]
        qkv = self.qkv(x2, NORM, self.attn_norm)  # [T, (Hq + 2 Hkv) D]
        if (self.paged and isinstance(kv, PagedView) and kv.cache.k[layer].dtype == torch.float32
                and not torch.compiler.is_compiling()):
            rot = cos.shape[-1]
            out = attend_paged(qkv, cos.reshape(-1, rot), sin.reshape(-1, rot), kv.cache.k[layer], kv.cache.v[layer],
                               kv.write_slots, kv.read_slots, kv.mask, kv.pack, *self.heads)
        else:
            out = self.attend(qkv.view(b, q_len, -1), cos, sin, layer, kv, mask).reshape(x2.shape[0], -1)
        x2 = self.o(out, residual=x2)
        h = self.gate_up(x2, NORM, self.mlp_norm)  # [T, 2 I]
        return self.down(h, SILU_MUL, residual=x2).view(b, q_len, hidden)


@dataclass(frozen=True, eq=False)
class FusedStack:
    """Every decoder layer's kernel calls in one call from Python (`specserve_q::decoder_stack`,
    `layers/csrc/layers.cpp`), for forwards on the paged cache: the same operators and bits as the layers' own
    `FusedLayer` calls, without a Python round trip per call."""

    layers: tuple[FusedLayer, ...]  # what this was read from: stale once a layer's plan changes
    w: list[torch.Tensor]  # per layer, per projection: w, d, m, corr
    bias: list[torch.Tensor | None]
    kinds: list[int]
    n_out: list[int]
    norms: list[torch.Tensor]
    eps: list[float]
    heads: tuple[int, int, float]

    @staticmethod
    def build(layers: tuple[FusedLayer, ...]) -> FusedStack | None:
        """None unless every layer runs its attention on the paged cache."""
        if not layers or not all(f.paged for f in layers):
            return None
        projs = [p for f in layers for p in (f.qkv, f.o, f.gate_up, f.down)]
        return FusedStack(layers, [t for p in projs for t in p.args[:4]], [p.bias for p in projs],
                          [p.args[4] for p in projs], [p.args[5] for p in projs],
                          [n[0] for f in layers for n in (f.attn_norm, f.mlp_norm)],
                          [n[1] for f in layers for n in (f.attn_norm, f.mlp_norm)], layers[0].heads)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: PagedView,
                 capture: tuple[int, ...]) -> list[torch.Tensor]:
        """x [B, Q, H] float32 -> [x after the last layer, then after each layer of `capture` (0 = x itself)],
        each [B, Q, H]; cos/sin [B, 1, Q, rot]."""
        shape, rot = x.shape, cos.shape[-1]
        out = torch.ops.specserve_q.decoder_stack(
            x.reshape(-1, shape[-1]), self.w, self.bias, self.kinds, self.n_out, self.norms, self.eps,
            cos.reshape(-1, rot), sin.reshape(-1, rot), kv.cache.k, kv.cache.v, kv.write_slots, kv.read_slots,
            kv.mask, kv.pack, *self.heads, sorted(capture))
        return [t.view(shape) for t in out]
