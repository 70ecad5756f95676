"""Multi-turn conversations for the serving sweep: `Conversation` (each turn sent with the whole history, so the
server's prefix cache is exercised), its JSONL form, and the built-in `agentic` dataset of seeded coding-agent
conversations over real source files.
"""

from __future__ import annotations

import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.bench.prompts import DatasetError, Prompt

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

