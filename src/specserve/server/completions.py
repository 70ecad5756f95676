"""/v1/completions and /v1/chat/completions: OpenAI requests -> engine requests -> responses or SSE.

Each choice (prompt × n) is one engine request; the choices of an HTTP request are submitted together,
so a full queue rejects all of them. Streaming and non-streaming responses are built from the same
engine deltas, so under greedy decoding their texts are equal. A client that goes away aborts its
requests: a stream notices when Starlette cancels it, a plain request through `_abort_on_disconnect`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from specserve.server import responses as r
from specserve.server import schemas as s
from specserve.server.engine_api import (
    EngineClosed,
    EngineOutput,
    EngineRequest,
    QueueFull,
    RequestGroup,
    ServingEngine,
)
from specserve.server.errors import ApiError, parse_body
from specserve.server.meta import merge_meta_info
from specserve.server.serve_config import ServeConfig
from specserve.server.structured import request_grammar, tool_call_grammar
from specserve.server.tool_parsers import TOOL_PARSERS, Parsed, ToolCall, ToolParser
from specserve.server.tool_prompt import renders_tools, with_tools
from specserve.types import Grammar, SamplingParams


@dataclass(frozen=True)
class ServerState:
    engine: ServingEngine
    cfg: ServeConfig
    started: int = field(default_factory=lambda: int(time.time()))


def _sse(obj: BaseModel | dict[str, Any]) -> str:
    data = obj.model_dump_json(exclude_none=True) if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.cfg.model_name:
        raise ApiError(404, f"The model {name!r} does not exist; this server serves {state.cfg.model_name!r}",
                       param="model", code="model_not_found")


def _token_budget(state: ServerState, n_prompt: int, max_tokens: int | None, param: str) -> int:
    ctx = state.engine.max_context
    if n_prompt == 0:
        raise ApiError(400, "The prompt is empty", param=param)
    if n_prompt >= ctx:
        raise ApiError(400, f"This model's maximum context length is {ctx} tokens, but the prompt has {n_prompt}; "
                       "shorten the prompt", param=param, code="context_length_exceeded")
    if max_tokens is None:
        return ctx - n_prompt
    if n_prompt + max_tokens > ctx:
        raise ApiError(400, f"This model's maximum context length is {ctx} tokens; you requested "
                       f"{n_prompt + max_tokens} ({n_prompt} in the prompt, {max_tokens} for the completion); "
                       "lower max_tokens", param="max_tokens", code="context_length_exceeded")
    return max_tokens


def _params(req: s.SamplingRequest, max_new: int, choice: int, grammar: Grammar | None = None) -> SamplingParams:
    try:
        return SamplingParams(
            max_new_tokens=max_new, temperature=req.temperature, top_p=req.top_p, top_k=max(0, req.top_k),
            min_p=req.min_p, seed=None if req.seed is None else req.seed + choice, stop=tuple(req.stop_list),
            stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos, grammar=grammar,
        )
    except ValueError as e:
        raise ApiError(400, str(e)) from None


async def _checked(state: ServerState, grammar: Grammar | None, param: str) -> tuple[Grammar | None, int]:
    """Compile the grammar off the event loop (cached per spec); 400 naming `param` when it cannot be used.
    Returns it with the fewest tokens an output it accepts can have (0 without a grammar)."""
    if grammar is None:
        return None, 0
    try:
        return grammar, await asyncio.to_thread(state.engine.check_grammar, grammar)
    except ValueError as e:
        raise ApiError(400, str(e), param=param) from None


def _fits(need: int, max_new: int, param: str) -> None:
    """400 when no output the grammar accepts fits in the token budget."""
    if need > max_new:
        raise ApiError(400, f"the {param} grammar needs {need} tokens for a complete output (its shortest found) but "
                       f"max_tokens allows {max_new}; raise max_tokens", param="max_tokens")


def _submit(state: ServerState, requests: list[EngineRequest]) -> RequestGroup:
    try:
        return state.engine.submit(requests)
    except QueueFull as e:
        raise ApiError(503, f"The server is busy: {e}; retry later", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    except EngineClosed as e:
        raise ApiError(503, str(e), code="shutting_down", headers={"Retry-After": "5"}) from None


async def _abort_on_disconnect(request: Request, group: RequestGroup) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            group.abort()
            return


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    meta_info: dict[str, Any] | None = None


async def _collect(request: Request, group: RequestGroup, k: int) -> list[_Choice]:
    choices = [_Choice() for _ in range(k)]
    watcher = asyncio.create_task(_abort_on_disconnect(request, group))
    try:
        async for out in group:
            c = choices[out.index]
            c.text.append(out.text)
            c.completion_tokens = out.completion_tokens
            if out.error is not None:
                raise ApiError(500, f"generation failed: {out.error}", code="engine_error")
            if out.finished:
                c.finish_reason, c.meta_info = out.finish_reason, out.meta_info
    finally:
        watcher.cancel()
        group.abort()
    return choices


def _usage(prompt_tokens: int, completion: list[int]) -> r.Usage:
    return r.Usage(prompt_tokens=prompt_tokens, completion_tokens=sum(completion),
                   total_tokens=prompt_tokens + sum(completion))


def _error_event(out: EngineOutput) -> str:
    return _sse({"error": {"message": f"generation failed: {out.error}", "type": "server_error",
                           "param": None, "code": "engine_error"}})


# ------------------------------------------------------------------------------------------ completions


async def create_completion(state: ServerState, request: Request) -> Response:
    req = parse_body(s.CompletionRequest, await request.body())
    _check_model(state, req.model)
    grammar, need = await _checked(state, request_grammar(req), "response_format")
    tok = state.engine.tokenizer
    engine_reqs: list[EngineRequest] = []
    prompt_tokens = 0
    for prompt in req.prompts():
        ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
        if any(not 0 <= t < tok.vocab_size for t in ids):
            raise ApiError(400, f"prompt token ids must be in [0, {tok.vocab_size})", param="prompt")
        max_new = _token_budget(state, len(ids), req.max_tokens, "prompt")
        _fits(need, max_new, "response_format")
        prompt_tokens += len(ids)
        for j in range(req.n):
            engine_reqs.append(EngineRequest(f"cmpl-{uuid.uuid4().hex}", tuple(ids), _params(req, max_new, j, grammar)))
    group = _submit(state, engine_reqs)
    rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.cfg.model_name
    k = len(engine_reqs)
    if req.stream:
        opts = req.stream_options or s.StreamOptions()
        return StreamingResponse(stream_completion(group, rid, created, model, k, prompt_tokens, opts),
                                 media_type="text/event-stream")
    choices = await _collect(request, group, k)
    resp = r.CompletionResponse(
        id=rid, created=created, model=model,
        choices=[r.CompletionChoice(index=i, text="".join(c.text), finish_reason=c.finish_reason,
                                    meta_info=c.meta_info) for i, c in enumerate(choices)],
        usage=_usage(prompt_tokens, [c.completion_tokens for c in choices]),
        meta_info=merge_meta_info([c.meta_info for c in choices]),
    )
    return JSONResponse(resp.model_dump(exclude_none=True))


async def stream_completion(group: RequestGroup, rid: str, created: int, model: str, k: int, prompt_tokens: int,
                             opts: s.StreamOptions) -> AsyncIterator[str]:
    completion = [0] * k
    try:
        async for out in group:
            completion[out.index] = out.completion_tokens
            if out.error is not None:
                yield _error_event(out)
                continue
            if not out.text and not out.finished:
                continue
            choice = r.CompletionChoice(index=out.index, text=out.text,
                                        finish_reason=out.finish_reason if out.finished else None,
                                        meta_info=out.meta_info if out.finished else None)
            usage = _usage(prompt_tokens, completion) if opts.continuous_usage_stats else None
            yield _sse(r.CompletionResponse(id=rid, created=created, model=model, choices=[choice], usage=usage))
        if opts.include_usage:
            yield _sse(r.CompletionResponse(id=rid, created=created, model=model, choices=[],
                                            usage=_usage(prompt_tokens, completion)))
        yield "data: [DONE]\n\n"
    finally:
        group.abort()


# ------------------------------------------------------------------------------------------------- chat


def _template_message(m: s.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _args(c.function.arguments)}}
            for c in m.tool_calls
        ]
    return out


def _args(text: str) -> Any:
    """Chat templates expect arguments as a mapping, as Hugging Face passes them."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _tool_calls_out(calls: tuple[ToolCall, ...], first_index: int | None) -> list[r.ToolCallOut]:
    return [r.ToolCallOut(index=None if first_index is None else first_index + i, id=c.id,
                          function=r.FunctionCallOut(name=c.name, arguments=c.arguments))
            for i, c in enumerate(calls)]


async def create_chat_completion(state: ServerState, request: Request) -> Response:
    req = parse_body(s.ChatCompletionRequest, await request.body())
    _check_model(state, req.model)
    parser_cls: type[ToolParser] | None = None
    if req.uses_tools:
        if state.cfg.tool_call_parser is None:
            raise ApiError(400, "tools need a server started with --tool-call-parser", param="tools")
        parser_cls = TOOL_PARSERS[state.cfg.tool_call_parser]
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] if req.uses_tools else None
    grammar, forced = request_grammar(req), tool_call_grammar(req, state.cfg.tool_call_parser, state.engine.tokenizer)
    if grammar is not None and forced is not None:
        raise ApiError(400, "a forced tool_choice and an output format cannot both constrain one answer",
                       param="tool_choice")
    param = "tool_choice" if forced is not None else "response_format"
    grammar, need = await _checked(state, forced or grammar, param)
    tok = state.engine.tokenizer
    messages = [_template_message(m) for m in req.messages]
    if tools and parser_cls is not None and parser_cls.markers and not renders_tools(tok.chat_template):
        messages, tools = with_tools(messages, tools, parser_cls), None
    try:
        prompt = tok.apply_chat_template(messages, tools=tools)
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None
    ids = tok.encode(prompt)
    max_new = _token_budget(state, len(ids), req.token_limit, "messages")
    _fits(need, max_new, param)
    skip = not (parser_cls is not None and parser_cls.needs_special_tokens)
    engine_reqs = [EngineRequest(f"chatcmpl-{uuid.uuid4().hex}", tuple(ids), _params(req, max_new, j, grammar),
                                 skip) for j in range(req.n)]
    group = _submit(state, engine_reqs)
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.cfg.model_name
    if req.stream:
        opts = req.stream_options or s.StreamOptions()
        return StreamingResponse(stream_chat(group, rid, created, model, req.n, len(ids), opts, parser_cls),
                                 media_type="text/event-stream")
    choices = await _collect(request, group, req.n)
    out: list[r.ChatChoice] = []
    for i, c in enumerate(choices):
        text = "".join(c.text)
        calls: tuple[ToolCall, ...] = ()
        if parser_cls is not None:
            parsed = parser_cls().parse(text)
            text, calls = parsed.content, parsed.tool_calls
        msg = r.AssistantMessage(content=text if text or not calls else None,
                                 tool_calls=_tool_calls_out(calls, None) or None)
        reason = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        out.append(r.ChatChoice(index=i, message=msg, finish_reason=reason, meta_info=c.meta_info))
    resp = r.ChatCompletionResponse(id=rid, created=created, model=model, choices=out,
                                    usage=_usage(len(ids), [c.completion_tokens for c in choices]),
                                    meta_info=merge_meta_info([c.meta_info for c in choices]))
    return JSONResponse(resp.model_dump(exclude_none=True))


async def stream_chat(group: RequestGroup, rid: str, created: int, model: str, k: int, prompt_tokens: int,
                       opts: s.StreamOptions, parser_cls: type[ToolParser] | None) -> AsyncIterator[str]:
    parsers = [parser_cls() if parser_cls is not None else None for _ in range(k)]
    num_calls = [0] * k
    completion = [0] * k

    def chunk(index: int, delta: r.ChatDelta, reason: str | None = None, meta: dict[str, Any] | None = None) -> str:
        usage = _usage(prompt_tokens, completion) if opts.continuous_usage_stats else None
        choice = r.ChatChunkChoice(index=index, delta=delta, finish_reason=reason, meta_info=meta)
        return _sse(r.ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice], usage=usage))

    try:
        for i in range(k):
            yield chunk(i, r.ChatDelta(role="assistant", content=""))
        async for out in group:
            i = out.index
            completion[i] = out.completion_tokens
            if out.error is not None:
                yield _error_event(out)
                continue
            content = out.text
            calls: tuple[ToolCall, ...] = ()
            parser = parsers[i]
            if parser is not None:
                a = parser.feed(out.text)
                b = parser.finish() if out.finished else Parsed("")
                content, calls = a.content + b.content, a.tool_calls + b.tool_calls
            if content or calls:
                yield chunk(i, r.ChatDelta(content=content or None,
                                           tool_calls=_tool_calls_out(calls, num_calls[i]) or None))
                num_calls[i] += len(calls)
            if out.finished:
                reason = "tool_calls" if num_calls[i] and out.finish_reason == "stop" else out.finish_reason
                yield chunk(i, r.ChatDelta(), reason, out.meta_info)
        if opts.include_usage:
            yield _sse(r.ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                             usage=_usage(prompt_tokens, completion)))
        yield "data: [DONE]\n\n"
    finally:
        group.abort()
