"""What the HTTP app needs from an engine: the `ServingEngine` protocol and the data that crosses it.

An engine takes the choices of one HTTP request together (`submit`, all or none: `QueueFull` when the
bounded queue cannot hold them, `EngineClosed` while shutting down) and returns a `RequestGroup`, an
async iterator of `EngineOutput` deltas on the event loop; `RequestGroup.abort` stops what has not
finished. `server/batch_serving.py` implements it on the continuous-batching engine; the app only
sees this protocol.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from specserve.engine.engine_config import EngineStats
from specserve.engine.scheduler import QueueFull
from specserve.tokenizer import Tokenizer
from specserve.types import Grammar, SamplingParams

__all__ = ["EngineClosed", "EngineOutput", "EngineRequest", "EngineStats", "QueueFull", "RequestGroup",
           "ServingEngine"]


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no new requests (the app answers 503)."""


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_ids: tuple[int, ...]  # [T]
    params: SamplingParams
    skip_special_tokens: bool = True


@dataclass(frozen=True)
class EngineOutput:
    """What one request of a group produced since its previous output."""

    index: int  # position of the request in its group
    text: str
    prompt_tokens: int
    completion_tokens: int  # so far
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    meta_info: dict[str, Any] | None = None  # on the last output: per-request figures (`RequestStats.meta_info`)


class RequestGroup:
    """The outputs of requests submitted together (the choices of one HTTP request), as they come.

    Lives on the event loop; `put` is called there (the engine schedules it with call_soon_threadsafe).
    """

    def __init__(self, request_ids: list[str], abort: Callable[[str], None]) -> None:
        self.request_ids = request_ids
        self._abort = abort
        self._queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self._open = set(range(len(request_ids)))

    def put(self, out: EngineOutput) -> None:
        self._queue.put_nowait(out)

    def __aiter__(self) -> RequestGroup:
        return self

    async def __anext__(self) -> EngineOutput:
        if not self._open:
            raise StopAsyncIteration
        out = await self._queue.get()
        if out.finished:
            self._open.discard(out.index)
        return out

    def abort(self) -> None:
        """Abort every request of the group that has not finished (no-op once all have)."""
        for i in sorted(self._open):
            self._abort(self.request_ids[i])


class ServingEngine(Protocol):
    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_context(self) -> int: ...

    @property
    def ready(self) -> bool: ...

    def describe(self) -> dict[str, Any]: ...

    def start(self) -> None: ...

    def submit(self, requests: list[EngineRequest]) -> RequestGroup: ...

    def stats(self) -> EngineStats: ...

    def check_grammar(self, grammar: Grammar) -> int:
        """Compile (and cache) an output grammar; ValueError says why it cannot be used. Called off the loop.
        Returns a lower bound on the tokens of any output it accepts."""

    async def shutdown(self, timeout: float) -> None: ...
