"""Read a llama.cpp GGUF file: its metadata as a Hugging Face `config.json`, its tensors under HF names.

Architectures `llama`, `qwen2` and `qwen3` (the families `models/llama.py` runs). llama.cpp's converter permutes
the rows of a Llama checkpoint's q/k projections to pair each head's rotary halves as interleaved pairs;
`unpermute_order` undoes it (Qwen models rotate halves and are stored as they are). Every error names the file
and what is wrong.
"""

from __future__ import annotations

import re
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from specserve.models.gguf_header import read_header
from specserve.models.gguf_quants import SUPPORTED, Q4Blocks, dequantize, q4_blocks, q8_blocks

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
SKIPPED = ("rope_freqs.weight",)  # llama3 RoPE factors: the config's rope_scaling computes the same


@dataclass(frozen=True)
class GGUFTensor:
    name: str  # the HF name, e.g. model.layers.0.self_attn.q_proj.weight
    kind: str  # GGUF type name: F32, F16, BF16, Q8_0, Q4_0, Q4_1
    shape: tuple[int, ...]  # torch order, e.g. [N, K] for a projection
    raw: np.ndarray  # the stored bytes (a view of the memory-mapped file)


def hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> HF name; None for a tensor the model does not use."""
    if gguf_name in SKIPPED:
        return None
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{suffix}"
    m = _NAME.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK:
        raise ValueError(f"tensor {gguf_name!r} has no place in a llama/qwen model")
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"


def unpermute_order(rows: int, heads: int) -> torch.Tensor:
    """Row order that turns llama.cpp's permuted q/k rows back into HF's: per head, the rows are stored as
    (pair, half) and HF keeps (half, pair)."""
    half = rows // heads // 2
    idx = torch.arange(rows).view(heads, half, 2)  # stored row of (head, pair, half)
    return idx.transpose(1, 2).reshape(rows)


class GGUFModel:
    """An opened GGUF file: `metadata`, `config()` (config.json fields), `tensors()` and `q4()`."""

    def __init__(self, path: Path) -> None:
        """Parses the header (`gguf_header.read_header`); the tensors stay memory-mapped until read."""
        self.path = path
        if not path.is_file():
            raise ValueError(f"{path}: no such GGUF file")
        try:
            header = read_header(path)
        except (ValueError, struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a readable GGUF file ({e}); is it truncated or not a GGUF?") from None
        self.metadata: dict[str, Any] = header.metadata
        self._tensors = header.tensors
        arch = self.metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise ValueError(f"{path}: general.architecture is {arch!r}; specserve runs "
                             f"{', '.join(ARCHITECTURES)} GGUF files")
        self.arch: str = str(arch)
        kinds = {t.name: t.kind for t in self._tensors}
        bad = {n: k for n, k in kinds.items() if k not in SUPPORTED}
        if bad:
            name, kind = next(iter(bad.items()))
            raise ValueError(f"{path}: tensor {name} has type {kind} ({len(bad)} such tensors); specserve reads "
                             f"{', '.join(SUPPORTED)}: convert it with llama.cpp's llama-quantize to Q4_1, Q8_0 "
                             "or F16")

    def tensor_types(self) -> dict[str, int]:
        """How many tensors of each GGUF type the file holds."""
        return dict(Counter(t.kind for t in self._tensors))

    def meta(self, key: str, default: Any = ...) -> Any:
        """A metadata value; `{arch}.` is filled in. Missing without a default: a clear error."""
        key = key.replace("{arch}", self.arch)
        if key in self.metadata:
            return self.metadata[key]
        if default is ...:
            raise ValueError(f"{self.path}: GGUF metadata lacks {key}")
        return default

    def config(self) -> dict[str, Any]:
        """The Hugging Face config.json this file's metadata describes."""
        heads = int(self.meta("{arch}.attention.head_count"))
        hidden = int(self.meta("{arch}.embedding_length"))
        names = {t.name for t in self._tensors}
        embed = next((t for t in self._tensors if t.name == "token_embd.weight"), None)
        if embed is None:
            raise ValueError(f"{self.path}: no token_embd.weight tensor")
        vocab = int(embed.dims[-1])  # GGUF lists ne[0] (hidden) first; token lists may be shorter (unused rows)
        cfg: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            "vocab_size": int(self.meta("{arch}.vocab_size", vocab)),
            "hidden_size": hidden,
            "intermediate_size": int(self.meta("{arch}.feed_forward_length")),
            "num_hidden_layers": int(self.meta("{arch}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.meta("{arch}.attention.head_count_kv", heads)),
            "head_dim": int(self.meta("{arch}.attention.key_length", hidden // heads)),
            "max_position_embeddings": int(self.meta("{arch}.context_length")),
            "rms_norm_eps": float(self.meta("{arch}.attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self.meta("{arch}.rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "bos_token_id": self.meta("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self.meta("tokenizer.ggml.eos_token_id", None),
            "torch_dtype": "float32",
        }
        scaling = self.meta("{arch}.rope.scaling.type", None)
        if scaling in ("linear", "yarn"):
            cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(self.meta("{arch}.rope.scaling.factor"))}
            orig = self.meta("{arch}.rope.scaling.original_context_length", None)
            if orig is not None:
                cfg["rope_scaling"]["original_max_position_embeddings"] = int(orig)
        return cfg

    def _stored(self) -> Iterator[GGUFTensor]:
        for t in self._tensors:
            name = hf_name(t.name)
            if name is None:
                continue
            shape = tuple(reversed(t.dims))  # GGUF lists ne[0] (contiguous) first
            yield GGUFTensor(name, t.kind, shape, t.data)

    def _row_order(self, name: str, rows: int) -> torch.Tensor | None:
        """The un-permuting row order for a Llama q/k tensor, else None."""
        if self.arch != "llama":
            return None
        if ".self_attn.q_proj." in name:
            return unpermute_order(rows, int(self.meta("{arch}.attention.head_count")))
        if ".self_attn.k_proj." in name:
            heads = int(self.meta("{arch}.attention.head_count"))
            return unpermute_order(rows, int(self.meta("{arch}.attention.head_count_kv", heads)))
        return None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor), q/k rows in HF's order; a progress bar on stderr while it dequantizes."""
        for t in tqdm(list(self._stored()), desc=f"loading {self.path.name}", unit="tensor", leave=False,
                      disable=None):
            try:
                w = dequantize(t.raw, t.kind, t.shape)
            except ValueError as e:
                raise ValueError(f"{self.path}: tensor {t.name}: {e}; is the file truncated?") from None
            order = self._row_order(t.name, t.shape[0])
            yield t.name, (w[order] if order is not None else w)

    def q4(self) -> dict[str, Q4Blocks]:
        """Every Q4_0/Q4_1 projection as `Q4Blocks` (HF names, q/k rows in HF's order), for the int4 kernels."""
        out: dict[str, Q4Blocks] = {}
        for t in self._stored():
            if t.kind not in ("Q4_0", "Q4_1") or len(t.shape) != 2:
                continue
            blocks = q4_blocks(t.raw, t.kind, *t.shape)
            order = self._row_order(t.name, t.shape[0])
            out[t.name] = blocks.rows(order) if order is not None else blocks
        return out

    def q8(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Every Q8_0 2-D tensor as blocks (q [N, K] int8, d [N, K/32]), HF names, q/k rows in HF's order: the
        int8 kernel takes them as stored (SmolLM2's embedding, its tied head)."""
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for t in self._stored():
            if t.kind != "Q8_0" or len(t.shape) != 2:
                continue
            q, d = q8_blocks(t.raw, *t.shape)
            order = self._row_order(t.name, t.shape[0])
            out[t.name] = (q[order], d[order]) if order is not None else (q, d)
        return out
