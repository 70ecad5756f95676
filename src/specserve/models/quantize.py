"""`--quantization auto|none|int4|int8`: a transform that swaps a loaded model's projections for `QuantLinear`s.

int4 takes a GGUF's Q4_0/Q4_1 blocks as they are stored (no re-quantizing; `models/gguf_quants.py`), and
quantizes any other weight to the same block form; int8 quantizes per output channel. The LM head (in a tied
model also the embedding, which stays float) multiplies in bf16 (`layers/quant.BF16Head`). CPU only: the kernels
are PyTorch's CPU ones. `auto` is int4 for a GGUF holding 4-bit tensors on the CPU, else none.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specserve.layers.quant import GROUP, BF16Head, QuantLinear, quantize_q4
from specserve.models.gguf import GGUFModel
from specserve.models.gguf_dir import gguf_tensor_types
from specserve.models.gguf_quants import Q4Blocks

QUANTIZATIONS = ("auto", "none", "int4", "int8")
_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def check_quantization(name: str) -> str:
    if name not in QUANTIZATIONS:
        raise ValueError(f"--quantization {name!r} is not one of {', '.join(QUANTIZATIONS)}")
    return name


def resolve_quantization(name: str | None, model_dir: Path, device: torch.device) -> str:
    """`auto` (or None) -> the mode this checkpoint and device run; an explicit mode is checked."""
    mode = check_quantization(name or "auto")
    if mode == "auto":
        types = gguf_tensor_types(model_dir)
        if device.type != "cpu" or not types:
            return "none"
        return "int4" if types.get("Q4_0", 0) + types.get("Q4_1", 0) else "none"
    if mode != "none" and device.type != "cpu":
        raise ValueError(f"--quantization {mode} runs on the CPU only (PyTorch's CPU int4/int8 kernels); on "
                         f"{device} use --quantization none with --dtype bfloat16")
    return mode


def quantize_model(model: nn.Module, mode: str, source: GGUFModel | None = None) -> int:
    """Swap every decoder projection of `model` (a loaded `CausalLM`) for a `QuantLinear` of `mode` and its LM
    head for a `BF16Head`; returns how many projections were swapped (0 for `none`). `source`: the GGUF the
    weights came from, whose 4-bit blocks int4 takes as they are."""
    if mode == "none":
        return 0
    blocks = source.q4() if source is not None and mode == "int4" else {}
    swapped = 0
    for name, module in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if not isinstance(module, nn.Linear) or leaf == "lm_head" or module.in_features % GROUP:
            continue
        parent = model.get_submodule(name.rpartition(".")[0])
        bias = module.bias.detach() if module.bias is not None else None
        if mode == "int4":
            parts = [f"{name.rpartition('.')[0]}.{p}.weight" for p in _PARTS.get(leaf, (leaf,))]
            if all(p in blocks for p in parts):
                b = Q4Blocks.cat([blocks[p] for p in parts])
                q, d, m = b.q, b.d, b.m
            else:
                q, d, m = quantize_q4(module.weight.detach())
            new = QuantLinear.from_int4(q, d, m, bias)
        else:
            new = QuantLinear.from_int8(module.weight.detach(), bias)
        setattr(parent, leaf, new)
        swapped += 1
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        model.lm_head = BF16Head(head)
    return swapped
