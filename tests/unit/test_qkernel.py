"""The CPU kernels (`layers/csrc`): products against dequantize-then-matmul, every path this machine runs bit
for bit against the scalar one, and row invariance (a row's result alone equals its result among many rows)
for the products, the PyTorch fallback and attention, including a tree verify's scattered keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.config import RopeConfig
from specserve.layers import qkernel as qk
from specserve.layers.attention import attend, attend_paged
from specserve.layers.norm import RMSNorm
from specserve.layers.quant import NONE, NORM, SILU_MUL, QuantLinear, quantize_q4
from specserve.layers.rope import RotaryEmbedding, apply_rope
from specserve.models.fused import Projection

WIDTHS = (1, 2, 5, 8, 9, 16, 33, 64)
needs_kernel = pytest.mark.skipif(not qk.load_kernel(), reason="no C++ compiler: the PyTorch fallback only")


def _packed(kind: str, n: int = 40, k: int = 96, seed: int = 0) -> tuple[qk.PackedWeight, torch.Tensor]:
    torch.manual_seed(seed)
    w = torch.randn(n, k) * 0.1
    p = qk.pack_q4(*quantize_q4(w)) if kind == "int4" else qk.pack_q8(*qk.quantize_q8(w))
    return p, w


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_packing_round_trips_the_blocks(kind: str) -> None:
    p, w = _packed(kind)
    deq = qk.unpack(p)
    assert deq.shape == w.shape
    step = (w.reshape(40, -1, 32).amax(-1) - w.reshape(40, -1, 32).amin(-1)).max()
    assert (deq - w).abs().max() <= step / (15 if kind == "int4" else 127)  # within one level of the block


@needs_kernel
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_kernel_matches_dequantize_then_matmul(kind: str) -> None:
    p, _ = _packed(kind)
    x = torch.randn(9, 96)
    ref = x @ qk.unpack(p).t()
    got = qk.qmatmul(x, p)
    assert got.shape == (9, 40)
    assert (got - ref).abs().max() < 0.02 * ref.abs().max()  # int8 activations: ~1/254 of each block's range
    assert torch.allclose(got, qk.reference_qmatmul(x, p), rtol=1e-4, atol=1e-4)  # the same integers


@needs_kernel
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_every_path_gives_the_scalar_paths_bits(kind: str) -> None:
    paths = qk.kernel_paths()
    assert "scalar" in paths
    p, _ = _packed(kind, n=48, k=128, seed=1)
    x = torch.randn(19, 128)
    ref = qk.qmatmul(x, p, "scalar")
    for path in paths:
        assert torch.equal(qk.qmatmul(x, p, path), ref), path


@needs_kernel
def test_every_path_takes_the_full_int8_range() -> None:
    """Q8_0 blocks may hold -128 (a file's quantizer need not clamp to +-127): no path may saturate on it."""
    torch.manual_seed(5)
    q = torch.randint(-128, 128, (32, 96), dtype=torch.int8)
    q[:, :32] = -128  # whole blocks of the extreme value, against activations of either sign
    p = qk.pack_q8(q, torch.rand(32, 3) * 0.01 + 0.001)
    x = torch.randn(7, 96) * 4
    ref = qk.reference_qmatmul(x, p)
    for path in qk.kernel_paths():
        got = qk.qmatmul(x, p, path)
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), path
        assert torch.equal(got, qk.qmatmul(x, p, "scalar")), path


@needs_kernel
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_kernel_rows_are_invariant_to_the_width(kind: str) -> None:
    p, _ = _packed(kind, n=56, k=64, seed=2)
    x = torch.randn(max(WIDTHS), 64) * 3
    alone = torch.cat([qk.qmatmul(x[i:i + 1], p) for i in range(x.shape[0])])
    for width in WIDTHS:
        for path in qk.kernel_paths():
            assert torch.equal(qk.qmatmul(x[:width], p, path), alone[:width]), (width, path)


def test_fallback_rows_are_invariant_to_the_width() -> None:
    p, _ = _packed("int4", seed=3)
    x = torch.randn(max(WIDTHS), 96)
    alone = torch.cat([qk.reference_qmatmul(x[i:i + 1], p) for i in range(x.shape[0])])
    for width in WIDTHS:
        assert torch.equal(qk.reference_qmatmul(x[:width], p), alone[:width]), width


def test_quant_linear_without_the_kernel_runs_the_fallback() -> None:
    torch.manual_seed(4)
    lin = QuantLinear.from_int8(torch.randn(24, 64), torch.randn(24))
    lin.kernel = False
    x = torch.randn(3, 64)
    assert torch.equal(lin(x), qk.reference_qmatmul(x, lin.packed()) + lin.bias)


def _attention_case(q_len: int, k_len: int, seed: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    q = torch.randn(2, 6, q_len, 64)
    k, v = torch.randn(2, 2, k_len, 64), torch.randn(2, 2, k_len, 64)
    mask = torch.ones(2, 1, q_len, k_len, dtype=torch.bool)
    mask[:, :, :, k_len - q_len:] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    return q, k, v, mask


@needs_kernel
def test_attention_matches_sdpa() -> None:
    q, k, v, mask = _attention_case(7, 40, 5)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = attend(q, k, v, mask, 64**-0.5)
    assert torch.allclose(got, ref, atol=2e-6, rtol=1e-5)


@needs_kernel
def test_attention_row_alone_equals_the_row_in_a_verify() -> None:
    q, k, v, mask = _attention_case(16, 45, 6)
    many = attend(q, k, v, mask, 0.125)
    for i in range(16):
        keys = 45 - 16 + i + 1  # a one-token step sees its context and itself, no padding
        one = attend(q[:, :, i:i + 1], k[:, :, :keys], v[:, :, :keys], None, 0.125)
        assert torch.equal(one[:, :, 0], many[:, :, i]), i


@needs_kernel
def test_attention_ignores_where_the_admitted_keys_sit() -> None:
    """A tree verify: a node's ancestors lie among its siblings' slots; the compact sequence gives the same bits."""
    torch.manual_seed(7)
    q = torch.randn(1, 3, 1, 64)
    k, v = torch.randn(1, 1, 50, 64), torch.randn(1, 1, 50, 64)
    keep = torch.rand(50) < 0.5
    keep[0] = True
    mask = keep.view(1, 1, 1, 50)
    scattered = attend(q, k, v, mask, 0.125)
    compact = attend(q, k[:, :, keep], v[:, :, keep], None, 0.125)
    assert torch.equal(scattered, compact)


@needs_kernel
def test_attention_that_needs_gradients_gets_them() -> None:
    """Training a drafter backpropagates through attention: that runs SDPA (the row kernel has no backward)."""
    q, k, v, mask = _attention_case(4, 12, 8)
    q.requires_grad_(True)
    attend(q, k, v, mask, 0.125).sum().backward()
    ref_q = q.detach().clone().requires_grad_(True)
    F.scaled_dot_product_attention(ref_q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True).sum().backward()
    assert q.grad is not None and ref_q.grad is not None and q.grad.abs().sum() > 0
    assert torch.allclose(q.grad, ref_q.grad, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_qlinear_is_the_unfused_layer_steps(kind: str) -> None:
    """norm + product + bias + residual, and SiLU-mul + product, in one call: the product's bits where the input rows
    agree, and the norm within float rounding of PyTorch's."""
    torch.manual_seed(9)
    w = torch.randn(48, 64) * 0.1
    lin = QuantLinear.from_int8(w, torch.randn(48)) if kind == "int8" else QuantLinear.from_int4(
        *quantize_q4(w), torch.randn(48))
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.rand(64) + 0.5
    fused, by = Projection.of(lin), (norm.weight.detach(), norm.eps)
    x, res = torch.randn(7, 64) * 3, torch.randn(7, 48)
    assert torch.equal(fused(x, residual=res), res + lin(x))
    normed = torch.nn.functional.rms_norm(x, (64,), eps=1e-5) * norm.weight
    assert torch.allclose(fused(x, NORM, by), lin(normed), rtol=1e-3, atol=1e-3)
    gu = torch.randn(5, 128)
    act = (F.silu(gu[:, :64]) * gu[:, 64:]).contiguous()
    assert torch.allclose(fused(gu, SILU_MUL), lin(act), rtol=1e-3, atol=1e-3)
    with pytest.raises(RuntimeError, match="silu-mul takes x of 2K columns"):
        fused(x, SILU_MUL)


@needs_kernel
@pytest.mark.parametrize("prologue", [NONE, NORM, SILU_MUL])
def test_qlinear_rows_are_invariant_to_the_width(prologue: int) -> None:
    torch.manual_seed(10)
    fused = Projection.of(QuantLinear.from_int4(*quantize_q4(torch.randn(32, 64) * 0.1), None))
    norm = (torch.rand(64) + 0.5, 1e-6)
    x = torch.randn(max(WIDTHS), 128 if prologue == SILU_MUL else 64)
    res = torch.randn(max(WIDTHS), 32)
    alone = torch.cat([fused(x[i:i + 1], prologue, norm, res[i:i + 1]) for i in range(x.shape[0])])
    for width in WIDTHS:
        assert torch.equal(fused(x[:width], prologue, norm, res[:width]), alone[:width]), width


@needs_kernel
@pytest.mark.parametrize("packed", [False, True])
def test_paged_attention_is_the_unfused_attention_bit_for_bit(packed: bool) -> None:
    """RoPE, the KV write and attention over scattered slots in one call, against RoPE, `PagedView.update` and
    `attend`: the same cache contents and the same outputs, for rows of one length and for packed rows."""
    torch.manual_seed(11)
    hq, hkv, d, slots = 6, 2, 64, 80
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), d)
    qs, cs = ([3, 3], [5, 9]) if not packed else ([1, 4], [7, 2])
    free = torch.randperm(slots).tolist()
    rows, writes, positions = [], [], []
    for q, c in zip(qs, cs, strict=True):
        ctx, new = free[:c], free[c:c + q]
        free = free[c + q:]
        rows.append(ctx + new)
        writes += new
        positions += list(range(c, c + q))
    t, q_max, k_max = sum(qs), max(qs), max(len(r) for r in rows)
    read = torch.tensor([r + [slots] * (k_max - len(r)) for r in rows])  # padding keys point at the scratch slot
    mask = torch.zeros(2, 1, q_max, k_max, dtype=torch.bool)
    for b, (q, c) in enumerate(zip(qs, cs, strict=True)):
        mask[b, 0, :q, :c] = True
        mask[b, 0, :q, c:c + q] = torch.ones(q, q, dtype=torch.bool).tril()
        mask[b, 0, q:, 0] = True
    grid = torch.tensor([b * q_max + i for b, q in enumerate(qs) for i in range(q)]) if packed else None
    qkv = torch.randn(t, (hq + 2 * hkv) * d)
    pos = torch.tensor(positions)
    caches = [[torch.randn(slots + 1, hkv, d) for _ in range(2)] for _ in range(2)]
    caches[1] = [c.clone() for c in caches[0]]
    cos, sin = rotary.cos_sin(pos[None], torch.float32)  # [1, 1, T, D]
    got = attend_paged(qkv, cos[0, 0], sin[0, 0], *caches[0], torch.tensor(writes), read, mask, grid, hq, hkv,
                       d**-0.5)
    # unfused: per token, RoPE on its heads, the K/V written, attention over the gathered slots on the [B, Q] grid
    x = qkv.view(t, hq + 2 * hkv, d)
    qk_ = apply_rope(x[None, :, : hq + hkv].transpose(1, 2), cos, sin)[0].transpose(0, 1)  # [T, Hq+Hkv, D]
    kc, vc = caches[1]
    kc[torch.tensor(writes)] = qk_[:, hq:]
    vc[torch.tensor(writes)] = x[:, hq + hkv:]
    keys = kc[read].transpose(1, 2)  # [B, Hkv, K, D]
    values = vc[read].transpose(1, 2)
    at = grid if grid is not None else torch.arange(t)
    q_grid = torch.zeros(2 * q_max, hq, d)
    q_grid[at] = qk_[:, :hq]
    ref = attend(q_grid.view(2, q_max, hq, d).transpose(1, 2), keys, values, mask, d**-0.5)
    ref = ref.transpose(1, 2).reshape(2 * q_max, hq * d)[at]
    assert torch.equal(caches[0][0], kc) and torch.equal(caches[0][1], vc)
    assert torch.equal(got, ref)
