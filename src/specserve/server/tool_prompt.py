"""Tools for a chat template that does not render them (SmolLM2's ChatML ignores `tools`): the tools are listed in
the system message and earlier calls are written back as the text the parser reads. The model then sees the
format its answer is parsed in, and a later turn's prompt repeats the earlier answer as it was generated, so the
prefix cache holds it.
"""

from __future__ import annotations

import json
from typing import Any

from specserve.server.tool_parsers import ToolParser


def renders_tools(chat_template: str | None) -> bool:
    """Whether the template itself writes the tools into the prompt (it reads a `tools` variable)."""
    return bool(chat_template) and "tools" in str(chat_template)


def calls_text(calls: list[dict[str, Any]], parser: type[ToolParser]) -> str:
    """Calls ({"name", "arguments": mapping}) as the parser reads them, in the compact JSON a forced call has."""
    start, end = next(iter(parser.markers.items()))
    bodies = [json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False) for c in calls]
    if parser.list_body:
        return f"{start}[{', '.join(bodies)}]{end}"
    return "".join(f"{start}{b}{end}" for b in bodies)


def system_text(tools: list[dict[str, Any]], parser: type[ToolParser]) -> str:
    functions = [t.get("function", t) for t in tools]
    example = calls_text([{"name": "tool_name", "arguments": {"argument": "value"}}], parser)
    return (
        "You can call tools. Each is described, with the JSON schema of its arguments, in <tools></tools>:\n"
        f"<tools>{json.dumps(functions, ensure_ascii=False)}</tools>\n\n"
        "To call tools, answer with the calls alone, in this format:\n"
        f"{example}\n"
        "If no tool fits the request, answer in plain text."
    )


def with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
               parser: type[ToolParser]) -> list[dict[str, Any]]:
    """The messages as the template should see them: the tools in the (first) system message, each assistant
    message's `tool_calls` appended to its content as text."""
    listing = system_text(tools, parser)
    out: list[dict[str, Any]] = []
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        out.append({**first, "content": f"{first.get('content') or ''}\n\n{listing}".lstrip()})
        messages = messages[1:]
    else:
        out.append({"role": "system", "content": listing})
    for m in messages:
        calls = m.get("tool_calls")
        if m["role"] == "assistant" and calls:
            called = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = (m.get("content") or "") + calls_text(called, parser)
        out.append(m)
    return out
