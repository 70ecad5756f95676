"""Prompt suites for acceptance benchmarks.

- `coding10`: ten coding prompts (code openings, since the demo target is a code model).
- `coding10-chat`: the same ten tasks as chat requests, for a chat target (SmolLM2-Instruct).
- `heldout-code`: contexts cut from real Python code the demo model never trained on (eight third-party
  packages, not the standard library), at three kinds of cut point (`bench/cuts.py`, the kind kept per task),
  continued for a short horizon. Small targets loop under greedy decoding and loops flatter every drafter;
  short held-out continuations loop less, and reports leave looping tasks out of their headline.
- `heldout-pip`: 64 contexts of one package (pip), all cut right after a newline (the kind that flatters
  drafters most); kept because earlier figures were measured on it.
- `chat-coding`: chat tasks for a chat target (SmolLM2-Instruct), built from functions of the same held-out
  packages: write / explain / fix / complete a function, and an agent turn with a file as a tool result
  (`train/chat_prompts.py`, whose training split is the standard library's); the task's kind is its `kind`.
- `code-edit`: chat tasks whose answer rewrites code given in the prompt (fix a flipped operator; rewrite with
  type hints, clearer names, comments or a docstring example), from the same held-out packages
  (`train/chat_prompts.py --kinds fix,edit`): where lookup drafters should pay.
- a JSONL file: one task a line with `name` and `prompt` (or chat `messages`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.bench.cuts import CUT_KINDS

SUITES_DIR = Path(__file__).resolve().parent.parent / "assets" / "suites"

CODING10: list[tuple[str, str]] = [
    ("fizzbuzz", 'def fizzbuzz(n):\n    """Return the FizzBuzz strings for 1..n."""\n'),
    ("binary_search",
     'def binary_search(items, target):\n    """Return the index of target in sorted items, or -1."""\n'),
    ("linked_list_reverse", "class Node:\n    def __init__(self, value, next=None):\n        self.value = value\n"
                            "        self.next = next\n\n\ndef reverse(head):\n"),
    ("json_parser", 'class JSONParser:\n    """A small recursive-descent JSON parser."""\n\n'
                    "    def __init__(self, text):\n        self.text = text\n        self.pos = 0\n\n"
                    "    def parse_value(self):\n"),
    ("async_rate_limiter", "import asyncio\nimport time\n\n\nclass RateLimiter:\n"
                           '    """Allow at most `rate` calls per `period` seconds."""\n\n'
                           "    def __init__(self, rate, period):\n"),
    ("trie_autocomplete", "class TrieNode:\n    def __init__(self):\n        self.children = {}\n"
                          "        self.is_word = False\n\n\nclass Trie:\n    def __init__(self):\n"
                          "        self.root = TrieNode()\n\n    def insert(self, word):\n"),
    ("merge_sort", 'def merge_sort(items):\n    """Sort a list with merge sort and return a new list."""\n'),
    ("lru_cache", "from collections import OrderedDict\n\n\nclass LRUCache:\n"
                  "    def __init__(self, capacity):\n        self.capacity = capacity\n"
                  "        self.data = OrderedDict()\n\n    def get(self, key):\n"),
    ("graph_bfs", "from collections import deque\n\n\ndef bfs(graph, start):\n"
                  '    """Return the nodes of graph reachable from start in breadth-first order."""\n'),
    ("matrix_multiply", 'def matrix_multiply(a, b):\n    """Multiply two matrices given as lists of rows."""\n'),
]


#: the ten tasks as a user would ask a chat model for them
CODING10_CHAT: dict[str, str] = {
    "fizzbuzz": "Write a Python function fizzbuzz(n) that returns the FizzBuzz strings for 1 to n.",
    "binary_search": "Write a Python function binary_search(items, target) that returns the index of target in "
                     "a sorted list, or -1.",
    "linked_list_reverse": "Write a Python class Node for a singly linked list and a function reverse(head) that "
                           "reverses the list in place.",
    "json_parser": "Write a small recursive-descent JSON parser in Python: a class JSONParser with a "
                   "parse_value method for objects, arrays, strings, numbers, true, false and null.",
    "async_rate_limiter": "Write an asyncio rate limiter class in Python that allows at most `rate` calls per "
                          "`period` seconds, usable as `async with limiter:`.",
    "trie_autocomplete": "Write a Python Trie with insert(word) and autocomplete(prefix), which returns every "
                         "stored word starting with prefix.",
    "merge_sort": "Write a Python function merge_sort(items) that sorts a list with merge sort and returns a new "
                  "list.",
    "lru_cache": "Write a Python class LRUCache(capacity) with get(key) and put(key, value), using an "
                 "OrderedDict.",
    "graph_bfs": "Write a Python function bfs(graph, start) that returns the nodes reachable from start in "
                 "breadth-first order; graph is a dict of adjacency lists.",
    "matrix_multiply": "Write a Python function matrix_multiply(a, b) that multiplies two matrices given as lists "
                       "of rows, raising ValueError when the shapes do not match.",
}


@dataclass(frozen=True)
class Task:
    name: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    kind: str | None = None  # where the context was cut (`bench/cuts.py`), for the per-kind figures


def coding_prompts() -> list[tuple[str, str]]:
    return list(CODING10)


def load_jsonl_tasks(path: Path) -> list[Task]:
    tasks = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not ("prompt" in obj or "messages" in obj):
            raise ValueError(f"{path}:{lineno}: a task needs `prompt` (or chat `messages`), and may have a `name`")
        kind = obj.get("kind")
        if kind is not None and kind not in CUT_KINDS + CHAT_KINDS + ("edit",):
            raise ValueError(f"{path}:{lineno}: kind {kind!r} is not one of "
                             f"{', '.join(CUT_KINDS + CHAT_KINDS + ('edit',))}")
        # unnamed tasks (a prompts file of `specserve.train.prompts`) are named by their line
        tasks.append(Task(str(obj.get("name", f"{path.stem}:{lineno}")), obj.get("prompt"), obj.get("messages"),
                          kind))
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks


#: kinds of chat coding task (`train/chat_prompts.py`)
CHAT_KINDS = ("write", "explain", "fix", "complete", "tool")
HELDOUT = {"heldout-code": "heldout_code.jsonl", "heldout-pip": "heldout_pip.jsonl",
           "chat-coding": "chat_coding.jsonl", "code-edit": "code_edit.jsonl"}


def default_new_tokens(suite: str) -> int:
    """The horizon a suite is measured at: short for held-out code (a continuation, before a small target
    drifts into loops) and for chat coding answers (their opening, before they loop), 128 otherwise."""
    return 64 if suite in ("chat-coding", "coding10-chat") else 128 if suite == "code-edit" else (
        32 if suite in HELDOUT else 128)


def load_suite(name_or_path: str) -> list[Task]:
    if name_or_path == "coding10":
        return [Task(n, p) for n, p in CODING10]
    if name_or_path == "coding10-chat":
        return [Task(n, messages=[{"role": "user", "content": CODING10_CHAT[n]}], kind="write") for n, _ in CODING10]
    if name_or_path in HELDOUT:
        return load_jsonl_tasks(SUITES_DIR / HELDOUT[name_or_path])
    path = Path(name_or_path)
    if not path.exists():
        raise ValueError(f"--suite {name_or_path!r}: not coding10, coding10-chat, {', '.join(HELDOUT)}, or an "
                         "existing JSONL file")
    return load_jsonl_tasks(path)
