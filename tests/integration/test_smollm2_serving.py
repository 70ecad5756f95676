"""The agentic setup on the real target, over HTTP with the official `openai` client: `serve --model smollm2
--tool-call-parser smollm2`, plain and speculative. Structured outputs parse and validate every time (the grammar
closes them before max_tokens runs out), a forced tool_choice always gives a parsed call of a listed tool with
valid arguments, streamed calls assemble to the non-streamed ones, a later turn carries the earlier call."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from server_util import ServerProcess, running_server

pytestmark = pytest.mark.server

PROMPTS = [
    "Describe the Python function sorted() as a JSON object.",
    "Give the configuration of a small web server (host, port, routes).",
    "List three programming languages with their creators.",
    "What files does a typical Python package contain?",
]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"},
    "language": {"enum": ["python", "rust", "go"]},
    "lines": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}},
}, "required": ["name", "language", "lines", "tags"], "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the workspace",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the tests matching a pattern",
                                      "parameters": {"type": "object", "properties": {
                                          "pattern": {"type": "string"}, "verbose": {"type": "boolean"}},
                                          "required": ["pattern"], "additionalProperties": False}}},
]
ASKS = ["Open src/app.py.", "Run the tests of the parser.", "Why does test_login fail? Look into it."]


@pytest.fixture(scope="module", params=["plain", "NGRAM"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--model", "smollm2", "--enforce-eager", "--tool-call-parser", "smollm2", "--no-speculative-adaptive"]
    if request.param != "plain":
        args += ["--speculative-algorithm", request.param]
    with running_server(args, tmp_path_factory.mktemp("smollm2-serve") / "log") as srv:
        yield srv


def client_of(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none")


def chat(task: str) -> list[Any]:
    return [{"role": "user", "content": task}]


def test_json_object_and_json_schema_always_parse(server: ServerProcess) -> None:
    client = client_of(server)
    fmt_schema = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    for prompt in PROMPTS:
        for fmt in ({"type": "json_object"}, fmt_schema):
            out = client.chat.completions.create(model="smollm2", messages=chat(prompt), max_tokens=48,
                                                 temperature=0, response_format=fmt)  # type: ignore[arg-type]
            text = out.choices[0].message.content or ""
            value = json.loads(text)  # closed within max_tokens: whole JSON, every time
            assert isinstance(value, dict) and out.choices[0].finish_reason == "stop", text
            if fmt is fmt_schema:
                jsonschema.validate(value, SCHEMA)
    sampled = client.chat.completions.create(model="smollm2", messages=chat(PROMPTS[0]), max_tokens=32,
                                             temperature=1.0, seed=7, n=3, response_format=fmt_schema)  # type: ignore[arg-type]
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def check_calls(message: Any, names: set[str]) -> list[tuple[str, dict[str, Any]]]:
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    assert calls, message
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for name, args in calls:
        assert name in names
        jsonschema.validate(args, schemas[name])
    return calls


def streamed_calls(client: openai.OpenAI, **kw: Any) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
    parts: dict[int, list[str]] = {}
    reason = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = parts.setdefault(c.index, ["", ""])
            entry[0] += c.function.name or "" if c.function else ""
            entry[1] += c.function.arguments or "" if c.function else ""
        if chunk.choices and chunk.choices[0].finish_reason:
            reason = chunk.choices[0].finish_reason
    return [(name, json.loads(args)) for name, args in (parts[i] for i in sorted(parts))], reason


def test_forced_tool_calls_parse_every_time_and_stream_the_same(server: ServerProcess) -> None:
    client = client_of(server)
    names = {t["function"]["name"] for t in TOOLS}
    for ask in ASKS:
        for choice, allowed in (("required", names), ({"type": "function", "function": {"name": "run_tests"}},
                                                       {"run_tests"})):
            kw: dict[str, Any] = {"model": "smollm2", "messages": chat(ask), "tools": TOOLS, "tool_choice": choice,
                                  "max_tokens": 64, "temperature": 0}
            out = client.chat.completions.create(**kw)
            assert out.choices[0].finish_reason == "tool_calls"
            calls = check_calls(out.choices[0].message, allowed)
            assert streamed_calls(client, **kw) == (calls, "tool_calls")


def test_a_later_turn_carries_the_call_and_its_result(server: ServerProcess) -> None:
    client = client_of(server)
    first = client.chat.completions.create(model="smollm2", messages=chat(ASKS[0]), tools=TOOLS,  # type: ignore[arg-type]
                                           tool_choice="required", max_tokens=64, temperature=0)
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    messages: list[Any] = [*chat(ASKS[0]), first.choices[0].message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "def main():\n    return 0\n"},
                           {"role": "user", "content": "Explain that file in one sentence."}]
    before = cached_tokens(server)
    later = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                                           max_tokens=24, temperature=0)
    assert later.choices[0].message.content
    # the earlier turn's prompt (the tools' listing, a few hundred tokens) and its call came from the prefix cache
    assert cached_tokens(server) - before > first.usage.prompt_tokens  # type: ignore[union-attr]


def cached_tokens(srv: ServerProcess) -> float:
    import httpx

    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if "prefix_cache_tokens_total{" in line and 'result="hit"' in line:
            return float(line.split()[-1])
    raise AssertionError("no prefix-cache counter in /metrics")
