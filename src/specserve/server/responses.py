"""The OpenAI wire format of response bodies (request bodies: `schemas.py`): strict about their own fields, so
a misspelt field is a bug caught in tests rather than a silently different answer."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    meta_info: dict[str, Any] | None = None  # extension: per-request figures, SGLang's names (with finish_reason)


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    meta_info: dict[str, Any] | None = None  # the choices' figures together (`meta.merge_meta_info`)


class FunctionCallOut(_Out):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(_Out):
    index: int | None = None  # streaming deltas only
    id: str | None = None
    type: Literal["function"] | None = "function"
    function: FunctionCallOut


class AssistantMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None
    meta_info: dict[str, Any] | None = None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    meta_info: dict[str, Any] | None = None  # where z-lab's `dflash` client reads it; as CompletionResponse's


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None
    meta_info: dict[str, Any] | None = None  # on the chunk that carries finish_reason


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"
    root: str
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Out):
    error: ErrorDetail
