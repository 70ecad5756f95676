"""Tiny random-weight Hugging Face checkpoints, made with `transformers` itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_VOCAB = 320

BASE: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-6, eos_token_id=0, bos_token_id=0,
)


def make_checkpoint(path: Path, arch: str, seed: int = 0, tokenizer: bool = True, **overrides: Any) -> Path:
    import transformers

    kw = {**BASE, **overrides}
    if arch == "LlamaForCausalLM":
        cfg = transformers.LlamaConfig(**kw)
        cls = transformers.LlamaForCausalLM
    elif arch == "Qwen2ForCausalLM":
        cfg = transformers.Qwen2Config(**kw)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "Qwen3ForCausalLM":
        kw.setdefault("head_dim", 16)
        cfg = transformers.Qwen3Config(**kw)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():  # norms start at 1; perturb them so parity means something
            p.add_(torch.randn_like(p) * 0.02)
        # Sharpen the output distribution: near-ties between implementations would make greedy
        # comparisons depend on rounding rather than on correctness.
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer and kw["vocab_size"] >= 300:
        write_tokenizer(path, kw["vocab_size"])
    return path


def tokenizer_texts() -> list[str]:
    """A small fixed corpus (a few standard-library files) for the tiny tokenizers."""
    import json as _json
    import textwrap as _textwrap

    from specserve.train import corpus

    texts = [corpus.read_text(p) or "" for p in corpus.stdlib_files() if p.name in ("textwrap.py", "json/encoder.py")]
    if not any(texts):
        texts = [_textwrap.__doc__ or "", _json.__doc__ or ""]
    return texts


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """Byte-level BPE with the demo's special tokens and chat template, `vocab_size` entries in all."""
    import json

    from specserve.train import corpus

    tok = corpus.train_tokenizer(tokenizer_texts(), vocab_size - len(corpus.ADDED_TOKENS))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": corpus.EOS, "pad_token": corpus.EOS,
        "chat_template": corpus.CHAT_TEMPLATE,
    }))
