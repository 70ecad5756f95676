"""Reading and writing safetensors checkpoints, and the HF <-> fused parameter names."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specserve.config import ModelConfig

_QKV = re.compile(r"^(model\.layers\.\d+\.self_attn\.)([qkv])_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"^(model\.layers\.\d+\.mlp\.)(gate|up)_proj\.(weight|bias)$")


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weights found")
    for f in files:
        if not f.exists():
            raise ValueError(f"{f}: listed in the safetensors index but missing")
    return files


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    yield name, handle.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f}: cannot read safetensors file ({e}); is it truncated or corrupt?") from None


def fuse_hf_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names (q/k/v_proj, gate/up_proj) -> our fused names (qkv_proj, gate_up_proj)."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _QKV.match(name) or _GATE_UP.match(name)
        if m is None:
            out[name] = t
            continue
        fused = m.group(1) + ("qkv_proj." if "attn" in m.group(1) else "gate_up_proj.") + m.group(3)
        parts.setdefault(fused, {})[m.group(2)] = t
    for fused, p in parts.items():
        order = ("q", "k", "v") if "qkv" in fused else ("gate", "up")
        missing = [o for o in order if o not in p]
        if missing:
            raise ValueError(f"checkpoint lacks {fused} part(s) {missing}")
        out[fused] = torch.cat([p[o] for o in order], dim=0)
    return out


def split_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of `fuse_hf_state`: our fused parameters -> HF checkpoint names."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.startswith("rotary"):
            continue
        if ".qkv_proj." in name:
            for part, chunk in zip("qkv", t.split((q, kv, kv), dim=0), strict=True):
                out[name.replace("qkv_proj", f"{part}_proj")] = chunk.contiguous()
        elif ".gate_up_proj." in name:
            gate, up = t.split(cfg.intermediate_size, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        else:
            out[name] = t.contiguous()
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write atomically: a temp file renamed into place, so a failed write keeps the old file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)
