"""Prompts for the serving sweep: `coding` (built in), `random` (seeded word salad), `agentic` (seeded multi-turn
conversations over real source files) or a JSONL file.

JSONL format, one prompt a line (blank lines are skipped):
  {"prompt": "text"}                                   completion-style
  {"messages": [{"role": "user", "content": "..."}]}   chat-style
  {"id": "c1", "turns": ["...", "..."]}                a conversation (see `Conversation`)
  optional "max_tokens": int                           overrides --output-len for that prompt
A file with at least one "turns" line is a conversation dataset: its other lines stay single requests.
A malformed line does not stop the sweep: it is skipped and reported as "FILE:LINE: reason" in
`Dataset.errors` (the run JSON keeps them). A missing file or a file without one usable line is a
`DatasetError`.

`random` prompts are words drawn from a fixed list, so their length is given in words, not tokens
(no tokenizer is needed on the client); usage.prompt_tokens reports the real count.
"""

from __future__ import annotations

import json
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUILTIN = ("coding", "random", "agentic")

CODING_PROMPTS: tuple[str, ...] = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Implement binary search over a sorted Python list and return the index or -1.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that counts word frequencies in a text and returns the ten most common.",
    "Implement quicksort in Python without using the built-in sort.",
    "Write a Python function that flattens an arbitrarily nested list of integers.",
    "Write a Python generator that yields prime numbers forever.",
    "Write a Python function that parses a query string like 'a=1&b=2' into a dict.",
    "Implement an LRU cache class in Python with get and put in O(1).",
    "Write a Python function that rotates an n x n matrix by 90 degrees in place.",
    "Write a Python function that validates balanced brackets in a string of ()[]{}.",
    "Write a Python dataclass for a 2D point with distance and midpoint methods.",
    "Write a Python function that groups a list of words into anagram groups.",
    "Implement breadth-first search on a graph given as an adjacency dict in Python.",
    "Write a Python context manager that times the block it wraps and prints the duration.",
    "Write a Python function that converts a Roman numeral string to an integer.",
    "Write an asyncio Python function that fetches several URLs concurrently with a limit of 5.",
    "Write a Python function that reads a CSV file and returns the average of one numeric column.",
)

_WORD_TEXT = (
    "the of and to in is for on with as by at from that this it be are was or an not data value list "
    "index model token server request cache block tree draft target accept step layer batch queue time "
    "python function class return import yield async await loop file path string number result error "
    "test check build run start stop read write open close send receive state config option default"
)


class DatasetError(ValueError):
    """The dataset cannot be used at all (missing file, no valid line, unknown name)."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: either plain text or chat messages, and an optional per-prompt output length."""

    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) pairs
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise ValueError("Prompt needs exactly one of text or messages")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"Prompt.max_tokens must be >= 1, got {self.max_tokens}")

    def as_text(self) -> str:
        """For /v1/completions: chat messages are joined as 'role: content' lines."""
        if self.text is not None:
            return self.text
        assert self.messages is not None
        return "\n".join(f"{role}: {content}" for role, content in self.messages)

    def as_messages(self) -> list[dict[str, str]]:
        """For /v1/chat/completions: plain text becomes one user message."""
        if self.messages is not None:
            return [{"role": role, "content": content} for role, content in self.messages]
        assert self.text is not None
        return [{"role": "user", "content": self.text}]


Message = tuple[str, str]  # (role, content)
TURN_ROLES = ("user", "tool", "system")


@dataclass(frozen=True)
class Conversation:
    """Turns sent one at a time, each request carrying the whole history: the messages of every turn so far and
    the assistant's earlier answers. A turn is the messages it adds (a user message; tool results as `tool`
    messages). `single`: a plain prompt line of a conversation dataset, sent as it is (one request).

    JSONL: {"id": "c1", "turns": [TURN, ...], "max_tokens": 64}, a TURN being a string (a user message), a
    {"role": "user"|"tool"|"system", "content": "..."} object or a list of those two."""

    id: str
    turns: tuple[tuple[Message, ...], ...]
    max_tokens: int | None = None
    single: Prompt | None = None

    def __post_init__(self) -> None:
        if self.single is None and (not self.turns or not all(self.turns)):
            raise ValueError("a conversation needs at least one turn, each with at least one message")

    @classmethod
    def single_request(cls, conv_id: str, prompt: Prompt) -> Conversation:
        return cls(conv_id, (), prompt.max_tokens, single=prompt)

    @property
    def num_turns(self) -> int:
        return 1 if self.single is not None else len(self.turns)

    def messages(self, turn: int, answers: list[str]) -> list[dict[str, str]]:
        """Chat messages of request `turn`: turns 0..turn with the assistant's answers to the earlier ones."""
        if self.single is not None:
            return self.single.as_messages()
        out: list[dict[str, str]] = []
        for k in range(turn + 1):
            out += [{"role": r, "content": c} for r, c in self.turns[k]]
            if k < turn:
                out.append({"role": "assistant", "content": answers[k]})
        return out

    def transcript(self, turn: int, answers: list[str]) -> str:
        """The completion prompt of request `turn`: 'role: content' lines, each answer after 'assistant: ', so
        a turn's prompt starts with the previous turn's prompt and answer (the prefix cache can reuse them)."""
        if self.single is not None:
            return self.single.as_text()
        parts: list[str] = []
        for k in range(turn + 1):
            parts += [f"{r}: {c}\n" for r, c in self.turns[k]]
            parts.append("assistant: " + (answers[k] + "\n" if k < turn else ""))
        return "".join(parts)


def _parse_turn(raw: Any) -> tuple[Message, ...]:
    out = []
    for m in raw if isinstance(raw, list) else [raw]:
        if isinstance(m, str) and m:
            out.append(("user", m))
        elif isinstance(m, dict) and m.get("role") in TURN_ROLES and isinstance(m.get("content"), str):
            out.append((m["role"], m["content"]))
        else:
            raise ValueError(f'a turn is a non-empty string (a user message), a {{"role": {"|".join(TURN_ROLES)}, '
                             '"content": str}} object, or a list of them')
    if not out:
        raise ValueError("a turn needs at least one message")
    return tuple(out)


def parse_conversation(obj: dict[str, Any], max_tokens: int | None) -> Conversation:
    turns = obj.get("turns")
    if not isinstance(turns, list) or not turns:
        raise ValueError('"turns" must be a non-empty list')
    conv_id = obj.get("id", "")
    return Conversation(str(conv_id), tuple(_parse_turn(t) for t in turns), max_tokens)


AGENTIC_TASKS = (
    "add type hints to every function that lacks them",
    "add a docstring to each public function and class",
    "split the longest function into smaller helpers",
    "add input validation that raises ValueError with a clear message",
    "replace any manual loops that build lists with comprehensions where it reads better",
    "add logging at the points where errors are handled",
)
AGENTIC_FOLLOW_UPS = (
    "The tests fail with the output above. Fix the code and show the changed functions in full.",
    "Good. Now write pytest tests for the functions you changed.",
    "Show the final version of the whole file with all your changes.",
)


def source_files(limit: int = 4000, min_bytes: int = 800, max_bytes: int = 40_000) -> list[Path]:
    """`.py` files of the installed third-party packages (this interpreter's site-packages), in a fixed order."""
    root = Path(sysconfig.get_paths()["purelib"])
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.endswith((".dist-info", ".egg-info"))
                             and d not in ("__pycache__", "tests", "test", "specserve"))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if name.endswith(".py") and min_bytes <= path.stat().st_size <= max_bytes:
                found.append(path)
                if len(found) == limit:
                    return found
    return found


def agentic_conversations(count: int, seed: int, file_chars: int = 3000) -> tuple[Conversation, ...]:
    """`count` seeded coding-agent conversations: a real source file as a tool result with an instruction to edit
    it, then (simulated) test output and follow-ups; the assistant's answers are the server's own."""
    if count < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {count}")
    if file_chars < 100:
        raise ValueError(f"--agentic-file-chars must be >= 100, got {file_chars}")
    files = source_files()
    if not files:
        raise DatasetError("--dataset agentic: no .py file of an installed package found in site-packages")
    rng = random.Random(seed)
    root = Path(sysconfig.get_paths()["purelib"])
    out = []
    for i in range(count):
        path = files[rng.randrange(len(files))]
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")[:file_chars]
        names = [ln.split("(")[0].split()[-1] for ln in text.splitlines() if ln.lstrip().startswith("def ")]
        name = names[rng.randrange(len(names))] if names else "main"
        failure = (f"$ python -m pytest -q\nF.\nFAILED test_{path.stem}.py::test_{name} - AssertionError: "
                   f"{name}() returned None\n1 failed, 1 passed")
        task = AGENTIC_TASKS[rng.randrange(len(AGENTIC_TASKS))]
        turns: list[tuple[Message, ...]] = [(("user", f"Open {rel} and {task}."), ("tool", f"$ cat {rel}\n{text}")),
                                            (("tool", failure), ("user", AGENTIC_FOLLOW_UPS[0]))]
        turns += [(("user", f),) for f in AGENTIC_FOLLOW_UPS[1:1 + rng.randrange(3)]]
        out.append(Conversation(f"agentic-{i}:{rel}", tuple(turns)))
    return tuple(out)


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


def random_prompts(count: int, input_len: int, seed: int) -> tuple[Prompt, ...]:
    if count < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {count}")
    if input_len < 1:
        raise ValueError(f"--random-input-len must be >= 1 (words), got {input_len}")
    rng = random.Random(seed)
    words = _WORD_TEXT.split()
    return tuple(Prompt(text=" ".join(rng.choice(words) for _ in range(input_len))) for _ in range(count))


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
