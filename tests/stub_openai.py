"""A minimal OpenAI-compatible streaming server with known timings, to test the benchmark client against.

    python tests/stub_openai.py [--port 0] [--ttft-ms 100] [--chunk-gap-ms 20] [--tokens-per-chunk 1]
        [--fail-every 0] [--accept-length 2.5] [--token-info none|usage|logprobs] [--no-server-info] [--metrics]

Listens on 127.0.0.1 only and prints `READY http://127.0.0.1:PORT` on stdout once it serves
(--port 0 picks a free port). Behaviour of one request of max_tokens = n:
  chat only: a role chunk at once;  then `ttft_ms` of silence;  then ceil(n / tokens_per_chunk)
  content chunks `chunk_gap_ms` apart, each carrying tokens_per_chunk tokens (the last one the rest);
  then, if stream_options.include_usage, a usage chunk with completion_tokens = n; then [DONE].
How a chunk reveals its token count (--token-info): `usage` = cumulative usage in every content chunk
(only when the client asks for stream_options.continuous_usage_stats, as vLLM does), `logprobs` =
one logprob entry per token, `none` = nothing. Every fail_every-th request (counting all POSTs,
1-based) answers 500. /server_info nests avg_spec_accept_length and the cumulative counters
spec_cumulative_num_accept_tokens / spec_cumulative_num_forward_ct in internal_states as SGLang does
(one "verify step" per content chunk);
/metrics (with --metrics) exposes specserve_spec_accept_length_sum/_count counters.
Test-only endpoints: GET /stub/stats (counters, the last request body); POST /stub/config with a
JSON object of StubConfig fields: the new configuration (defaults for the fields left out), counters zeroed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

TOKEN_INFO = ("none", "usage", "logprobs")


@dataclass(frozen=True)
class StubConfig:
    ttft_ms: float = 100.0
    chunk_gap_ms: float = 20.0
    tokens_per_chunk: int = 1
    fail_every: int = 0  # 0 = never fail
    accept_length: float | None = 2.5  # None = /server_info without avg_spec_accept_length
    token_info: str = "none"
    server_info: bool = True  # False = /server_info answers 404
    metrics: bool = False  # True = /metrics exposes accept-length counters
    reject_ignore_eos: bool = False  # True = a body with ignore_eos answers 422, like a strict server

    def __post_init__(self) -> None:
        if self.ttft_ms < 0 or self.chunk_gap_ms < 0:
            raise ValueError("--ttft-ms and --chunk-gap-ms must be >= 0")
        if self.tokens_per_chunk < 1:
            raise ValueError(f"--tokens-per-chunk must be >= 1, got {self.tokens_per_chunk}")
        if self.fail_every < 0:
            raise ValueError(f"--fail-every must be >= 0 (0 = never), got {self.fail_every}")
        if self.token_info not in TOKEN_INFO:
            raise ValueError(f"--token-info must be one of {', '.join(TOKEN_INFO)}, got {self.token_info!r}")


@dataclass
class StubState:
    config: StubConfig
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    accept_sum: float = 0.0
    accept_count: int = 0
    last_body: dict[str, Any] = field(default_factory=dict)

    def stats(self) -> dict[str, Any]:
        return {"requests": self.requests, "in_flight": self.in_flight, "max_in_flight": self.max_in_flight,
                "last_body": self.last_body, "config": asdict(self.config)}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) for m in body["messages"])
    return len(str(body.get("prompt", "")).split())


async def _stream(state: StubState, body: dict[str, Any], chat: bool) -> AsyncIterator[str]:
    cfg = state.config
    n = int(body.get("max_tokens") or 16)
    opts = body.get("stream_options") or {}
    usage_every_chunk = cfg.token_info == "usage" and bool(opts.get("continuous_usage_stats"))
    prompt_tokens = _prompt_tokens(body)
    base = {"id": f"stub-{state.requests}", "model": body.get("model", "stub"), "created": 0,
            "object": "chat.completion.chunk" if chat else "text_completion"}
    left = True
    try:
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        left = False
        if chat:
            yield _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(cfg.ttft_ms / 1000.0)
        sent = chunks = 0
        while sent < n:
            if chunks:
                await asyncio.sleep(cfg.chunk_gap_ms / 1000.0)
            tokens = [f" t{sent + j}" for j in range(min(cfg.tokens_per_chunk, n - sent))]
            sent, chunks = sent + len(tokens), chunks + 1
            text, finish = "".join(tokens), ("length" if sent == n else None)
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
                if cfg.token_info == "logprobs":
                    choice["logprobs"] = {"content": [{"token": t, "logprob": -0.1} for t in tokens]}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
                if cfg.token_info == "logprobs":
                    choice["logprobs"] = {"tokens": tokens, "token_logprobs": [-0.1] * len(tokens)}
            chunk = {**base, "choices": [choice]}
            if usage_every_chunk:
                chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": sent,
                                  "total_tokens": prompt_tokens + sent}
            yield _sse(chunk)
        if opts.get("include_usage"):
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
            yield _sse({**base, "choices": [], "usage": usage})
        if cfg.accept_length is not None:
            state.accept_sum += cfg.accept_length * chunks
            state.accept_count += chunks
        # Leave before [DONE], so a client that starts its next request on [DONE] is never seen overlapping.
        state.in_flight -= 1
        left = True
        yield "data: [DONE]\n\n"
    finally:
        if not left:
            state.in_flight -= 1


def build_app(state: StubState, on_ready: str | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_ready:
            print(on_ready, flush=True)
        yield

    app = FastAPI(lifespan=lifespan)

    async def generate(request: Request, chat: bool) -> Response:
        body = await request.json()
        state.requests += 1
        state.last_body = body
        cfg = state.config
        if cfg.fail_every and state.requests % cfg.fail_every == 0:
            return JSONResponse({"error": {"message": f"stub failure of request {state.requests}"}}, status_code=500)
        if cfg.reject_ignore_eos and "ignore_eos" in body:
            return JSONResponse({"detail": "extra field ignore_eos not permitted"}, status_code=422)
        if not body.get("stream"):
            return JSONResponse({"error": {"message": "the stub only streams"}}, status_code=400)
        return StreamingResponse(_stream(state, body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/server_info")
    async def server_info() -> Response:
        if not state.config.server_info:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        internal: dict[str, float] = {}
        if state.config.accept_length is not None:  # as newer SGLang: the average and cumulative counters
            internal = {"avg_spec_accept_length": state.config.accept_length,
                        "spec_cumulative_num_accept_tokens": state.accept_sum,
                        "spec_cumulative_num_forward_ct": state.accept_count}
        info = {"model_path": "stub-model", "speculative_algorithm": "STUB", "internal_states": [internal]}
        return JSONResponse(info)

    @app.get("/metrics")
    async def metrics() -> Response:
        if not state.config.metrics:
            return PlainTextResponse("not found", status_code=404)
        return PlainTextResponse(
            "# TYPE specserve_spec_accept_length_sum counter\n"
            f'specserve_spec_accept_length_sum{{model="stub"}} {state.accept_sum}\n'
            "# TYPE specserve_spec_accept_length_count counter\n"
            f'specserve_spec_accept_length_count{{model="stub"}} {state.accept_count}\n'
        )

    @app.get("/stub/stats")
    async def stub_stats() -> dict[str, Any]:
        return state.stats()

    @app.post("/stub/config")
    async def stub_config(request: Request) -> Response:
        try:
            config = StubConfig(**(await request.json()))
        except (TypeError, ValueError) as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        state.config = config
        state.requests = state.max_in_flight = state.accept_count = 0
        state.accept_sum = 0.0
        state.last_body = {}
        return JSONResponse(state.stats())

    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ttft-ms", type=float, default=100.0)
    p.add_argument("--chunk-gap-ms", type=float, default=20.0)
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--accept-length", type=float, default=2.5)
    p.add_argument("--token-info", choices=TOKEN_INFO, default="none")
    p.add_argument("--no-server-info", action="store_true")
    p.add_argument("--metrics", action="store_true")
    a = p.parse_args(argv)
    config = StubConfig(ttft_ms=a.ttft_ms, chunk_gap_ms=a.chunk_gap_ms, tokens_per_chunk=a.tokens_per_chunk,
                        fail_every=a.fail_every, accept_length=a.accept_length, token_info=a.token_info,
                        server_info=not a.no_server_info, metrics=a.metrics)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", a.port))
    sock.listen(256)  # connections made before uvicorn starts accepting wait in the backlog
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    app = build_app(StubState(config=config), on_ready=f"READY {url}")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
