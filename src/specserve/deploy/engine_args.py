"""The engine arguments of an SGLang/vLLM export as they are decided, each specserve flag with what it became.

A leaf module: `engine_map.py` (server, batching, KV, execution flags) and `spec_map.py` (speculative flags)
both fill one `ArgsBuilder`, and neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mapped:
    flag: str  # the specserve flag (or export option)
    value: str
    engine_args: tuple[str, ...]
    note: str = ""


@dataclass(frozen=True)
class Unmapped:
    flag: str
    value: str
    reason: str


class ArgsBuilder:
    """The engine arguments of an export as they are decided, with what each specserve flag became."""

    def __init__(self) -> None:
        self.args: list[str] = []
        self.mapped: list[Mapped] = []
        self.unmapped: list[Unmapped] = []
        self.env: list[tuple[str, str]] = []

    def map(self, flag: str, value: object, *args: str, note: str = "") -> None:
        self.args += args
        self.mapped.append(Mapped(flag, str(value), tuple(args), note))

    def skip(self, flag: str, value: object, reason: str) -> None:
        self.unmapped.append(Unmapped(flag, str(value), reason))
