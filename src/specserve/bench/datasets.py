"""Datasets for the serving sweep: `coding` (built in), `random` (seeded word salad), `agentic` (seeded multi-turn
conversations over real source files) or a JSONL file, resolved by `load_dataset` and sampled per level. The
prompts themselves are `prompts.py`'s, conversations `conversations.py`'s.

JSONL format, one prompt a line (blank lines are skipped):
  {"prompt": "text"}                                   completion-style
  {"messages": [{"role": "user", "content": "..."}]}   chat-style
  {"id": "c1", "turns": ["...", "..."]}                a conversation (see `Conversation`)
  optional "max_tokens": int                           overrides --output-len for that prompt
A file with at least one "turns" line is a conversation dataset: its other lines stay single requests.
A malformed line does not stop the sweep: it is skipped and reported as "FILE:LINE: reason" in
`Dataset.errors` (the run JSON keeps them). A missing file or a file without one usable line is a
`DatasetError`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.bench.conversations import Conversation, agentic_conversations, parse_conversation
from specserve.bench.prompts import CODING_PROMPTS, DatasetError, Prompt, random_prompts

BUILTIN = ("coding", "random", "agentic")


@dataclass(frozen=True)
class Dataset:
    name: str
    prompts: tuple[Prompt, ...]
    errors: tuple[str, ...] = ()  # "FILE:LINE: reason" for every skipped line
    # a conversation dataset: what each level sends (single prompts as one-turn conversations); else empty
    conversations: tuple[Conversation, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompts and not self.conversations:
            raise DatasetError(f"dataset {self.name!r} has no usable prompt")


def _parse_messages(raw: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, list) or not raw:
        raise ValueError('"messages" must be a non-empty list')
    out = []
    for m in raw:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError('every message needs string "role" and "content"')
        out.append((m["role"], m["content"]))
    return tuple(out)


def _parse_line(line: str) -> Prompt | Conversation:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise ValueError('"max_tokens" must be a positive integer')
    if isinstance(obj.get("prompt"), str) and obj["prompt"]:
        return Prompt(text=obj["prompt"], max_tokens=max_tokens)
    if "messages" in obj:
        return Prompt(messages=_parse_messages(obj["messages"]), max_tokens=max_tokens)
    if "turns" in obj:
        return parse_conversation(obj, max_tokens)
    raise ValueError('needs a non-empty string "prompt", a "messages" list or a "turns" list')


def load_jsonl(path: Path) -> Dataset:
    if not path.is_file():
        raise DatasetError(f"--dataset {path}: no such file (use coding, random, agentic or a .jsonl path)")
    items: list[Prompt | Conversation] = []
    errors: list[str] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                item = _parse_line(line)
            except ValueError as e:
                errors.append(f"{path}:{lineno}: {e}")
                continue
            if isinstance(item, Conversation) and not item.id:
                item = Conversation(f"line{lineno}", item.turns, item.max_tokens)
            items.append(item)
    if not items:
        detail = f"; first problem: {errors[0]}" if errors else ""
        raise DatasetError(f"--dataset {path}: no usable prompt line{detail}")
    prompts = tuple(i for i in items if isinstance(i, Prompt))
    if not any(isinstance(i, Conversation) for i in items):
        return Dataset(name=str(path), prompts=prompts, errors=tuple(errors))
    convs = tuple(i if isinstance(i, Conversation) else Conversation.single_request(f"line{n}", i)
                  for n, i in enumerate(items, start=1))
    return Dataset(name=str(path), prompts=prompts, errors=tuple(errors), conversations=convs)


def load_dataset(spec: str, num_prompts: int, seed: int = 0, random_input_len: int = 128,
                 agentic_file_chars: int = 3000) -> Dataset:
    """`coding`, `random`, `agentic` or a JSONL path. `random` makes num_prompts distinct prompts, `agentic`
    num_prompts conversations."""
    if spec == "agentic":
        return Dataset(name="agentic", prompts=(),
                       conversations=agentic_conversations(num_prompts, seed, agentic_file_chars))
    if spec == "coding":
        return Dataset(name="coding", prompts=tuple(Prompt(text=p) for p in CODING_PROMPTS))
    if spec == "random":
        return Dataset(name="random", prompts=random_prompts(num_prompts, random_input_len, seed))
    return load_jsonl(Path(spec))


def sample_prompts(dataset: Dataset, count: int, seed: int) -> list[Prompt]:
    """`count` prompts: the dataset shuffled with `seed`, cycled when it holds fewer than `count`."""
    if count < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {count}")
    order = list(dataset.prompts)
    random.Random(seed).shuffle(order)
    return [order[i % len(order)] for i in range(count)]


def sample_conversations(dataset: Dataset, count: int, seed: int) -> list[Conversation]:
    """`count` conversations, shuffled with `seed` and cycled as `sample_prompts` does."""
    if count < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {count}")
    order = list(dataset.conversations)
    random.Random(seed).shuffle(order)
    return [order[i % len(order)] for i in range(count)]
