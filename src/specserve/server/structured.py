"""A request's output constraint: OpenAI's `response_format` and forced `tool_choice`, SGLang's `regex` / `ebnf`
and vLLM's `structured_outputs`, turned into one `Grammar` (at most one of them per request).

A forced tool call (`tool_choice` "required" or a named function) is a Lark grammar in the parser's call format
(Hermes: `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, one call or several; SmolLM2: one region
holding a list of calls), its JSON an `anyOf` of the tools' schemas with each name a constant, so the parser reads
it back into `tool_calls`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from specserve.server import schemas as s
from specserve.server.errors import ApiError
from specserve.server.tool_parsers import TOOL_PARSERS, ToolParser
from specserve.tokenizer import Tokenizer
from specserve.types import Grammar

#: tool-call formats a forced call can be written in (--tool-call-parser names)
FORCED_CALL_PARSERS = ("hermes", "qwen25", "qwen3", "smollm2")


def request_grammar(req: s.SamplingRequest) -> Grammar | None:
    """The grammar of `response_format`, `regex`, `ebnf` or `structured_outputs`; 400 when more than one is set."""
    found: list[tuple[str, Grammar]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", Grammar("json_object")))
    elif rf is not None and rf.type == "json_schema":
        assert rf.json_schema is not None  # the schema's validator
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {"type": "object"}
        strict = bool(rf.json_schema.strict)
        found.append(("response_format", Grammar("json_schema", json.dumps(schema), compact=strict)))
    if req.regex is not None:
        found.append(("regex", Grammar("regex", req.regex)))
    if req.ebnf is not None:
        found.append(("ebnf", Grammar("lark", _lark_of_ebnf(req.ebnf, "ebnf"))))
    so = req.structured_outputs
    if so is not None:
        found += [(f"structured_outputs.{k}", g) for k, g in _structured_outputs(so)]
    if len(found) > 1:
        raise ApiError(400, f"give one output constraint, not {' and '.join(p for p, _ in found)}",
                       param=found[1][0])
    return found[0][1] if found else None


def _structured_outputs(so: s.StructuredOutputs) -> list[tuple[str, Grammar]]:
    out: list[tuple[str, Grammar]] = []
    if so.json_ is not None:
        schema = so.json_ if isinstance(so.json_, dict) else _json_text(so.json_, "structured_outputs.json")
        out.append(("json", Grammar("json_schema", json.dumps(schema))))
    if so.regex is not None:
        out.append(("regex", Grammar("regex", so.regex)))
    if so.choice is not None:
        if not so.choice:
            raise ApiError(400, "structured_outputs.choice needs at least one choice", param="structured_outputs")
        out.append(("choice", Grammar("regex", "|".join(re.escape(c) for c in so.choice))))
    if so.grammar is not None:
        out.append(("grammar", Grammar("lark", _lark_of_ebnf(so.grammar, "structured_outputs.grammar"))))
    return out


def _json_text(text: str, param: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"{param} is not JSON: {e}", param=param) from None
    if not isinstance(value, dict):
        raise ApiError(400, f"{param} must be a JSON schema object", param=param)
    return value


def _lark_of_ebnf(text: str, param: str) -> str:
    """GBNF (llama.cpp's EBNF, which SGLang's and vLLM's grammars use) to Lark; Lark passes unchanged."""
    if "::=" not in text:
        return text
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return str(gbnf_to_lark(text))
    except Exception as e:  # the converter's own parse errors
        raise ApiError(400, f"{param} is not a grammar llguidance reads: {e}", param=param) from None


def tool_call_grammar(req: s.ChatCompletionRequest, parser: str | None, tokenizer: Tokenizer) -> Grammar | None:
    """The grammar of a forced call (`tool_choice` "required" or {"type": "function", ...}); None otherwise."""
    choice = req.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    tools = req.tools or []
    if not tools:
        raise ApiError(400, "tool_choice forces a call but the request has no tools", param="tool_choice")
    if parser not in FORCED_CALL_PARSERS:
        raise ApiError(400, f"a forced tool_choice needs --tool-call-parser {' or '.join(FORCED_CALL_PARSERS)}",
                       param="tool_choice")
    if isinstance(choice, s.NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                           param="tool_choice")
        return Grammar("lark", _calls_lark(named, False, tokenizer, TOOL_PARSERS[parser]))
    return Grammar("lark", _calls_lark(tools, True, tokenizer, TOOL_PARSERS[parser]))


def _marker(text: str, tokenizer: Tokenizer) -> str:
    """A call marker in Lark: the token itself where the vocabulary has it as one (often a special token, which
    no text spells), else the literal text."""
    tid = tokenizer.token_to_id(text)
    return f"<[{tid}]>" if tid is not None else json.dumps(text)


def _calls_lark(tools: list[s.Tool], many: bool, tokenizer: Tokenizer, parser: type[ToolParser]) -> str:
    start, end = (_marker(m, tokenizer) for m in next(iter(parser.markers.items())))
    options = [{"type": "object", "properties": {
        "name": {"const": t.function.name},
        "arguments": t.function.parameters or {"type": "object"},
    }, "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    # compact JSON, as the templates write calls: the keys and separators are then forced tokens
    schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    if parser.list_body:  # one region, a list of calls: [call, call, ...]
        calls = '"[" body (", " body)* "]"' if many else '"[" body "]"'
        return "\n".join([f"start: {start} {calls} {end}", f"body: %json {json.dumps(schema)}"])
    return "\n".join([
        f"start: call{'+' if many else ''}",
        f"call: {start} body {end}",
        f"body: %json {json.dumps(schema)}",
    ])
