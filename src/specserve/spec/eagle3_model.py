"""The EAGLE-3 draft model: config, module, and checkpoints in the layout SGLang and vLLM load.

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

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from specserve.config import ModelConfig
from specserve.kv.contiguous import KVView, causal_mask
from specserve.kv.rows import RowsView
from specserve.layers.attention import attend
from specserve.layers.norm import RMSNorm
from specserve.layers.rope import RotaryEmbedding, apply_rope
from specserve.models.loader import resolve_model_path
from specserve.models.weights import iter_tensors, save_safetensors, weight_files

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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVView | RowsView | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        b, q_len, _ = x.shape  # x: [B, Q, 2H]
        q = apply_rope(self.q_proj(x).view(b, q_len, self.n_heads, self.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, q_len, self.n_kv, self.head_dim).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, q_len, self.n_kv, self.head_dim).transpose(1, 2)  # [B, Hkv, Q, D]
        if kv is not None:
            k, v = kv.update(0, k, v)
            mask = kv.mask
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
                kv: KVView | RowsView | None, mask: torch.Tensor | None) -> torch.Tensor:
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
        kv: KVView | RowsView | None = None,
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


def check_target(cfg: Eagle3Config, target: ModelConfig, own_embedding: bool, where: str) -> None:
    """A ValueError naming the flag and the field when the drafter does not fit the target."""
    if cfg.target_hidden_size != target.hidden_size:
        raise ValueError(f"{FLAG} {where}: target_hidden_size {cfg.target_hidden_size} differs from the target "
                         f"model's hidden_size {target.hidden_size}; this drafter was trained for another target")
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"{FLAG} {where}: vocab_size {cfg.vocab_size} differs from the target's "
                         f"{target.vocab_size}; the drafter must use the target's tokenizer")
    if max(cfg.aux_layer_ids) > target.num_hidden_layers:
        raise ValueError(f"{FLAG} {where}: {AUX_FIELD} {list(cfg.aux_layer_ids)} exceed the target's "
                         f"{target.num_hidden_layers} layers (valid ids 0..{target.num_hidden_layers})")
    if not own_embedding and cfg.hidden_size != target.hidden_size:
        raise ValueError(f"{FLAG} {where}: hidden_size {cfg.hidden_size} differs from the target's "
                         f"{target.hidden_size} and the checkpoint has no embed_tokens.weight of its own")


def _read_config(draft_dir: Path, target: ModelConfig) -> tuple[Eagle3Config, list[Path], bool]:
    try:
        raw = json.loads((draft_dir / "config.json").read_text())
        cfg = Eagle3Config.from_hf(raw, target.num_hidden_layers)
        files = weight_files(draft_dir)
    except (ValueError, OSError) as e:
        raise ValueError(f"{FLAG} {draft_dir}: not an EAGLE-3 drafter: {e}") from None
    names: set[str] = set()
    try:
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                names.update(handle.keys())
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{FLAG} {draft_dir}: cannot read the drafter's safetensors ({e})") from None
    own_embedding = "embed_tokens.weight" in names
    check_target(cfg, target, own_embedding, str(draft_dir))
    return cfg, files, own_embedding


def check_eagle3(draft_dir: str | Path, target: ModelConfig) -> Eagle3Config:
    """Config and weight names only (no tensors read): raise if the drafter cannot serve this target."""
    try:
        path = resolve_model_path(draft_dir)
    except ValueError as e:
        raise ValueError(f"{FLAG}: {e}") from None
    return _read_config(path, target)[0]


def load_eagle3(draft_dir: str | Path, target: ModelConfig, device: torch.device, dtype: torch.dtype) -> Eagle3Model:
    try:
        path = resolve_model_path(draft_dir)
    except ValueError as e:
        raise ValueError(f"{FLAG}: {e}") from None
    cfg, files, own_embedding = _read_config(path, target)
    tensors = dict(iter_tensors(files))
    with torch.device("meta"):
        model = Eagle3Model(cfg, own_embedding)
    model = model.to_empty(device="cpu")
    own = model.state_dict()
    if cfg.draft_vocab_size == cfg.vocab_size:  # identity mapping may be left out
        tensors.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        tensors.setdefault("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
    unexpected = sorted(set(tensors) - set(own))
    missing = sorted(set(own) - set(tensors))
    if unexpected or missing:
        raise ValueError(f"{FLAG} {path}: weights do not match the EAGLE-3 layout: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, t in tensors.items():
        if t.shape != own[name].shape:
            raise ValueError(f"{FLAG} {path}: weight {name} has shape {tuple(t.shape)}, "
                             f"config.json implies {tuple(own[name].shape)}")
    model.load_state_dict(tensors)
    model = model.to(device=device, dtype=dtype).eval()  # d2t/t2d keep their integer/bool dtypes
    model.requires_grad_(False)
    return model


def save_eagle3(model: Eagle3Model, cfg: Eagle3Config, path: str | Path) -> Path:
    """Write config.json + model.safetensors (atomically each) in the SGLang/vLLM layout."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    raw = replace(cfg, layer=replace(cfg.layer, torch_dtype=str(dtype).removeprefix("torch."))).to_hf()
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(raw, indent=2) + "\n")
    tmp.replace(out / "config.json")
    save_safetensors(state, out / "model.safetensors")
    return out


def init_random_eagle3(
    target: ModelConfig, path: str | Path, seed: int = 0, *, hidden_size: int | None = None,
    intermediate_size: int | None = None, num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None, head_dim: int | None = None, draft_vocab_size: int | None = None,
    draft_token_ids: list[int] | None = None, aux_layer_ids: tuple[int, ...] | None = None,
    own_embedding: bool = False, norm_before_residual: bool = False,
) -> Eagle3Config:
    """Write a random-weight drafter for `target` (sizes default to the target's).

    The draft vocabulary is `draft_token_ids` (e.g. the most frequent tokens) or the first
    `draft_vocab_size` ids (default: the whole vocabulary).
    """
    ids = sorted(set(draft_token_ids)) if draft_token_ids is not None else list(range(
        draft_vocab_size or target.vocab_size))
    if not ids or ids[0] < 0 or ids[-1] >= target.vocab_size:
        raise ValueError(f"draft token ids must lie in [0, {target.vocab_size}) and not be empty")
    heads = num_attention_heads or target.num_attention_heads
    layer = replace(
        target, architecture=ARCHITECTURE, hidden_size=hidden_size or target.hidden_size,
        intermediate_size=intermediate_size or target.intermediate_size, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=num_key_value_heads or target.num_key_value_heads,
        head_dim=head_dim or (hidden_size // heads if hidden_size else target.head_dim),
        tie_word_embeddings=False, attention_bias=False, o_proj_bias=False, mlp_bias=False, qk_norm=False,
        torch_dtype=None,
    )
    cfg = Eagle3Config(layer, len(ids), target.hidden_size,
                       aux_layer_ids or default_aux_layer_ids(target.num_hidden_layers), norm_before_residual)
    check_target(cfg, target, own_embedding, str(path))
    gen = torch.Generator().manual_seed(seed)
    model = Eagle3Model(cfg, own_embedding)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:  # norm weights: near 1, perturbed so that they matter
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                bound = p.shape[-1] ** -0.5
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
        draft = torch.tensor(ids, dtype=torch.long)
        model.d2t.copy_(draft - torch.arange(len(ids)))
        model.t2d.zero_()
        model.t2d[draft] = True
    save_eagle3(model, cfg, path)
    return cfg
