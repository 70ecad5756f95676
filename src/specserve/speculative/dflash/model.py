"""The DFlash and DFlash 2 block drafters: config and module in the public `DFlashDraftModel` /
`DFlash2DraftModel` layouts (IO: `checkpoint.py`).

Checkpoint (safetensors, no `model.` prefix; H = hidden size, shared with the target, n = len(target_layer_ids)):
  fc.weight [H, n*H]  hidden_norm.weight [H]  norm.weight [H]
  layers.{i}.self_attn.{q,k,v,o}_proj.weight  layers.{i}.self_attn.{q,k}_norm.weight [head_dim]
  layers.{i}.mlp.{gate,up,down}_proj.weight  layers.{i}.{input,post_attention}_layernorm.weight
No embedding and no LM head: the drafter reads the target's. config.json holds Qwen3 fields plus
`architectures: ["DFlashDraftModel"]`, `num_target_layers`, `block_size` (top level, as published checkpoints
write it, and in `dflash_config` as newer ones do) and `dflash_config.{target_layer_ids, mask_token_id}`.
`target_layer_ids` name target layers whose OUTPUT is tapped: HF hidden_states[id + 1], our `capture` index.

KV injection: the context c = hidden_norm(fc(concat(tapped target states))) goes, in every layer, through that
layer's own k/v projections (k-norm, RoPE at the context positions; no input norm) and is prepended to the
block's keys/values. Queries come from block tokens only; nothing is causal inside the block.

DFlash 2 (`architectures: ["DFlash2DraftModel"]`, z-lab's `dflash` 0.1.0) adds, per layer, a grouped dynamic
causal convolution before and after the attention and the MLP (`conv.py`:
layers.{i}.{attention,mlp}_conv.{base_kernel, kernel_projection.weight}) and a candidate selector that picks the
block's path from each slot's top-k (`selector.py`: candidate_selector.{predecessor,successor}_codebook [V, r],
candidate_selector.hidden_projection.weight [r, H]); dflash_config gains conv_kernel_size, conv_group_size,
selector_rank, selector_top_k.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import ModelConfig
from specserve.kv.contiguous import ContiguousKVCache
from specserve.layers.attention import attend
from specserve.layers.norm import RMSNorm
from specserve.layers.rope import RotaryEmbedding, apply_rope
from specserve.models.llama import MLP
from specserve.speculative.dflash.conv import GroupedCausalConv
from specserve.speculative.dflash.selector import CandidateSelector

ARCH = "DFlashDraftModel"
ARCH2 = "DFlash2DraftModel"
V2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
FLAG = "--speculative-draft-model-path"
ContextKV = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per draft layer: k, v [B, Hkv, C, D]


def default_target_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
    """n target layers spread evenly over 1..L-3 (the reference's choice; [1, 9, 17, 25, 33] for L=36, n=5).
    Targets too shallow for that spread over 0..L-1 instead."""
    if n == 1:
        return (num_target_layers // 2,)
    lo, hi = 1, num_target_layers - 3
    if hi - lo + 1 < n:
        lo, hi = 0, num_target_layers - 1
    if hi - lo + 1 < n:
        raise ValueError(f"cannot pick {n} distinct layers of a {num_target_layers}-layer target; "
                         "pass target_layer_ids (or fewer draft layers)")
    return tuple(round(lo + i * (hi - lo) / (n - 1)) for i in range(n))


@dataclass(frozen=True)
class DFlashConfig:
    body: ModelConfig  # the Qwen3-style stack: sizes, heads, rope, eps, vocab (no embedding/LM head of its own)
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    num_target_layers: int | None = None
    # DDTree is built from the block's distributions at this temperature (< 1 sharpens: deeper trees); a
    # calibration of the trained drafter (`specserve train calibrate`), not part of its architecture
    tree_temperature: float = 1.0
    # For a request that samples at temperature T, drafts are drawn from the block's distributions at
    # T * sample_temperature (> 1 flattens a drafter surer of itself than the target); also a calibration
    sample_temperature: float = 1.0
    # For a request that samples, the drawn tree's first-child path is shown to the drafter this many tokens
    # deep, one more block forward per token, and the subtree below each shown token drawn again from the
    # block's laws given it (0: the one forward's laws, marginals over the tokens before each position); a
    # calibration too (`specserve train calibrate --field sample_reveal`)
    sample_reveal: int = 0
    # For a greedy request, the DDTree's first path shown this many tokens deep, and the subtree below each shown
    # token rebuilt, as large as it was, as the best tree over the block's laws given it (more accepted tokens for
    # one more block forward per token: a gain where the drafter's forward is cheap next to the target's)
    greedy_reveal: int = 0
    # DFlash 2 (all four set) or DFlash (all 0)
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    def __post_init__(self) -> None:
        v2 = [getattr(self, f) for f in V2_FIELDS]
        if any(v < 0 for v in v2) or (any(v2) and not all(v2)):
            raise ValueError(f"dflash_config.{{{', '.join(V2_FIELDS)}}} must all be > 0 (DFlash 2) or all absent "
                             f"(DFlash), got {v2}")
        if self.is_v2:
            if self.body.hidden_size % self.conv_group_size:
                raise ValueError(f"dflash_config.conv_group_size {self.conv_group_size} must divide hidden_size "
                                 f"{self.body.hidden_size}")
            if self.selector_top_k > self.body.vocab_size:
                raise ValueError(f"dflash_config.selector_top_k {self.selector_top_k} exceeds vocab_size "
                                 f"{self.body.vocab_size}")
            if self.sample_reveal or self.greedy_reveal:
                raise ValueError("dflash_config.sample_reveal / greedy_reveal are DFlash calibrations; a DFlash 2 "
                                 "drafter's selector already conditions each slot on the token before it")
        for name in ("tree_temperature", "sample_temperature"):
            if not getattr(self, name) > 0:
                raise ValueError(f"dflash_config.{name} must be > 0, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (the root plus one mask), got {self.block_size}")
        for name in ("sample_reveal", "greedy_reveal"):
            if not 0 <= getattr(self, name) <= self.block_size - 2:
                raise ValueError(f"dflash_config.{name} must be in [0, block_size - 2 = {self.block_size - 2}] "
                                 f"(a mask must stay), got {getattr(self, name)}")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ValueError(f"dflash_config.target_layer_ids must be non-empty and >= 0, got {self.target_layer_ids}")
        if self.num_target_layers is not None and max(self.target_layer_ids) >= self.num_target_layers:
            raise ValueError(f"dflash_config.target_layer_ids {list(self.target_layer_ids)} must be < "
                             f"num_target_layers {self.num_target_layers}")
        if not 0 <= self.mask_token_id < self.body.vocab_size:
            raise ValueError(f"dflash_config.mask_token_id {self.mask_token_id} must be in [0, vocab_size "
                             f"{self.body.vocab_size})")

    @property
    def is_v2(self) -> bool:
        return self.conv_kernel_size > 0

    @property
    def architecture(self) -> str:
        return ARCH2 if self.is_v2 else ARCH

    @property
    def capture(self) -> tuple[int, ...]:
        """Our `capture` indices (HF hidden_states) of the tapped layer outputs, in fc's input order."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> DFlashConfig:
        archs = raw.get("architectures") or []
        if ARCH not in archs and ARCH2 not in archs:
            raise ValueError(f"architectures {archs} is not [{ARCH!r}] or [{ARCH2!r}]; this is not a DFlash drafter "
                             "checkpoint")
        v2 = ARCH2 in archs
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        if raw.get("is_causal") or any(t != "full_attention" for t in raw.get("layer_types") or []):
            raise ValueError("causal or sliding-window draft layers (is_causal / layer_types) are not supported")
        dcfg = dict(raw.get("dflash_config") or {})
        for key in ("projector_type", "final_logit_softcapping", *(() if v2 else V2_FIELDS)):
            if dcfg.get(key):
                raise ValueError(f"dflash_config.{key} (a DFlash variant) is not supported"
                                 + (f"; a DFlash 2 checkpoint names architectures [{ARCH2!r}]" if key in V2_FIELDS
                                    else ""))
        for key in ("output_multiplier", "input_embedding_scale"):
            if dcfg.get(key) is not None and float(dcfg[key]) != 1.0:
                raise ValueError(f"dflash_config.{key} != 1 (a DFlash variant) is not supported")

        def get(name: str) -> Any:
            return dcfg.get(name, raw.get(name))

        try:
            body = ModelConfig.from_hf({**raw, "architectures": [ARCH]})
        except KeyError as e:
            raise ValueError(f"config.json lacks {e}") from None
        body = replace(body, qk_norm=True, tie_word_embeddings=False, o_proj_bias=body.attention_bias)
        mask = get("mask_token_id")
        if mask is None:
            raise ValueError("dflash_config.mask_token_id is missing; add the id of the mask token")
        num_target = get("num_target_layers")
        ids = get("target_layer_ids")
        if ids is None:
            if num_target is None:
                raise ValueError("dflash_config.target_layer_ids and num_target_layers are both missing")
            ids = default_target_layer_ids(int(num_target), body.num_hidden_layers)
        v2_sizes = [0] * len(V2_FIELDS)
        if v2:
            missing = [f for f in V2_FIELDS if get(f) is None]
            if missing:
                raise ValueError(f"dflash_config lacks {missing}, which a {ARCH2} needs")
            v2_sizes = [int(get(f)) for f in V2_FIELDS]
        return cls(body, tuple(int(i) for i in ids), int(mask), int(get("block_size") or 16),
                   None if num_target is None else int(num_target), float(dcfg.get("tree_temperature", 1.0)),
                   float(dcfg.get("sample_temperature", 1.0)), int(dcfg.get("sample_reveal", 0)),
                   int(dcfg.get("greedy_reveal", 0)), *v2_sizes)

    def to_hf(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        b = self.body
        out: dict[str, Any] = {
            "architectures": [self.architecture], "model_type": "qwen3",
            "hidden_size": b.hidden_size, "intermediate_size": b.intermediate_size,
            "num_hidden_layers": b.num_hidden_layers, "num_attention_heads": b.num_attention_heads,
            "num_key_value_heads": b.num_key_value_heads, "head_dim": b.head_dim, "vocab_size": b.vocab_size,
            "max_position_embeddings": b.max_position_embeddings, "rms_norm_eps": b.rms_norm_eps,
            "hidden_act": "silu", "attention_bias": b.attention_bias, "attention_dropout": 0.0,
            "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
            "layer_types": ["full_attention"] * b.num_hidden_layers, "initializer_range": 0.02,
            **b.rope.to_hf(),
            "block_size": self.block_size,
            "dflash_config": {"block_size": self.block_size, "mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids)},
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        for name in ("tree_temperature", "sample_temperature"):
            if getattr(self, name) != 1.0:
                out["dflash_config"][name] = getattr(self, name)
        if self.is_v2:
            out["dflash_config"].update({name: getattr(self, name) for name in V2_FIELDS})
        for name in ("sample_reveal", "greedy_reveal"):
            if getattr(self, name):
                out["dflash_config"][name] = getattr(self, name)
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if b.bos_token_id is not None:
            out["bos_token_id"] = b.bos_token_id
        if b.eos_token_ids:
            out["eos_token_id"] = list(b.eos_token_ids) if len(b.eos_token_ids) > 1 else b.eos_token_ids[0]
        return out


class DFlashAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def _kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> k, v [B, T, Hkv*D] before norm and rope: only the k/v rows of qkv_proj."""
        bias = None if self.qkv_proj.bias is None else self.qkv_proj.bias[self.q_size:]
        k, v = F.linear(x, self.qkv_proj.weight[self.q_size:], bias).split(self.kv_size, dim=-1)
        return k, v

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [B, C, H] (projected context) -> k, v [B, Hkv, C, D]; only the k/v rows of qkv_proj are used."""
        b, c, _ = ctx.shape
        k, v = self._kv(ctx)
        k = apply_rope(self.k_norm(k.view(b, c, self.n_kv, self.head_dim)).transpose(1, 2), cos, sin)
        return k, v.view(b, c, self.n_kv, self.head_dim).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        ctx_k: torch.Tensor, ctx_v: torch.Tensor, mask: torch.Tensor | None, queries: int | None = None,
    ) -> torch.Tensor:
        """x [B, Q, H] block tokens; ctx_k/ctx_v [B, Hkv, C, D]; mask [B|1, 1, Q, C+Q] or None (all visible).
        -> [B, q, H] for the first q = `queries` (default Q) tokens; every token is still a key."""
        b, q_len, _ = x.shape
        nq = q_len if queries is None else queries
        if nq == q_len:
            q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        else:  # queries only where outputs are wanted; keys and values for the whole block
            bias = self.qkv_proj.bias
            q = F.linear(x[:, :nq], self.qkv_proj.weight[: self.q_size], None if bias is None else bias[: self.q_size])
            k, v = self._kv(x)
            mask = None if mask is None else mask[:, :, :nq]
        q = apply_rope(self.q_norm(q.view(b, nq, self.n_heads, self.head_dim)).transpose(1, 2),
                       cos[:, :, :nq], sin[:, :, :nq])
        k = apply_rope(self.k_norm(k.view(b, q_len, self.n_kv, self.head_dim)).transpose(1, 2), cos, sin)
        v = v.view(b, q_len, self.n_kv, self.head_dim).transpose(1, 2)
        out = attend(q, torch.cat((ctx_k, k), dim=2), torch.cat((ctx_v, v), dim=2), mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, nq, self.q_size))  # [B, q, H]


class DFlashLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, conv: tuple[int, int] | None = None) -> None:
        """conv: (kernel size, group size) of DFlash 2's convolutions around both sublayers; None for DFlash."""
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention_conv = None if conv is None else GroupedCausalConv(cfg.hidden_size, *conv)
        self.mlp_conv = None if conv is None else GroupedCausalConv(cfg.hidden_size, *conv)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor | None, queries: int | None = None,
                segment: int | None = None) -> torch.Tensor:
        """x [B, Q, H] -> [B, q, H], the first q = `queries` (default Q) positions' outputs. segment: positions
        per block for DFlash 2's convolutions (None: x is one block)."""
        nq = x.shape[1] if queries is None else queries
        h = self.input_layernorm(x)
        if self.attention_conv is None:
            x = x[:, :nq] + self.self_attn(h, cos, sin, ctx_k, ctx_v, mask, nq)
            return x + self.mlp(self.post_attention_layernorm(x))
        assert self.mlp_conv is not None
        h, taps = self.attention_conv.before(h, segment)
        x = x[:, :nq] + self.attention_conv.after(self.self_attn(h, cos, sin, ctx_k, ctx_v, mask, nq), taps, segment)
        h, taps = self.mlp_conv.before(self.post_attention_layernorm(x), segment)
        return x + self.mlp_conv.after(self.mlp(h), taps, segment)


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        body = cfg.body
        self.fc = nn.Linear(len(cfg.target_layer_ids) * body.hidden_size, body.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(body.hidden_size, body.rms_norm_eps)
        conv = (cfg.conv_kernel_size, cfg.conv_group_size) if cfg.is_v2 else None
        self.layers = nn.ModuleList(DFlashLayer(body, conv) for _ in range(body.num_hidden_layers))
        self.norm = RMSNorm(body.hidden_size, body.rms_norm_eps)
        self.rotary = RotaryEmbedding(body.rope, body.head_dim)
        self.candidate_selector = (CandidateSelector(body.hidden_size, body.vocab_size, cfg.selector_rank,
                                                     cfg.selector_top_k) if cfg.is_v2 else None)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """features [B, C, n*H] tapped target states, positions [B, C] -> per layer k, v [B, Hkv, C, D]."""
        ctx = self.hidden_norm(self.fc(features))  # [B, C, H]
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        return [cast(DFlashLayer, layer).self_attn.context_kv(ctx, cos, sin) for layer in self.layers]

    def forward(self, noise: torch.Tensor, positions: torch.Tensor, context: ContextKV,
                mask: torch.Tensor | None = None, outputs: int | None = None,
                segment: int | None = None) -> torch.Tensor:
        """noise [B, Q, H] block embeddings at positions [B, Q] -> final-normed hidden [B, q, H] (target LM head
        ready) of the first q = `outputs` (default Q) positions. mask [B|1, 1, Q, C+Q] bool over (context,
        block) keys; None = every key visible. Exact for any q: the last layer still takes every position as a
        key, and only its queries, output projection and MLP are cut to the positions read (DFlash 2's
        convolutions are causal, so the cut positions feed none of those read). segment: positions per block
        when noise lays several blocks end to end (training); None: one block."""
        x = noise
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        last = len(self.layers) - 1
        for i, (layer, (k, v)) in enumerate(zip(self.layers, context, strict=True)):
            x = layer(x, cos, sin, k, v, mask, outputs if i == last else None, segment)
        return self.norm(x)

    def append_context(self, cache: ContiguousKVCache, start: int, features: torch.Tensor,
                       positions: torch.Tensor) -> None:
        """Write the context K/V of features [B, T, n*H] at positions [B, T] into cache slots [start, start+T)."""
        view = cache.view(start, features.shape[1], causal=False)
        for i, (k, v) in enumerate(self.context_kv(features, positions)):
            view.update(i, k, v)

    @staticmethod
    def cached_context(cache: ContiguousKVCache, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[:, :, :length], v[:, :, :length]) for k, v in zip(cache.k, cache.v, strict=True)]

    def train_blocks(self, features: torch.Tensor, noise: torch.Tensor, anchors: torch.Tensor,
                     lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Training forward: features [B, T, n*H] (context at positions 0..T-1), noise [B, N*bs, H] embeddings of
        N blocks [anchor token, MASK...], anchors [B, N] -> logits [B, N*bs, V]. Block j sits at anchors[:, j] + k
        and sees context positions < anchors[:, j] plus itself (bidirectionally), not the other blocks."""
        return lm_head(self.train_hidden(features, noise, anchors))

    def train_hidden(self, features: torch.Tensor, noise: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """`train_blocks` before the LM head: [B, N*bs, H] final-normed block outputs."""
        b, t, _ = features.shape
        bs = noise.shape[1] // anchors.shape[1]
        offsets = torch.arange(bs, device=anchors.device)
        positions = (anchors[:, :, None] + offsets).reshape(b, -1)  # [B, N*bs]
        context = self.context_kv(features, torch.arange(t, device=features.device).expand(b, t))
        return self(noise, positions, context, block_attention_mask(anchors, bs, t), segment=bs)


def block_attention_mask(anchors: torch.Tensor, block_size: int, ctx_len: int) -> torch.Tensor:
    """anchors [B, N] -> [B, 1, N*bs, ctx_len + N*bs] bool: block j sees context < anchors[:, j] and itself."""
    block = torch.arange(anchors.shape[1] * block_size, device=anchors.device) // block_size  # [Q]
    sees_ctx = torch.arange(ctx_len, device=anchors.device) < anchors[:, block, None]  # [B, Q, T]
    sees_block = (block[:, None] == block[None, :]).expand(anchors.shape[0], -1, -1)  # [B, Q, Q]
    return torch.cat((sees_ctx, sees_block), dim=-1)[:, None]
