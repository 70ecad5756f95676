"""Load a Hugging Face checkpoint directory (config.json + safetensors) into our model code."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.models.registry import build
from specserve.models.weights import fuse_hf_state, iter_tensors, weight_files

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "models"
BUNDLED = {"demo": "demo", "demo-eagle3": "demo-eagle3", "demo-dflash": "demo-dflash"}


def resolve_model_path(name_or_path: str | Path) -> Path:
    """`demo` (and the bundled drafters) resolve to package data; anything else is a local directory."""
    name = str(name_or_path)
    if name in BUNDLED:
        path = ASSETS / BUNDLED[name]
        if not (path / "config.json").exists():
            how = "specserve train-target" if name == "demo" else f"specserve train {name.split('-')[1]}"
            raise ValueError(f"bundled model {name!r} is not present at {path}; build it with `{how}`")
        return path
    path = Path(name).expanduser()
    if not path.exists():
        raise ValueError(f"model path {path} does not exist (and is not a bundled name: {', '.join(BUNDLED)})")
    if not path.is_dir():
        raise ValueError(f"model path {path} is not a directory; pass a Hugging Face checkpoint directory")
    if not (path / "config.json").exists():
        raise ValueError(f"{path}: no config.json; is this a Hugging Face checkpoint directory?")
    return path


def load_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_file(model_dir / "config.json")


def load_state_into(module: nn.Module, model_dir: Path, strict_missing: bool = True) -> None:
    """Load every tensor of `model_dir` into `module` (HF names fused to ours)."""
    files = weight_files(model_dir)
    tensors = fuse_hf_state(dict(iter_tensors(files)))
    own = module.state_dict()
    tied = getattr(getattr(module, "config", None), "tie_word_embeddings", False)
    unexpected = [k for k in tensors if k not in own]
    if unexpected:
        raise ValueError(f"{model_dir}: unexpected weights {unexpected[:5]} for this architecture")
    missing = [k for k in own if k not in tensors and not (tied and k == "lm_head.weight")]
    if missing and strict_missing:
        raise ValueError(f"{model_dir}: weights missing from the checkpoint: {missing[:5]}")
    for name, t in tensors.items():
        if own[name].shape != t.shape:
            raise ValueError(
                f"{model_dir}: weight {name} has shape {tuple(t.shape)}, config implies {tuple(own[name].shape)}"
            )
    module.load_state_dict(tensors, strict=False)


def load_model(
    name_or_path: str | Path, device: torch.device, dtype: torch.dtype
) -> tuple[nn.Module, ModelConfig, Path]:
    model_dir = resolve_model_path(name_or_path)
    cfg = load_config(model_dir)
    with torch.device("meta"):
        model = build(cfg)
    model = model.to_empty(device="cpu")
    load_state_into(model, model_dir)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # type: ignore[union-attr]
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    return model, cfg, model_dir
