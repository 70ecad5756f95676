"""A GGUF file's tokenizer as Hugging Face `tokenizer.json` + `tokenizer_config.json` contents.

Only byte-level BPE (`tokenizer.ggml.model = gpt2`) is built. llama.cpp chooses how text is split before BPE by
`tokenizer.ggml.pre`; `PRE_SPLITS` holds the splits of the names we build, written to give llama.cpp's ids:
`smollm` (and the StarCoder family) first isolates every digit (`\\p{N}`), then applies GPT-2's regex; `gpt2`
applies GPT-2's regex alone. Control and user-defined tokens become special added tokens, matched whole in text.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (1 = normal)
DIGITS_FIRST = ("smollm", "starcoder", "refact", "codeshell")
PRE_SPLITS = ("gpt2", "gpt-2", *DIGITS_FIRST)


def build_tokenizer(meta: dict[str, Any], source: str) -> HFTokenizer:
    """`meta`: the GGUF metadata (`GGUFModel.metadata`); `source` names the file in errors."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{source}: tokenizer.ggml.model is {model!r}; specserve builds byte-level BPE ('gpt2') "
                         "GGUF tokenizers only")
    pre = str(meta.get("tokenizer.ggml.pre", "gpt2"))
    if pre not in PRE_SPLITS:
        raise ValueError(f"{source}: tokenizer.ggml.pre {pre!r} is not one specserve splits like llama.cpp; "
                         f"known: {', '.join(PRE_SPLITS)}")
    try:
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    except KeyError as e:
        raise ValueError(f"{source}: GGUF metadata lacks {e.args[0]}") from None
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in DIGITS_FIRST:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), gpt2])
    else:
        tok.pre_tokenizer = gpt2
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
    tok.add_special_tokens(specials)
    return tok


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """`tokenizer_config.json`: chat template and BOS/EOS strings from the metadata."""
    tokens = meta.get("tokenizer.ggml.tokens") or []

    def token(key: str) -> str | None:
        i = meta.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    cfg: dict[str, Any] = {
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    }
    if meta.get("tokenizer.chat_template"):
        cfg["chat_template"] = str(meta["tokenizer.chat_template"])
    return cfg
