"""Tool calls out of model text, for `--tool-call-parser`: whole texts and streamed deltas alike.

Formats:
  hermes / qwen25 (Qwen2.5, Qwen3, Hermes):
      <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>   (repeatable)
  smollm2 (SmolLM2 Instruct, whose chat template has no tools: `server/tool_prompt.py` lists them):
      <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]</tool_call>
  kimi_k2 (Moonshot Kimi K2):
      <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
      {"city": "Paris"}<|tool_call_end|> ... <|tool_calls_section_end|>

A parser is a small state machine fed text deltas: text outside a tool-call region is content (a suffix
that might open a region is held back until it is decided); a region is parsed once it closes (or when
the text ends). A region that does not parse is returned as content, unchanged. `parse(text)` runs the
same machine on the whole text, so a streamed response carries exactly the non-streamed content and calls.
Whitespace after a tool call is dropped unless more content follows it.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class Parsed:
    content: str
    tool_calls: tuple[ToolCall, ...] = ()


class ToolParser(ABC):
    """Feed text deltas with `feed`, then call `finish` once; each returns what became certain."""

    #: opening marker -> closing marker of a tool-call region
    markers: ClassVar[dict[str, str]]
    #: the markers are special tokens, which decoding must keep
    needs_special_tokens: ClassVar[bool] = False
    #: a region holds a JSON list of calls (else one call per region)
    list_body: ClassVar[bool] = False

    def __init__(self) -> None:
        self._buf = ""
        self._open: str | None = None  # the opening marker of the region being read
        self._pending_ws = ""  # whitespace after a tool call, sent only if content follows
        self._num_calls = 0

    @abstractmethod
    def parse_region(self, region: str) -> list[tuple[str | None, str, str]] | None:
        """(id or None, name, arguments JSON) per call in a region's text, or None if it does not parse."""

    def feed(self, text: str) -> Parsed:
        self._buf += text
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._open is None:
                at, marker = self._find_open()
                if marker is None:
                    keep = self._partial_open_len()
                    self._emit(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                self._emit(self._buf[:at], out)
                self._buf = self._buf[at + len(marker) :]
                self._open = marker
            else:
                close = self.markers[self._open]
                end = self._buf.find(close)
                if end < 0:
                    break
                self._close_region(self._buf[:end], close, out, calls)
                self._buf = self._buf[end + len(close) :]
        return Parsed("".join(out), tuple(calls))

    def finish(self) -> Parsed:
        out: list[str] = []
        calls: list[ToolCall] = []
        if self._open is not None:
            self._close_region(self._buf, "", out, calls)
        else:
            self._emit(self._buf, out)
        self._buf = ""
        self._pending_ws = ""
        return Parsed("".join(out), tuple(calls))

    def parse(self, text: str) -> Parsed:
        """A whole text at once (the parser must be fresh)."""
        a, b = self.feed(text), self.finish()
        return Parsed(a.content + b.content, a.tool_calls + b.tool_calls)

    # -- internals

    def _find_open(self) -> tuple[int, str | None]:
        hits = [(i, m) for m in self.markers if (i := self._buf.find(m)) >= 0]
        return min(hits) if hits else (-1, None)

    def _partial_open_len(self) -> int:
        """Length of the longest suffix of the buffer that is a proper prefix of an opening marker."""
        best = 0
        for m in self.markers:
            for k in range(min(len(m) - 1, len(self._buf)), best, -1):
                if self._buf.endswith(m[:k]):
                    best = k
                    break
        return best

    def _emit(self, text: str, out: list[str]) -> None:
        """Content; after a tool call, whitespace waits until non-whitespace content follows it."""
        if self._num_calls == 0:
            out.append(text)
        elif text.strip():
            out.append(self._pending_ws + text)
            self._pending_ws = ""
        else:
            self._pending_ws += text

    def _close_region(self, region: str, close: str, out: list[str], calls: list[ToolCall]) -> None:
        assert self._open is not None
        parsed = self.parse_region(region)
        if parsed is None:
            self._emit(self._open + region + close, out)
        else:
            self._pending_ws = ""
            for cid, name, args in parsed:
                calls.append(ToolCall(id=cid or f"call_{uuid.uuid4().hex[:24]}", name=name, arguments=args))
                self._num_calls += 1
        self._open = None


class HermesParser(ToolParser):
    markers: ClassVar[dict[str, str]] = {"<tool_call>": "</tool_call>"}

    def parse_region(self, region: str) -> list[tuple[str | None, str, str]] | None:
        try:
            obj = json.loads(region)
        except json.JSONDecodeError:
            return None
        items = obj if isinstance(obj, list) and self.list_body else [obj]
        calls = [_call(item) for item in items]
        return None if not calls or any(c is None for c in calls) else [c for c in calls if c is not None]


class SmolLM2Parser(HermesParser):
    list_body: ClassVar[bool] = True


def _call(obj: object) -> tuple[str | None, str, str] | None:
    """A {"name": ..., "arguments": {...}} object as (None, name, arguments JSON); None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return None, obj["name"], text


_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?P<id>[^<]+?)\s*<\|tool_call_argument_begin\|>(?P<args>.*?)(?:<\|tool_call_end\|>|$)",
    re.DOTALL,
)


class KimiK2Parser(ToolParser):
    markers: ClassVar[dict[str, str]] = {
        "<|tool_calls_section_begin|>": "<|tool_calls_section_end|>",
        "<|tool_call_section_begin|>": "<|tool_call_section_end|>",
    }
    needs_special_tokens: ClassVar[bool] = True

    def parse_region(self, region: str) -> list[tuple[str | None, str, str]] | None:
        calls: list[tuple[str | None, str, str]] = []
        for m in _KIMI_CALL.finditer(region):
            call_id, args = m["id"], m["args"].strip()
            name = call_id.removeprefix("functions.").rpartition(":")[0]
            try:
                json.loads(args)
            except json.JSONDecodeError:
                return None
            if not name:
                return None
            calls.append((call_id, name, args))
        return calls or None


#: --tool-call-parser name -> parser class (a fresh instance per choice)
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,
    "qwen3": HermesParser,
    "kimi_k2": KimiK2Parser,
    "smollm2": SmolLM2Parser,
}
