"""One decoder for LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM.

The three differ only in config (q/k/v bias, Qwen3's per-head q/k norms, tied embeddings),
so they share this file. q/k/v and gate/up projections are fused at load time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import ModelConfig
from specserve.kv.paged import PagedView
from specserve.kv.view import KVView
from specserve.layers.attention import attend
from specserve.layers.norm import RMSNorm, rms_norm_rows
from specserve.layers.qkernel import load_kernel
from specserve.layers.rope import RotaryEmbedding, apply_rope
from specserve.models.fused import FusedLayer, FusedStack


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [B, Q, V] (or [B, 1, V] with last_only)
    hidden: torch.Tensor  # final normed hidden state [B, Q, H] (or last position only)
    captured: list[torch.Tensor]  # pre-norm hidden states asked for, each [B, Q, H]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5
        load_kernel()  # built and loaded before any step is traced (a compiled graph cannot build it)

    def forward(
        self,
        x: torch.Tensor,  # [B, Q, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: int,
        kv: KVView | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(x), cos, sin, layer, kv, mask))

    def attend(
        self,
        qkv: torch.Tensor,  # [B, Q, (Hq + 2 Hkv) D] the fused projection's output
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: int,
        kv: KVView | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention from the q/k/v projections to the heads' outputs [B, Q, Hq D], before o_proj."""
        b, q_len, _ = qkv.shape
        heads = self.n_heads + self.n_kv
        qkv = qkv.view(b, q_len, heads + self.n_kv, self.head_dim)
        qk, v = qkv[:, :, :heads], qkv[:, :, heads:]  # [B, Q, Hq+Hkv, D], [B, Q, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            # one norm over q and k heads together (per-row op, so identical to two separate norms)
            w = torch.cat((self.q_norm.weight.expand(self.n_heads, -1), self.k_norm.weight.expand(self.n_kv, -1)))
            qk = rms_norm_rows(qk, w, self.q_norm.eps)
        qk = apply_rope(qk.transpose(1, 2), cos, sin)  # [B, Hq+Hkv, Q, D]
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        v = v.transpose(1, 2)  # [B, Hkv, Q, D]
        if kv is not None:  # a packed paged forward lays attention alone out per row (`KVView.to_grid`)
            k, v = kv.update(layer, k, v)
            out = kv.from_grid(attend(kv.to_grid(q), k, v, kv.mask, self.scale))
        elif mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1, scale=self.scale,
                                                 enable_gqa=self.n_heads != self.n_kv)
        else:
            out = attend(q, k, v, mask, self.scale)
        return out.transpose(1, 2).reshape(b, q_len, self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._fused: tuple[nn.Module | None, FusedLayer | None] = (None, None)  # `fused_plan`: (read from, plan)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
        kv: KVView | None, mask: torch.Tensor | None,
    ) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad:
            fused = self.fused_plan()
            if fused is not None:
                return fused(x, cos, sin, layer, kv, mask)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def paged_attention_fuses(self) -> bool:
        """Whether attention on the paged cache runs as one kernel call (`attend_paged`): no per-head q/k norms, a
        head dimension the row kernel takes (a multiple of 16, at most 256)."""
        d = self.self_attn.head_dim
        return self.self_attn.q_norm is None and d % 16 == 0 and d <= 256

    def fused_plan(self) -> FusedLayer | None:
        """The layer as five kernel calls (`models/fused.py`) where its projections are int4/int8 on the kernel;
        read once, again only when the projections are swapped (`--quantization`)."""
        owner, plan = self._fused
        # checked on every forward of every layer: the registries' dicts, not nn.Module's slower __getattr__
        if owner is not self._modules["self_attn"]._modules["qkv_proj"]:  # type: ignore[union-attr]
            attn, mlp = self.self_attn, self.mlp
            plan = FusedLayer.build((attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj),
                                    (self.input_layernorm, self.post_attention_layernorm),
                                    (attn.n_heads, attn.n_kv, attn.scale), self.paged_attention_fuses(),
                                    attn.attend)
            self._fused = (attn.qkv_proj, plan)
        return plan


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """forward(input_ids, positions, kv) with no global state; see `ForwardOutput`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)
        self._stack: FusedStack | None = None  # `fused_stack`, read once

    def runs_fused(self) -> bool:
        """Whether every decoder layer runs as the CPU kernel's fused calls (int4/int8 weights, `models/fused.py`):
        such a model needs no compiled steps."""
        return all(isinstance(layer, DecoderLayer) and layer.fused_plan() is not None for layer in self.model.layers)

    def fused_stack(self, x: torch.Tensor, kv: KVView | None) -> FusedStack | None:
        """The decoder stack as one kernel call (`models/fused.py`) where every layer is fused and this forward
        runs on the paged float32 cache (eager: a compiled graph must see the cache writes)."""
        if not (isinstance(kv, PagedView) and x.dtype == torch.float32 and x.device.type == "cpu"
                and not x.requires_grad and kv.cache.k[0].dtype == torch.float32
                and not torch.compiler.is_compiling()):
            return None
        plans = tuple(layer.fused_plan() if isinstance(layer, DecoderLayer) else None for layer in self.model.layers)
        if any(p is None for p in plans):
            return None
        if self._stack is None or any(a is not b for a, b in zip(self._stack.layers, plans, strict=True)):
            self._stack = FusedStack.build(tuple(p for p in plans if p is not None))
        return self._stack

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normed hidden [..., H] -> logits [..., V]."""
        return self.lm_head(hidden)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, Q]
        positions: torch.Tensor,  # [B, Q] RoPE positions
        kv: KVView | None = None,
        mask: torch.Tensor | None = None,  # [B|1, 1, Q, K] bool, only used without kv
        capture: tuple[int, ...] = (),  # indices into HF's hidden_states tuple (0 = embeddings)
        last_only: bool = False,
        compute_logits: bool = True,
    ) -> ForwardOutput:
        x = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        captured: dict[int, torch.Tensor] = {}
        stack = self.fused_stack(x, kv)
        if stack is not None and isinstance(kv, PagedView):  # every layer in one kernel call
            x, *states = stack(x, cos, sin, kv, capture)
            captured = dict(zip(sorted(capture), states, strict=True))
        else:
            if 0 in capture:
                captured[0] = x
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, i, kv, mask)
                if i + 1 in capture:
                    captured[i + 1] = x
        if last_only:
            x = x[:, -1:]
        h = self.model.norm(x)
        logits = self.logits(h) if compute_logits else None
        return ForwardOutput(logits, h, [captured[i] for i in capture])
