"""Single prompts for the serving sweep: the `Prompt` a request is built from, the built-in `coding` and `random`
datasets, and `DatasetError` (raised by every dataset source, so it lives at the bottom of their imports).

`random` prompts are words drawn from a fixed list, so their length is given in words, not tokens
(no tokenizer is needed on the client); usage.prompt_tokens reports the real count.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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


def random_prompts(count: int, input_len: int, seed: int) -> tuple[Prompt, ...]:
    if count < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {count}")
    if input_len < 1:
        raise ValueError(f"--random-input-len must be >= 1 (words), got {input_len}")
    rng = random.Random(seed)
    words = _WORD_TEXT.split()
    return tuple(Prompt(text=" ".join(rng.choice(words) for _ in range(input_len))) for _ in range(count))
