"""GGUF's block formats, decoded in numpy/torch (no llama.cpp): F32, F16, BF16, Q8_0, Q4_0, Q4_1.

A quantized 2-D tensor is stored as rows of blocks of 32 weights each:
- Q8_0: 34 bytes = fp16 d, 32 int8 q; w = d * q.
- Q4_0: 18 bytes = fp16 d, 16 bytes of nibbles; w = d * (q - 8).
- Q4_1: 20 bytes = fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m.
Nibble byte j holds element j in its low half and element j + 16 in its high half.

`Q4Blocks` keeps a 4-bit tensor as (q, d, m) with Q4_0 written in Q4_1's form (m = -8 d), so the int4 kernels
take either without re-quantizing (`layers/quant.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
FLOAT_TYPES: dict[str, type[np.floating]] = {"F32": np.float32, "F16": np.float16}
SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


@dataclass(frozen=True)
class Q4Blocks:
    """A 4-bit weight [N, K]: w = d * q + m, per block of 32 along K."""

    q: torch.Tensor  # [N, K] uint8 in 0..15
    d: torch.Tensor  # [N, K/32] float32
    m: torch.Tensor  # [N, K/32] float32

    def dequantize(self) -> torch.Tensor:
        """-> [N, K] float32."""
        n, k = self.q.shape
        w = self.q.view(n, k // BLOCK, BLOCK).float() * self.d[..., None] + self.m[..., None]
        return w.reshape(n, k)

    def rows(self, order: torch.Tensor) -> Q4Blocks:
        """The same weight with its rows reordered (`order` [N] indices)."""
        return Q4Blocks(self.q[order], self.d[order], self.m[order])

    @staticmethod
    def cat(parts: list[Q4Blocks]) -> Q4Blocks:
        """Stacked along N (the fused q/k/v and gate/up projections)."""
        return Q4Blocks(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]),
                        torch.cat([p.m for p in parts]))


def _blocks(raw: np.ndarray, kind: str, n: int, k: int) -> np.ndarray:
    """raw bytes -> [N, K/32, bytes per block] uint8."""
    if k % BLOCK:
        raise ValueError(f"{kind} tensor with a row of {k} weights, not a multiple of {BLOCK}")
    want = n * (k // BLOCK) * BLOCK_BYTES[kind]
    flat = np.ascontiguousarray(raw).reshape(-1)
    if flat.size != want:
        raise ValueError(f"{kind} tensor [{n}, {k}] holds {flat.size} bytes, expected {want}")
    return flat.reshape(n, k // BLOCK, BLOCK_BYTES[kind])


def _fp16(b: np.ndarray) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float32 (little-endian fp16)."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """[N, B, 16] uint8 -> [N, B*32] uint8 (low halves are elements 0..15, high halves 16..31)."""
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(q).reshape(qs.shape[0], -1))


def q4_blocks(raw: np.ndarray, kind: str, n: int, k: int) -> Q4Blocks:
    """A Q4_0 or Q4_1 tensor [N, K] as `Q4Blocks`."""
    b = _blocks(raw, kind, n, k)
    d = _fp16(b[..., 0:2])
    if kind == "Q4_1":
        return Q4Blocks(_nibbles(b[..., 4:20]), d, _fp16(b[..., 2:4]))
    if kind == "Q4_0":
        return Q4Blocks(_nibbles(b[..., 2:18]), d, -8.0 * d)
    raise ValueError(f"{kind} is not a 4-bit block type")


def q8_blocks(raw: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor [N, K] as blocks: (q [N, K] int8, d [N, K/32] float32); w = d * q."""
    b = _blocks(raw, "Q8_0", n, k)
    q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k))
    return q, _fp16(b[..., 0:2])


def dequantize(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Any `SUPPORTED` tensor -> float32 of `shape` (numpy order: the last dimension is contiguous)."""
    if kind == "F32" or kind == "F16":
        return torch.from_numpy(np.ascontiguousarray(raw).view(FLOAT_TYPES[kind]).astype(np.float32)).reshape(shape)
    if kind == "BF16":
        u16 = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint16).astype(np.int32))
        return (u16 << 16).view(torch.float32).reshape(shape)
    n, k = (int(np.prod(shape[:-1])), shape[-1])
    if kind in ("Q4_0", "Q4_1"):
        return q4_blocks(raw, kind, n, k).dequantize().reshape(shape)
    if kind == "Q8_0":
        b = _blocks(raw, kind, n, k)
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.float32))
        return (q * _fp16(b[..., 0:2])[..., None]).reshape(shape)
    raise ValueError(f"tensor type {kind} is not supported; specserve reads {', '.join(SUPPORTED)}")
