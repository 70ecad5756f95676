"""GGUF block decoding against the `gguf` package's own reference, llama.cpp's q/k row permutation undone,
and the int4/int8 projections against their dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize as ref_quantize

from specserve.layers import qkernel as qk
from specserve.layers.quant import QuantHead, QuantLinear, quantize_q4
from specserve.models.gguf import unpermute_order
from specserve.models.gguf_quants import dequantize, q4_blocks
from tiny_gguf import llama_cpp_permute


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "F16", "BF16"])
def test_dequantize_matches_gguf_reference(kind: str) -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((24, 96)) * 0.1).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    raw = ref_quantize(w, qtype)
    ours = dequantize(raw, kind, (24, 96)).numpy()
    ref = ref_dequantize(raw, qtype).reshape(24, 96)
    np.testing.assert_array_equal(ours, ref)


def test_q4_blocks_are_the_stored_values() -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    for kind in ("Q4_0", "Q4_1"):
        raw = ref_quantize(w, GGMLQuantizationType[kind])
        b = q4_blocks(raw, kind, 8, 64)
        assert b.q.dtype == torch.uint8 and int(b.q.max()) <= 15
        np.testing.assert_array_equal(b.dequantize().numpy(), ref_dequantize(raw, GGMLQuantizationType[kind]))


def test_unknown_type_and_wrong_size_raise() -> None:
    with pytest.raises(ValueError, match="Q5_0 is not supported"):
        dequantize(np.zeros(10, np.uint8), "Q5_0", (1, 32))
    with pytest.raises(ValueError, match="expected 40"):
        dequantize(np.zeros(39, np.uint8), "Q4_1", (2, 32))


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permutation(heads: int) -> None:
    rows = heads * 8
    w = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    stored = torch.from_numpy(llama_cpp_permute(w, heads))
    assert torch.equal(stored[unpermute_order(rows, heads)], torch.from_numpy(w))


def test_int4_from_blocks_multiplies_like_its_dequantized_weight() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    q, d, m = quantize_q4(w)
    deq = (q.view(48, 2, 32).float() * d[..., None] + m[..., None]).reshape(48, 64)
    assert (deq - w).abs().max() <= d.max() / 2 + 1e-6  # round to nearest of 16 levels
    bias = torch.randn(48)
    lin = QuantLinear.from_int4(q, d, m, bias)
    for rows in (1, 5, 9, 16, 33):
        x = torch.randn(2, rows, 64)
        ref = x @ deq.t() + bias
        got = lin(x)
        assert got.shape == (2, rows, 48) and got.dtype == torch.float32
        assert (got - ref).abs().max() < 0.05 * ref.abs().max(), rows


def test_int8_per_channel() -> None:
    torch.manual_seed(1)
    w = torch.randn(40, 64)
    lin = QuantLinear.from_int8(w, None)
    x = torch.randn(3, 64)
    ref = x @ w.t()
    assert (lin(x) - ref).abs().max() < 0.03 * ref.abs().max()


def test_int8_head_keeps_the_tied_weight() -> None:
    emb = torch.nn.Embedding(100, 32)
    h = QuantHead(qk.pack_q8(*qk.quantize_q8(emb.weight.detach())), emb.weight)
    assert h.weight is emb.weight
    x = torch.randn(5, 32)
    ref = x @ emb.weight.t()
    assert h(x).shape == (5, 100) and (h(x) - ref).abs().max() < 0.05 * ref.abs().max()
