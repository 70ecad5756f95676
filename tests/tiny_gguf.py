"""Tiny GGUF files written with the `gguf` package from a tiny Hugging Face checkpoint (`tiny.make_checkpoint`),
laid out as llama.cpp's converter lays them out (q/k rows permuted for Llama, quantized blocks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file

ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row permutation of a Llama q/k projection (or bias)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, i, rest = hf.split(".", 3)
        stem, _, suffix = rest.rpartition(".")
        return f"blk.{i}.{_LAYER[stem]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def write_gguf(ckpt: Path, out: Path, quant: str = "Q4_1", skip_meta: tuple[str, ...] = (),
               odd_tensor: tuple[str, GGMLQuantizationType] | None = None) -> Path:
    """`ckpt` (config.json, model.safetensors, tokenizer.json) -> `out`. Projections in `quant` (Q4_0, Q4_1,
    Q8_0 or F16), the embedding Q8_0, norms F32. `skip_meta`: metadata keys left out; `odd_tensor`: one tensor
    (GGUF name) stored with another type's bytes."""
    cfg: dict[str, Any] = json.loads((ckpt / "config.json").read_text())
    arch = ARCH[cfg["architectures"][0]]
    w = GGUFWriter(str(out), arch)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    meta = {
        "block_count": lambda: w.add_block_count(cfg["num_hidden_layers"]),
        "context_length": lambda: w.add_context_length(cfg["max_position_embeddings"]),
        "embedding_length": lambda: w.add_embedding_length(cfg["hidden_size"]),
        "feed_forward_length": lambda: w.add_feed_forward_length(cfg["intermediate_size"]),
        "head_count": lambda: w.add_head_count(heads),
        "head_count_kv": lambda: w.add_head_count_kv(kv),
        "rms_eps": lambda: w.add_layer_norm_rms_eps(cfg["rms_norm_eps"]),
        "rope_freq_base": lambda: w.add_rope_freq_base(cfg.get("rope_theta", 10000.0)),
    }
    for key, add in meta.items():
        if key not in skip_meta:
            add()
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv_: kv_[1])
    specials = {t["content"] for t in tok.get("added_tokens", [])}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    pads = [f"[PAD{i}]" for i in range(len(vocab), cfg["vocab_size"])]  # as llama.cpp's converter pads the list
    w.add_token_list([t for t, _ in vocab] + pads)
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab] + [5] * len(pads))
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(cfg["eos_token_id"])
    state = load_file(str(ckpt / "model.safetensors"))
    for name, t in state.items():
        arr = t.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            arr = llama_cpp_permute(arr, heads)
        if arch == "llama" and ".k_proj." in name:
            arr = llama_cpp_permute(arr, kv)
        gname = gguf_name(name)
        if arr.ndim == 1:
            w.add_tensor(gname, arr.astype(np.float32))
            continue
        kind = GGMLQuantizationType.Q8_0 if "embed" in name else GGMLQuantizationType[quant]
        if odd_tensor is not None and gname == odd_tensor[0]:
            kind = odd_tensor[1]
            block, size = GGML_QUANT_SIZES[kind]
            raw = np.zeros((arr.shape[0], arr.shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=kind)
            continue
        data = arr.astype(np.float16) if kind == GGMLQuantizationType.F16 else quantize(arr, kind)
        w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def reference_logits(gguf_path: Path, ids: list[int]) -> torch.Tensor:
    """transformers' own GGUF loader (it un-permutes and dequantizes by itself) -> logits [T, V] float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]
