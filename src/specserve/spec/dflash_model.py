"""The DFlash block drafter's weights: config, module, checkpoint IO, in the public `DFlashDraftModel` layout.

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
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

from specserve.config import ModelConfig, SpeculativeConfig
from specserve.kv.contiguous import KVCache
from specserve.layers.attention import attend
from specserve.layers.norm import RMSNorm
from specserve.layers.rope import RotaryEmbedding, apply_rope
from specserve.models.llama import MLP
from specserve.models.loader import resolve_model_path
from specserve.models.weights import fuse_hf_state, iter_tensors, save_safetensors, split_to_hf, weight_files

ARCH = "DFlashDraftModel"
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

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (the root plus one mask), got {self.block_size}")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ValueError(f"dflash_config.target_layer_ids must be non-empty and >= 0, got {self.target_layer_ids}")
        if self.num_target_layers is not None and max(self.target_layer_ids) >= self.num_target_layers:
            raise ValueError(f"dflash_config.target_layer_ids {list(self.target_layer_ids)} must be < "
                             f"num_target_layers {self.num_target_layers}")
        if not 0 <= self.mask_token_id < self.body.vocab_size:
            raise ValueError(f"dflash_config.mask_token_id {self.mask_token_id} must be in [0, vocab_size "
                             f"{self.body.vocab_size})")

    @property
    def capture(self) -> tuple[int, ...]:
        """Our `capture` indices (HF hidden_states) of the tapped layer outputs, in fc's input order."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> DFlashConfig:
        archs = raw.get("architectures") or []
        if ARCH not in archs:
            raise ValueError(f"architectures {archs} is not [{ARCH!r}]; this is not a DFlash drafter checkpoint")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        if raw.get("is_causal") or any(t != "full_attention" for t in raw.get("layer_types") or []):
            raise ValueError("causal or sliding-window draft layers (is_causal / layer_types) are not supported")
        dcfg = dict(raw.get("dflash_config") or {})
        for key in ("conv_kernel_size", "selector_rank", "projector_type", "final_logit_softcapping"):
            if dcfg.get(key):
                raise ValueError(f"dflash_config.{key} (a DFlash variant) is not supported")
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
        return cls(body, tuple(int(i) for i in ids), int(mask), int(get("block_size") or 16),
                   None if num_target is None else int(num_target))

    def to_hf(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        b = self.body
        out: dict[str, Any] = {
            "architectures": [ARCH], "model_type": "qwen3",
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

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [B, C, H] (projected context) -> k, v [B, Hkv, C, D]; only the k/v rows of qkv_proj are used."""
        b, c, _ = ctx.shape
        bias = None if self.qkv_proj.bias is None else self.qkv_proj.bias[self.q_size:]
        k, v = F.linear(ctx, self.qkv_proj.weight[self.q_size:], bias).split(self.kv_size, dim=-1)
        k = apply_rope(self.k_norm(k.view(b, c, self.n_kv, self.head_dim)).transpose(1, 2), cos, sin)
        return k, v.view(b, c, self.n_kv, self.head_dim).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        ctx_k: torch.Tensor, ctx_v: torch.Tensor, mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [B, Q, H] block tokens; ctx_k/ctx_v [B, Hkv, C, D]; mask [B|1, 1, Q, C+Q] or None (all visible)."""
        b, q_len, _ = x.shape
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = apply_rope(self.q_norm(q.view(b, q_len, self.n_heads, self.head_dim)).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_norm(k.view(b, q_len, self.n_kv, self.head_dim)).transpose(1, 2), cos, sin)
        v = v.view(b, q_len, self.n_kv, self.head_dim).transpose(1, 2)
        out = attend(q, torch.cat((ctx_k, k), dim=2), torch.cat((ctx_v, v), dim=2), mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.q_size))  # [B, Q, H]


class DFlashLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx_k: torch.Tensor, ctx_v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        body = cfg.body
        self.fc = nn.Linear(len(cfg.target_layer_ids) * body.hidden_size, body.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(body.hidden_size, body.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(body) for _ in range(body.num_hidden_layers))
        self.norm = RMSNorm(body.hidden_size, body.rms_norm_eps)
        self.rotary = RotaryEmbedding(body.rope, body.head_dim)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """features [B, C, n*H] tapped target states, positions [B, C] -> per layer k, v [B, Hkv, C, D]."""
        ctx = self.hidden_norm(self.fc(features))  # [B, C, H]
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        return [cast(DFlashLayer, layer).self_attn.context_kv(ctx, cos, sin) for layer in self.layers]

    def forward(self, noise: torch.Tensor, positions: torch.Tensor, context: ContextKV,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """noise [B, Q, H] block embeddings at positions [B, Q] -> final-normed hidden [B, Q, H] (target LM head
        ready). mask [B|1, 1, Q, C+Q] bool over (context, block) keys; None = every key visible."""
        x = noise
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer, (k, v) in zip(self.layers, context, strict=True):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    def append_context(self, cache: KVCache, start: int, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Write the context K/V of features [B, T, n*H] at positions [B, T] into cache slots [start, start+T)."""
        view = cache.view(start, features.shape[1], causal=False)
        for i, (k, v) in enumerate(self.context_kv(features, positions)):
            view.update(i, k, v)

    @staticmethod
    def cached_context(cache: KVCache, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[:, :, :length], v[:, :, :length]) for k, v in zip(cache.k, cache.v, strict=True)]

    def train_blocks(self, features: torch.Tensor, noise: torch.Tensor, anchors: torch.Tensor,
                     lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Training forward: features [B, T, n*H] (context at positions 0..T-1), noise [B, N*bs, H] embeddings of
        N blocks [anchor token, MASK...], anchors [B, N] -> logits [B, N*bs, V]. Block j sits at anchors[:, j] + k
        and sees context positions < anchors[:, j] plus itself (bidirectionally), not the other blocks."""
        b, t, _ = features.shape
        bs = noise.shape[1] // anchors.shape[1]
        offsets = torch.arange(bs, device=anchors.device)
        positions = (anchors[:, :, None] + offsets).reshape(b, -1)  # [B, N*bs]
        context = self.context_kv(features, torch.arange(t, device=features.device).expand(b, t))
        return lm_head(self(noise, positions, context, block_attention_mask(anchors, bs, t)))


def block_attention_mask(anchors: torch.Tensor, block_size: int, ctx_len: int) -> torch.Tensor:
    """anchors [B, N] -> [B, 1, N*bs, ctx_len + N*bs] bool: block j sees context < anchors[:, j] and itself."""
    block = torch.arange(anchors.shape[1] * block_size, device=anchors.device) // block_size  # [Q]
    sees_ctx = torch.arange(ctx_len, device=anchors.device) < anchors[:, block, None]  # [B, Q, T]
    sees_block = (block[:, None] == block[None, :]).expand(anchors.shape[0], -1, -1)  # [B, Q, Q]
    return torch.cat((sees_ctx, sees_block), dim=-1)[:, None]


# ---- checkpoint IO -------------------------------------------------------------------------------------------

def read_dflash_config(model_dir: Path) -> DFlashConfig:
    try:
        return DFlashConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    except (ValueError, OSError) as e:
        raise ValueError(f"{FLAG} {model_dir}: {e}") from None


def check_against_target(cfg: DFlashConfig, target: ModelConfig, where: str) -> None:
    """The drafter shares the target's embedding and LM head and reads its layers: sizes must agree."""
    b = cfg.body
    if b.hidden_size != target.hidden_size:
        raise ValueError(f"{where}: drafter hidden_size {b.hidden_size} != target hidden_size {target.hidden_size} "
                         "(DFlash uses the target's embedding and LM head); use a drafter trained for this target")
    if b.vocab_size != target.vocab_size:
        raise ValueError(f"{where}: drafter vocab_size {b.vocab_size} != target vocab_size {target.vocab_size}")
    if cfg.num_target_layers is not None and cfg.num_target_layers != target.num_hidden_layers:
        raise ValueError(f"{where}: drafter num_target_layers {cfg.num_target_layers} != the target's "
                         f"{target.num_hidden_layers} layers; use a drafter trained for this target")
    if max(cfg.target_layer_ids) >= target.num_hidden_layers:
        raise ValueError(f"{where}: dflash_config.target_layer_ids {list(cfg.target_layer_ids)} exceed the "
                         f"target's {target.num_hidden_layers} layers")


def dflash_block_size(spec: SpeculativeConfig, cfg: DFlashConfig) -> int:
    """The block drafted per round: --speculative-dflash-block-size if set, else the drafter's. A shorter block
    than trained is allowed (the reference shortens it near max length); a longer one was never trained."""
    bs = spec.dflash_block_size or cfg.block_size
    if bs > cfg.block_size:
        raise ValueError(f"--speculative-dflash-block-size {bs} exceeds the block_size {cfg.block_size} the drafter "
                         f"at {FLAG} {spec.draft_model_path} was trained with; use at most {cfg.block_size}")
    if spec.tree == "chain" and spec.num_draft_tokens > bs:
        raise ValueError(f"--speculative-num-draft-tokens {spec.num_draft_tokens} exceeds the DFlash block "
                         f"({bs}); a chain verifies at most block_size tokens")
    return bs


def _expected_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        state = DFlashDraftModel(cfg).state_dict()
    return {k: tuple(v.shape) for k, v in split_to_hf(state, cfg.body).items()}


def _check_weights(model_dir: Path, cfg: DFlashConfig) -> list[Path]:
    """Compare the safetensors headers with the config (no tensor data read); returns the weight files."""
    where = f"{FLAG} {model_dir}"
    try:
        files = weight_files(model_dir)
        found: dict[str, tuple[int, ...]] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    found[name.removeprefix("model.")] = tuple(handle.get_slice(name).get_shape())
    except (ValueError, SafetensorError, OSError) as e:
        raise ValueError(f"{where}: {e}") from None
    expected = _expected_shapes(cfg)
    missing, extra = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    if missing or extra:
        raise ValueError(f"{where}: weights do not match a {ARCH} config: missing {missing[:4]}, "
                         f"unexpected {extra[:4]}")
    for name, shape in expected.items():
        if found[name] != shape:
            hint = (f" (= len(target_layer_ids) {len(cfg.target_layer_ids)} x hidden_size)" if name == "fc.weight"
                    else "")
            raise ValueError(f"{where}: {name} has shape {list(found[name])}, config implies {list(shape)}{hint}")
    return files


def check_dflash(draft_dir: Path, target_cfg: ModelConfig, spec: SpeculativeConfig) -> DFlashConfig:
    """Everything that can be checked without reading weights: config, target match, block size, weight shapes."""
    cfg = read_dflash_config(draft_dir)
    check_against_target(cfg, target_cfg, f"{FLAG} {draft_dir}")
    dflash_block_size(spec, cfg)
    _check_weights(draft_dir, cfg)
    return cfg


def load_dflash(path: str | Path, target_cfg: ModelConfig, device: torch.device,
                dtype: torch.dtype) -> DFlashDraftModel:
    """A checkpoint directory (or bundled name) -> eval-mode module with `.config`, validated against the target."""
    try:
        model_dir = resolve_model_path(path)
    except ValueError as e:
        raise ValueError(f"{FLAG}: {e}") from None
    cfg = read_dflash_config(model_dir)
    check_against_target(cfg, target_cfg, f"{FLAG} {model_dir}")
    files = _check_weights(model_dir, cfg)
    tensors = {f"model.{k.removeprefix('model.')}": t for k, t in iter_tensors(files)}
    fused = {k.removeprefix("model."): t for k, t in fuse_hf_state(tensors).items()}
    with torch.device("meta"):
        module = DFlashDraftModel(cfg)
    module = module.to_empty(device="cpu")
    module.load_state_dict(fused, strict=True)
    module = module.to(device=device, dtype=dtype).eval()
    module.requires_grad_(False)
    return module


def save_dflash(module: DFlashDraftModel, cfg: DFlashConfig, path: Path) -> None:
    """Write config.json + model.safetensors in the public layout (split q/k/v and gate/up)."""
    path.mkdir(parents=True, exist_ok=True)
    state = split_to_hf({k: v.detach() for k, v in module.state_dict().items()}, cfg.body)
    save_safetensors(state, path / "model.safetensors")
    dtype = next(module.parameters()).dtype
    (path / "config.json").write_text(json.dumps(cfg.to_hf(dtype), indent=2) + "\n")


def init_random_dflash(
    target_cfg: ModelConfig, path: Path, seed: int = 0, *, num_hidden_layers: int = 2, block_size: int = 16,
    target_layer_ids: Sequence[int] | None = None, mask_token_id: int | None = None,
    intermediate_size: int | None = None, num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None, head_dim: int | None = None,
) -> DFlashConfig:
    """Write a random-weight drafter for `target_cfg` (HF-style init: N(0, 0.02) weights, unit norms).
    Defaults: the target's head layout, num_hidden_layers tapped layers spread by `default_target_layer_ids`,
    mask token = the last vocabulary id (padded vocabularies leave it unused)."""
    body = replace(
        target_cfg, architecture=ARCH, num_hidden_layers=num_hidden_layers, qk_norm=True, tie_word_embeddings=False,
        intermediate_size=intermediate_size or target_cfg.intermediate_size,
        num_attention_heads=num_attention_heads or target_cfg.num_attention_heads,
        num_key_value_heads=num_key_value_heads or target_cfg.num_key_value_heads,
        head_dim=head_dim or target_cfg.head_dim, attention_bias=False, o_proj_bias=False, mlp_bias=False,
    )
    ids = tuple(target_layer_ids or default_target_layer_ids(target_cfg.num_hidden_layers, num_hidden_layers))
    mask = target_cfg.vocab_size - 1 if mask_token_id is None else mask_token_id
    cfg = DFlashConfig(body, ids, mask, block_size, target_cfg.num_hidden_layers)
    module = DFlashDraftModel(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    save_dflash(module, cfg, path)
    return cfg
