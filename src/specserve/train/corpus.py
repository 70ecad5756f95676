"""The demo corpus: the Python standard library's own source, split by file into train/validation.

Only the standard library is used for training, so the code of installed third-party
packages stays unseen and can serve as held-out evaluation data.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>", "<|mask|>"]
# Plain (non-special) added tokens: they must survive decoding so tool calls can be parsed.
ADDED_TOKENS = ["<tool_call>", "</tool_call>"]

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Answer a call as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] if message['content'] is string else '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def stdlib_files() -> list[Path]:
    """Every .py file of the running interpreter's standard library (site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def is_validation(path: Path, fraction: float = 0.02) -> bool:
    """Deterministic file-level split: a stable hash of the file name relative to the stdlib root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    digest = hashlib.sha256(str(path.relative_to(root)).encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < fraction


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens(ADDED_TOKENS)
    return tok
