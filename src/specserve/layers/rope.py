"""Rotary position embeddings with the scaling variants used by Llama/Qwen configs.

The rotation is the "rotate half" layout of Hugging Face checkpoints.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from specserve.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rot_dim/2] and the cos/sin scale for one RoPE config.

    `seq_len` matters only for dynamic NTK scaling (the longest position + 1 in use).
    """
    dim = int(head_dim * rope.partial_rotary_factor)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = rope.theta
    if rope.rope_type == "dynamic" and seq_len is not None:
        orig = rope.original_max_position_embeddings or seq_len
        if seq_len > orig:
            base = base * ((rope.factor * seq_len / orig) - (rope.factor - 1)) ** (dim / (dim - 2))
    inv = 1.0 / (base**exponents)
    scale = 1.0
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        inv = _llama3(inv, rope)
    elif rope.rope_type == "yarn":
        inv, scale = _yarn(rope, dim)
    return inv, scale


def _llama3(inv: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    orig = rope.original_max_position_embeddings or 8192
    low_wavelen = orig / rope.low_freq_factor
    high_wavelen = orig / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (orig / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    orig = rope.original_max_position_embeddings or 2048

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rope.attention_factor
    if attn is None:
        if rope.mscale and rope.mscale_all_dim:
            attn = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attn = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv = (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
    return inv, float(attn)


class RotaryEmbedding(nn.Module):
    """Holds a cos/sin table that grows on demand; applies RoPE at explicit positions."""

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.rot_dim = int(head_dim * rope.partial_rotary_factor)
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self._reserved = False  # the table is fixed: positions are not read back to size it (`reserve`)

    @property
    def can_reserve(self) -> bool:
        """Whether one table serves every length (not so for dynamic NTK scaling, recomputed per length)."""
        return self.rope.rope_type != "dynamic"

    def reserve(self, length: int, device: torch.device) -> None:
        """Build the table for positions below `length` once and stop sizing it per call: `cos_sin` then reads
        no position back to the host, which a compiled step cannot do. Not for dynamic NTK scaling."""
        if not self.can_reserve:
            raise ValueError("a dynamic-NTK RoPE table depends on the sequence length; it cannot be reserved")
        self._table(length, device)
        self._reserved = True

    def _table(self, needed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.rope.rope_type == "dynamic"
        if self._cos.shape[0] < needed or self._cos.device != device or dynamic:
            length = needed if dynamic else max(needed, 2 * self._cos.shape[0], 256)
            inv, scale = inv_frequencies(self.rope, self.head_dim, needed if dynamic else None)
            t = torch.arange(length, dtype=torch.float32)
            freqs = torch.outer(t, inv)  # [S, rot_dim/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [S, rot_dim]
            self._cos = (emb.cos() * scale).to(device)
            self._sin = (emb.sin() * scale).to(device)
        return self._cos, self._sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, Q] -> cos, sin [B, 1, Q, rot_dim] (broadcast over heads)."""
        if self._reserved:
            cos, sin = self._cos, self._sin
        else:
            cos, sin = self._table(int(positions.max().item()) + 1, positions.device)
        return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, Q, D]; cos/sin [B, 1, Q, rot_dim] with rot_dim <= D."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        return torch.cat((apply_rope(x_rot, cos, sin), x_pass), dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
