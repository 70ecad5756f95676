"""EAGLE-3 drafter checkpoints: check a directory against the target, load, save, and write random-weight
drafters (the layout and the aux-layer-id conventions: `speculative/eagle3/model.py`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specserve.config import ModelConfig
from specserve.models.loader import resolve_model_path
from specserve.models.weights import iter_tensors, save_safetensors, weight_files
from specserve.speculative.eagle3.model import (
    ARCHITECTURE,
    AUX_FIELD,
    FLAG,
    Eagle3Config,
    Eagle3Model,
    default_aux_layer_ids,
)


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
