"""`--quantization auto|none|int4|int8`: a transform that swaps a loaded model's projections for `QuantLinear`s.

int4 takes a GGUF's Q4_0/Q4_1 blocks as they are stored (no re-quantizing; `models/gguf_quants.py`), and
quantizes any other weight to the same block form; int8 takes Q8_0 blocks as stored and cuts any other weight
into them. The LM head multiplies in int8 (`layers/quant.QuantHead`), from the file's Q8_0 blocks where it has
them (SmolLM2's tied embedding); the embedding lookup stays float. CPU only (`layers/csrc/qmatmul.cpp`).
`auto` is int4 for a GGUF holding 4-bit tensors on the CPU, else none.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specserve.layers.qkernel import pack_q8, quantize_q8
from specserve.layers.quant import GROUP, QuantHead, QuantLinear, quantize_q4
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
    head for an int8 `QuantHead`; returns how many projections were swapped (0 for `none`). `source`: the GGUF
    the weights came from, whose blocks are taken as they are stored."""
    if mode == "none":
        return 0
    q4 = source.q4() if source is not None and mode == "int4" else {}
    q8 = source.q8() if source is not None else {}
    swapped = 0
    for name, module in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if not isinstance(module, nn.Linear) or leaf == "lm_head" or module.in_features % GROUP:
            continue
        parent = model.get_submodule(name.rpartition(".")[0])
        bias = module.bias.detach() if module.bias is not None else None
        parts = [f"{name.rpartition('.')[0]}.{p}.weight" for p in _PARTS.get(leaf, (leaf,))]
        if mode == "int4":
            if all(p in q4 for p in parts):
                b = Q4Blocks.cat([q4[p] for p in parts])
                q, d, m = b.q, b.d, b.m
            else:
                q, d, m = quantize_q4(module.weight.detach())
            new = QuantLinear.from_int4(q, d, m, bias)
        elif all(p in q8 for p in parts):
            new = QuantLinear.from_q8(torch.cat([q8[p][0] for p in parts]), torch.cat([q8[p][1] for p in parts]), bias)
        else:
            new = QuantLinear.from_int8(module.weight.detach(), bias)
        setattr(parent, leaf, new)
        swapped += 1
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear) and head.bias is None and head.in_features % GROUP == 0:
        tied = getattr(model.config, "tie_word_embeddings", False)
        stored = q8.get("model.embed_tokens.weight" if tied else "lm_head.weight")
        q, d = stored if stored is not None else quantize_q8(head.weight.detach())
        model.lm_head = QuantHead(pack_q8(q, d), head.weight)
    return swapped
