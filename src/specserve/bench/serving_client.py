"""One streamed OpenAI-compatible request: the sweep's config, the request body, the SSE stream reader and the
HTTP client; `serving.py` runs many of these per concurrency level.

Tokens per streamed chunk (what ITL divides by, see metrics.py), first rule that applies:
  1. the chunk carries cumulative `usage.completion_tokens` (vLLM's `continuous_usage_stats`,
     asked for with `continuous_usage=True`): the increase since the previous content chunk;
  2. the chunk carries logprobs (`logprobs.tokens` for completions, `logprobs.content` for chat):
     their number;
  3. with a tokenizer (`--tokenizer`, or the served model's where /server_info names a local checkpoint): the
     chunk's text re-tokenized, as SGLang's bench_serving counts (a speculative server packs several tokens
     into one chunk);
  4. otherwise 1. Such a server then shows ITL per chunk and a streamed count below its usage count; the run
     JSON keeps both counts (`token_counts`) so the gap is visible.
A request's output token count is the final chunk's `usage.completion_tokens` when the server
sends it (`stream_options.include_usage` is always asked for), else the streamed count.
A content chunk is one with non-empty `text` (completions) or `delta.content` /
`delta.reasoning_content` / `delta.reasoning` (chat), or with logprob entries; role-only and
usage-only chunks are not.
A failed request (transport error, non-200 answer, an error event or undecodable data in the
stream, a stream without content) is recorded with its message; it never stops the sweep.

The HTTP client is aiohttp, as in SGLang's bench_serving: a client measured on the machine that serves shares its
cores, and what it spends per streamed event is taken from the server. On the 2-core machine this project is
measured on, httpx's stream reader spent 0.21 ms of CPU per event at concurrency 16 against aiohttp's 0.08 ms
(0.55 vs 0.25 ms at concurrency 1, where each event wakes the loop alone), and a plain demo server streamed
1.15x the tokens/s to aiohttp (rounds 0.95-1.45x; 0.99x at concurrency 1).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from specserve.bench.metrics import Chunk, RequestResult, request_timing
from specserve.bench.prompts import Prompt
from specserve.bench.server_probe import TRANSPORT_ERRORS

ENDPOINTS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def normalize_base_url(url: str) -> str:
    """`http://host:port`, given with or without a trailing `/` or `/v1`."""
    url = url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass(frozen=True)
class ServingConfig:
    base_url: str
    model: str
    endpoint: str = "completions"
    output_len: int = 128
    temperature: float = 0.0
    seed: int | None = None  # sent as the request's sampling seed when given
    api_key: str | None = None
    ignore_eos: bool = False  # sent only if the server accepts it (checked by the warm-up request)
    continuous_usage: bool = False  # ask for usage in every chunk (vLLM's stream_options.continuous_usage_stats)
    request_timeout_s: float = 600.0
    count_tokens: Callable[[str], int] | None = None  # a chunk's tokens from its text (rule 3), when given

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if not self.model:
            raise ValueError("--model must name the served model (see GET /v1/models)")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.output_len < 1:
            raise ValueError(f"--output-len must be >= 1, got {self.output_len}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {self.request_timeout_s}")

    @property
    def url(self) -> str:
        return normalize_base_url(self.base_url) + ENDPOINTS[self.endpoint]


def client_session(timeout_s: float, connections: int, api_key: str | None = None) -> aiohttp.ClientSession:
    """The sweep's HTTP client (open it on the event loop that uses it): up to `connections` kept open, a request
    failing after `timeout_s` seconds without progress (connecting: at most 30), `api_key` sent as a bearer token."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(30.0, timeout_s), sock_read=timeout_s)
    # read_bufsize bounds a line of the stream (an event with many logprobs can be long)
    return aiohttp.ClientSession(headers=headers, timeout=timeout, read_bufsize=1 << 20,
                                 connector=aiohttp.TCPConnector(limit=connections))


def build_body(cfg: ServingConfig, prompt: Prompt, max_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": cfg.model, "max_tokens": max_tokens, "temperature": cfg.temperature,
                            "stream": True}
    if cfg.endpoint == "chat":
        body["messages"] = prompt.as_messages()
    else:
        body["prompt"] = prompt.as_text()
    stream_options: dict[str, bool] = {"include_usage": True}
    if cfg.continuous_usage:
        stream_options["continuous_usage_stats"] = True
    body["stream_options"] = stream_options
    if cfg.seed is not None:
        body["seed"] = cfg.seed
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def _choice_content(choice: dict[str, Any]) -> tuple[str, int]:
    """(the choice's text, how many logprob entries it carries)."""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        parts = [delta.get("content"), delta.get("reasoning_content"), delta.get("reasoning")]
    else:
        parts = [choice.get("text")]
    text = "".join(p for p in parts if isinstance(p, str))
    logprobs = choice.get("logprobs")
    n = 0
    if isinstance(logprobs, dict):
        entries = logprobs.get("tokens") if "tokens" in logprobs else logprobs.get("content")
        n = len(entries) if isinstance(entries, list) else 0
    return text, n


@dataclass
class StreamReader:
    """Accumulates one request's stream; `feed` takes each decoded `data:` event with its arrival time."""

    chunks: list[Chunk] = field(default_factory=list)
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    streamed_tokens: int = 0
    answer: list[str] = field(default_factory=list)  # the answer's text (content only), kept for the next turn
    _last_cumulative: int = 0
    # Usage in every content chunk (rule 1) only when the first content chunk had it: a server that
    # puts the final usage into the last content chunk must not have all tokens counted there.
    _cumulative: bool | None = None
    count_tokens: Callable[[str], int] | None = None  # rule 3

    def feed_line(self, line: str, start: float) -> bool:
        """One line of the SSE stream (without its line break) of a request sent at `start` (perf_counter): a
        `data:` event is decoded and fed; False at `data: [DONE]`, the stream's end. Raises ValueError on data
        that is not JSON."""
        if not line.startswith("data:"):
            return True  # blank separators, comments, `event:` lines
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return False
        self.feed(json.loads(data), time.perf_counter() - start)
        return True

    def feed(self, event: Any, t_s: float) -> None:
        if not isinstance(event, dict):
            raise ValueError(f"stream event is not a JSON object: {str(event)[:100]}")
        if "error" in event and not event.get("choices"):
            raise ValueError(f"server error in stream: {str(event['error'])[:200]}")
        usage = event.get("usage")
        cumulative = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if not isinstance(cumulative, int):
            cumulative = None
        choices = event.get("choices") or []
        has_text, n_logprobs, texts = False, 0, []
        for choice in choices if isinstance(choices, list) else []:
            if isinstance(choice, dict):
                text, n = _choice_content(choice)
                has_text, n_logprobs = has_text or bool(text) or n > 0, n_logprobs + n
                texts.append(text)
                delta = choice.get("delta")
                content = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                if isinstance(content, str):
                    self.answer.append(content)
        if has_text:
            if self._cumulative is None:  # decided by the first content chunk
                self._cumulative = cumulative is not None
            if self._cumulative and cumulative is not None:
                n_tokens = cumulative - self._last_cumulative
                self._last_cumulative = cumulative
            else:
                retokenized = self.count_tokens("".join(texts)) if self.count_tokens is not None else 0
                n_tokens = n_logprobs or retokenized or 1
                self._last_cumulative += n_tokens
            if n_tokens > 0:  # else the gap rolls into the next chunk, as SGLang does
                self.chunks.append(Chunk(t_s=t_s, tokens=n_tokens))
                self.streamed_tokens += n_tokens
        if cumulative is not None:
            self.usage_tokens = cumulative
            prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
            self.prompt_tokens = prompt_tokens if isinstance(prompt_tokens, int) else self.prompt_tokens


def _failed(error: str, reader: StreamReader) -> RequestResult:
    return RequestResult(error=error, prompt_tokens=reader.prompt_tokens, usage_tokens=reader.usage_tokens,
                         streamed_tokens=reader.streamed_tokens, timing=None)


async def send_request(client: aiohttp.ClientSession, cfg: ServingConfig, prompt: Prompt, max_tokens: int,
                       ignore_eos: bool) -> RequestResult:
    return (await send_body(client, cfg, build_body(cfg, prompt, max_tokens, ignore_eos)))[0]


async def send_body(client: aiohttp.ClientSession, cfg: ServingConfig,
                    body: dict[str, Any]) -> tuple[RequestResult, str]:
    """One streamed request; its result and the answer's text."""
    reader = StreamReader(count_tokens=cfg.count_tokens)
    start = time.perf_counter()
    try:
        async with client.post(cfg.url, json=body) as resp:
            if resp.status != 200:
                detail = (await resp.read()).decode("utf-8", errors="replace").strip()
                return _failed(f"HTTP {resp.status}: {detail[:200]}", reader), ""
            async for raw in resp.content:  # lines, each with its line break
                if not reader.feed_line(raw.decode("utf-8").rstrip("\r\n"), start):
                    break
            end = time.perf_counter() - start
    except TRANSPORT_ERRORS as e:
        return _failed(f"{type(e).__name__}: {e or 'no detail'} ({cfg.url})", reader), ""
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError included
        return _failed(f"bad stream: {e}", reader), ""
    if not reader.chunks:
        return _failed("stream ended without any content token", reader), ""
    output_tokens = reader.usage_tokens if reader.usage_tokens is not None else reader.streamed_tokens
    timing = request_timing(reader.chunks, end, output_tokens)
    return RequestResult(error=None, prompt_tokens=reader.prompt_tokens, usage_tokens=reader.usage_tokens,
                         streamed_tokens=reader.streamed_tokens, timing=timing), "".join(reader.answer)
