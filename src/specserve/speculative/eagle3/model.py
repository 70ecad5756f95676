"""The EAGLE-3 draft model: config and module, in the layout SGLang and vLLM load (IO: `eagle3_checkpoint.py`).

One Llama decoder layer whose attention reads [RMSNorm(token embedding) ; RMSNorm(feature)] (2H wide).
The feature is `fc` of three captured target states (3·Ht -> H) for committed tokens, or the layer's own
previous output while drafting. Logits come from `lm_head(norm(out))` over a reduced draft vocabulary;
target id = draft id + d2t[draft id].

Checkpoint directory: config.json + model.safetensors with
  fc.weight [H, 3·Ht]                      midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H]
  midlayer.self_attn.{q,k,v}_proj [., 2H]  midlayer.self_attn.o_proj, midlayer.mlp.{gate,up,down}_proj
  norm.weight [H]   lm_head.weight [Vd, H]   d2t [Vd] int64   t2d [V] bool   (optional) embed_tokens.weight [V, H]
Aux layer ids (`aux_layer_ids`) are HF `hidden_states` indices of the target: i = input of layer i.
The engines disagree on what `eagle_aux_hidden_state_layer_ids` means, so config.json carries both:
  top level                    i      vLLM reads it first and captures the input of layer i;
  eagle_config.<same name>     i - 1  SGLang reads only this and captures the output of layer id (id + 1).
Reading: the top-level list if present, else eagle_config's + 1, else (2, L//2, L-3) as both default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.kv.contiguous import causal_mask
from specserve.kv.view import KVView
from specserve.layers.attention import attend
from specserve.layers.norm import RMSNorm
from specserve.layers.rope import RotaryEmbedding, apply_rope

ARCHITECTURE = "LlamaForCausalLMEagle3"
ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")  # the second is vLLM's internal name
FLAG = "--speculative-draft-model-path"
AUX_FIELD = "eagle_aux_hidden_state_layer_ids"


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """(2, L//2, L-3) as vLLM/SGLang pick them; for shallow targets where those collide, 3 spread ids."""
    ids = (2, num_layers // 2, num_layers - 3)
    if ids[0] < ids[1] < ids[2]:
        return ids
    pool = list(range(1, num_layers)) if num_layers >= 4 else list(range(num_layers))
    if len(pool) < 3:
        raise ValueError(f"an EAGLE-3 drafter taps 3 target layers; a {num_layers}-layer target is too shallow")
    return tuple(pool[round(i * (len(pool) - 1) / 2)] for i in range(3))


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the draft layer: sizes, norm eps, RoPE; vocab_size = the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # target HF hidden_states indices, concatenated in this order
    norm_before_residual: bool = False  # vLLM option: the residual is hidden_norm(feature)

    def __post_init__(self) -> None:
        if self.layer.num_hidden_layers != 1:
            raise ValueError(f"num_hidden_layers must be 1 for an EAGLE-3 drafter, got {self.layer.num_hidden_layers}")
        if self.layer.attention_bias or self.layer.mlp_bias or self.layer.qk_norm:
            raise ValueError("EAGLE-3 drafters with attention_bias/mlp_bias or q/k norms are not supported")
        if not 1 <= self.draft_vocab_size <= self.layer.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, vocab_size={self.layer.vocab_size}], got {self.draft_vocab_size}"
            )
        if self.target_hidden_size <= 0:
            raise ValueError(f"target_hidden_size must be positive, got {self.target_hidden_size}")
        ids = self.aux_layer_ids
        if len(ids) != 3 or ids[0] < 0 or not ids[0] < ids[1] < ids[2]:
            raise ValueError(f"{AUX_FIELD} must be 3 increasing target layer ids >= 0, got {list(ids)}")

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @classmethod
    def from_hf(cls, raw: dict[str, Any], target_layers: int) -> Eagle3Config:
        """Parse config.json; `target_layers` supplies the default aux ids when the config has none."""
        arch = (raw.get("architectures") or [None])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"architectures is {raw.get('architectures')}, expected [{ARCHITECTURE!r}]")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        try:
            layer = ModelConfig.from_hf(raw)
        except KeyError as e:
            raise ValueError(f"config.json lacks field {e}") from None
        sglang_ids = (raw.get("eagle_config") or {}).get(AUX_FIELD)
        ids = raw.get(AUX_FIELD) or ([int(i) + 1 for i in sglang_ids] if sglang_ids else None)
        ids = ids or default_aux_layer_ids(target_layers)
        return cls(
            layer=layer,
            draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
            target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
            aux_layer_ids=tuple(int(i) for i in ids),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
        )

    def to_hf(self) -> dict[str, Any]:
        c = self.layer
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "norm_before_residual": self.norm_before_residual,
            AUX_FIELD: list(self.aux_layer_ids),
            "eagle_config": {AUX_FIELD: [i - 1 for i in self.aux_layer_ids], "use_aux_hidden_state": True},
            **c.rope.to_hf(),
        }
        if c.torch_dtype is not None:
            out["torch_dtype"] = c.torch_dtype
        return out


class Eagle3Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.n_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.n_kv * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.n_kv * c.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVView | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        b, q_len, _ = x.shape  # x: [B, Q, 2H]
        q = apply_rope(self.q_proj(x).view(b, q_len, self.n_heads, self.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, q_len, self.n_kv, self.head_dim).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, q_len, self.n_kv, self.head_dim).transpose(1, 2)  # [B, Hkv, Q, D]
        if kv is not None:
            k, v = kv.update(0, k, v)
            mask = kv.mask  # drafter views are never packed (`KVView.to_grid` is the identity)
        elif mask is None and q_len > 1:
            mask = causal_mask(0, q_len, x.device)
        out = attend(q, k, v, mask, self.head_dim**-0.5)  # [B, Hq, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.n_heads * self.head_dim))


class Eagle3MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        c = cfg.layer
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = Eagle3MLP(c)

    def forward(self, embeds: torch.Tensor, feature: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: KVView | None, mask: torch.Tensor | None) -> torch.Tensor:
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)  # [B, Q, 2H]
        h = residual + self.self_attn(x, cos, sin, kv, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Model(nn.Module):
    """forward(embeds, feature, positions, kv) -> the layer's pre-norm output, the next step's feature."""

    d2t: torch.Tensor  # [Vd] long buffer: target id = draft id + d2t[draft id]
    t2d: torch.Tensor  # [V] bool buffer: which target ids the draft vocabulary holds

    def __init__(self, cfg: Eagle3Config, own_embedding: bool = False) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        # None: the drafter embeds tokens with the target's embedding (then H must equal the target's).
        self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_size, h) if own_embedding else None
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(h, cfg.layer.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary = RotaryEmbedding(cfg.layer.rope, cfg.layer.head_dim)

    def forward(
        self,
        embeds: torch.Tensor,  # [B, Q, H] token embeddings
        feature: torch.Tensor,  # [B, Q, H] fc(target states) or a previous output
        positions: torch.Tensor,  # [B, Q]
        kv: KVView | None = None,
        mask: torch.Tensor | None = None,  # [B|1, 1, Q, K] bool, only used without kv (default causal)
    ) -> torch.Tensor:  # [B, Q, H]
        cos, sin = self.rotary.cos_sin(positions, feature.dtype)
        return self.midlayer(embeds, feature, cos, sin, kv, mask)

    def project(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Concatenated captured target states [..., 3·Ht] -> features [..., H]."""
        return self.fc(target_hidden)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Layer output [..., H] -> logits over the draft vocabulary [..., Vd]."""
        return self.lm_head(self.norm(out))

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def to_target_vocab(self, x: torch.Tensor, fill: float) -> torch.Tensor:
        """Scatter [..., Vd] draft-vocab values into [..., V]; tokens outside the draft vocab get `fill`."""
        out = x.new_full((*x.shape[:-1], self.config.vocab_size), fill)
        out[..., self.target_ids(torch.arange(x.shape[-1], device=x.device))] = x
        return out
